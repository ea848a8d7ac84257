"""The run inspector in a real headless Chromium (Debian's chromium + chromedriver, driven by Selenium), served by
ui/server.py over an MLflow store that holds a real 3-step training run and a run with hostile strings."""

import itertools
import random
import threading
import time

import httpx
import pytest
import uvicorn
from mlflow.tracking import MlflowClient
from PIL import Image
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from flows.step_report import thumbnail_urls
from tests.browser import ARTIFACTS, chromium
from tests.conftest import free_port, small_run_overrides
from ui.server import Links, create_app

HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
HOSTILE_IMAGES = ["javascript:window.__pwned = 3", "data:text/html,<script>window.__pwned = 4</script>", HOSTILE]


ROLLOUT_SECONDS = {1: 1.7, 2: 1.2, 3: 0.9}  # the two-stream run's rollout worker seconds per step


@pytest.fixture(scope="module")
def store(tmp_path_factory, demo_cache, ray_address, prefect_api):
    """A real training run (GRPO, 3 steps, samples every step), a run with its stage seconds and a rollout of its
    own's, and a last run whose logged strings are hostile."""
    from flows.train import train

    folder = tmp_path_factory.mktemp("inspector")
    result = train(overrides=small_run_overrides(folder, demo_cache, "trainer.experiment_name=inspected"))
    client = MlflowClient(result["tracking_uri"])
    experiment = client.get_experiment_by_name("ppoflow").experiment_id
    # the real run's stage seconds again, as a run with a rollout of its own logs them: beside them its workers'
    two_streams = client.create_run(experiment, run_name="two streams").info.run_id
    for key in [k for k in client.get_run(result["run_id"]).data.metrics if k.startswith("timing_s/")]:
        for point in client.get_metric_history(result["run_id"], key):
            client.log_metric(two_streams, key, point.value, step=point.step)
    for step, seconds in ROLLOUT_SECONDS.items():
        client.log_metric(two_streams, "perf/time_per_step", 2.0, step=step)
        client.log_metric(two_streams, "timing_s/generate_ahead", seconds, step=step)
    client.set_terminated(two_streams)  # before the hostile run: that one stays the newest
    hostile = client.create_run(experiment, run_name="hostile").info.run_id
    client.log_param(hostile, "algorithm.adv_estimator", "rloo")
    # a path with no place to break a line (the page must still fit 1000 px)
    client.log_param(hostile, "actor_rollout_ref.model.path", "/home/researcher/checkpoints/qwen2_5_7b_instruct_sft_v3")
    client.log_metric(hostile, "critic/score/mean", 0.5, step=1)
    # a vision-language run's samples carry image thumbnails: the hostile row's "images" are not images
    red = Image.new("RGB", (48, 48), (220, 40, 40))
    client.log_table(
        hostile,
        {
            "prompt": [HOSTILE, "which colour?"],
            "response": [HOSTILE, "red"],
            "score": [1.0, 1.0],
            "advantage": [0.5, 0.5],
            "response_tokens": [["<script>", "alert(1)", "</script>"], ["red"]],
            "token_advantages": [[0.5, -0.5, 0.1], [0.5]],
            "images": [HOSTILE_IMAGES, thumbnail_urls({"image": [red]})],
        },
        artifact_file="samples/step_000001.json",
    )
    client.set_terminated(hostile)
    return {"uri": result["tracking_uri"], "run_id": result["run_id"], "hostile": hostile, "two_streams": two_streams}


@pytest.fixture(scope="module")
def server(store):
    port = free_port()
    # the MLflow link points at a page that answers (this server), Prefect's and Ray's at ports nobody serves
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    app = create_app(store["uri"], Links(f"http://127.0.0.1:{port}", *dead), "ppoflow")
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser():
    chrome = chromium()
    yield chrome
    chrome.quit()


def open_page(browser, server, select_runs=None, width=1600):
    browser.set_window_size(width, 1000)
    browser.get(server + "/")
    wait = WebDriverWait(browser, 30)
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#runs tbody tr"))
    browser.execute_script("document.getElementById('autorefresh').checked = false")  # no redraw while we look
    if select_runs is not None:
        for row in browser.find_elements(By.CSS_SELECTOR, "#runs tbody tr"):
            box = row.find_element(By.CSS_SELECTOR, "input[type=checkbox]")
            if (row.get_attribute("data-run-id") in select_runs) != box.is_selected():
                box.click()
        wanted = ",".join(sorted(select_runs))
        wait.until(lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-rendered") == wanted)
    else:
        wait.until(lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-rendered") is not None)
    return wait


def painted_pixels(browser, canvas) -> int:
    """Pixels of a chart canvas that are not transparent (uPlot draws on a canvas: the page source shows nothing)."""
    return browser.execute_script(
        "const c = arguments[0]; const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;let n = 0; "
        "for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n;",
        canvas,
    )


def chart(browser, title):
    return browser.find_element(By.CSS_SELECTOR, f".chart[data-title='{title}']")


def test_the_run_list_shows_the_run(browser, server, store):
    open_page(browser, server)
    row = browser.find_element(By.CSS_SELECTOR, f"#runs tr[data-run-id='{store['run_id']}']")
    cells = [cell.text for cell in row.find_elements(By.TAG_NAME, "td")]
    assert cells[1].endswith("inspected") and cells[2] == "FINISHED" and cells[3] == "grpo" and cells[5] == "3"
    assert "tiny-sft" in cells[4]
    validation = (
        MlflowClient(store["uri"]).get_run(store["run_id"]).data.metrics["val-core/ppoflow/addition/acc/mean_at_1"]
    )
    assert cells[7] == f"{validation:.3f}" and cells[8] and cells[9].endswith(" s")  # validation, start, duration
    mlflow_link = row.find_element(By.LINK_TEXT, "MLflow").get_attribute("href")  # in MLflow's model-training view
    assert mlflow_link.endswith(f"/runs/{store['run_id']}?workflowType=machine_learning")
    # the run's Prefect server (the tests' harness) is up: linked; the header's Prefect and Ray links do not answer
    assert "/runs/flow-run/" in row.find_element(By.LINK_TEXT, "Prefect").get_attribute("href")
    header = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#links a")]
    assert header == ["MLflow"]
    hostile = browser.find_element(By.CSS_SELECTOR, f"#runs tr[data-run-id='{store['hostile']}']")
    assert hostile.find_elements(By.LINK_TEXT, "Prefect") == []  # no flow run recorded: no link
    # the default selection: the newest run that has something to show
    assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-rendered") == store["hostile"]


def test_the_curves_are_drawn(browser, server, store):
    open_page(browser, server, select_runs={store["run_id"]})
    for title, label in (
        ("score", "critic/score/mean"),
        ("entropy", "actor/entropy"),
        ("KL", "actor/kl_loss"),
        ("response length", "response_length/mean"),
        ("throughput (tokens/s)", "perf/throughput"),
        ("validation accuracy", "val-core/ppoflow/addition/acc/mean_at_1"),
    ):
        box = chart(browser, title)
        assert painted_pixels(browser, box.find_element(By.TAG_NAME, "canvas")) > 200, title
        assert label in box.find_element(By.CLASS_NAME, "u-legend").text, title


def test_the_timeline_shows_every_stage_that_ran(browser, server, store):
    open_page(browser, server, select_runs={store["run_id"]})
    metrics = MlflowClient(store["uri"]).get_run(store["run_id"]).data.metrics
    stages = {k[len("timing_s/") :] for k in metrics if k.startswith("timing_s/")}
    assert {"gen", "reward", "old_log_prob", "ref", "adv", "update_actor"} <= stages
    box = browser.find_element(By.CSS_SELECTOR, "#timeline .chart")
    legend = box.find_element(By.CLASS_NAME, "u-legend").text
    assert all(f"{stage} (s)" in legend for stage in stages), legend
    assert painted_pixels(browser, box.find_element(By.TAG_NAME, "canvas")) > 200
    labels = [s["label"] for s in browser.execute_script("return arguments[0].uplot.series", box)[1:]]
    ran = [f"{s} (s)" for s in ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "testing")]
    assert labels == [*ran, "controller overhead (s)", "time per step (s)"]  # stacked in the order the stages run


def legend_at_step(browser, box, step: int) -> dict[str, str]:
    """The timeline's legend (label -> value shown) with the cursor on ``step``."""
    rows = browser.execute_script(
        "const u = arguments[0].uplot; u.setCursor({left: u.valToPos(arguments[1], 'x'), top: 10});"
        "return [...arguments[0].querySelectorAll('.u-legend tr.u-series')].map("
        "r => [r.querySelector('.u-label').textContent, r.querySelector('.u-value').textContent]);",
        box,
        step,
    )
    return dict(rows)


def test_a_rollout_of_its_own_is_a_second_stream_beside_the_trainers(browser, server, store):
    open_page(browser, server, select_runs={store["two_streams"]})
    box = browser.find_element(By.CSS_SELECTOR, "#timeline .chart")
    labels = [s["label"] for s in browser.execute_script("return arguments[0].uplot.series", box)[1:]]
    assert labels[-3:] == ["controller overhead (s)", "rollout worker generating (s)", "time per step (s)"]
    for step, seconds in ROLLOUT_SECONDS.items():
        shown = legend_at_step(browser, box, step)
        assert float(shown["rollout worker generating (s)"]) == pytest.approx(seconds, abs=1e-3)
    # the two streams side by side: the rollout's bar right of the step's centre, the trainer's left of it
    columns = browser.execute_script(
        "const u = arguments[0].uplot, c = arguments[0].querySelector('canvas'), ctx = c.getContext('2d');"
        "const x = Math.round(u.valToPos(1, 'x', true) + u.bbox.left), y0 = u.bbox.top, h = u.bbox.height;"
        "const painted = (dx) => { const d = ctx.getImageData(x + dx, y0, 1, h).data; let n = 0;"
        " for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; };"
        "return [painted(-6), painted(6)];",
        box,
    )
    assert all(count > 5 for count in columns), columns


def test_the_timeline_hover_shows_each_stage_own_seconds(browser, server, store):
    open_page(browser, server, select_runs={store["run_id"]})
    metrics = MlflowClient(store["uri"])
    box = browser.find_element(By.CSS_SELECTOR, "#timeline .chart")
    for step in (1, 2):
        values = legend_at_step(browser, box, step)
        assert values["step"] == str(step)
        for label, value in values.items():
            if label.endswith(" (s)") and label not in ("controller overhead (s)", "time per step (s)"):
                key = "timing_s/" + label[: -len(" (s)")]
                logged = {m.step: m.value for m in metrics.get_metric_history(store["run_id"], key)}.get(step, 0.0)
                assert value == f"{logged:.3f}", (step, label)
        logged_step = {m.step: m.value for m in metrics.get_metric_history(store["run_id"], "perf/time_per_step")}
        assert values["time per step (s)"] == f"{logged_step[step]:.3f}"
        ticks = browser.execute_script("return arguments[0].uplot.axes[0]._values", box)
        assert all(t == "" or float(t).is_integer() for t in ticks), ticks  # whole steps only


def test_the_rollout_browser_colours_tokens_and_filters(browser, server, store):
    open_page(browser, server, select_runs={store["run_id"]})
    Select(browser.find_element(By.ID, "sample-step")).select_by_value("3")
    wait = WebDriverWait(browser, 30)
    samples = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#samples .sample"))
    assert len(samples) == 16  # trainer.num_logged_samples
    tokens = browser.find_elements(By.CSS_SELECTOR, "#samples .token")
    assert tokens and all(t.value_of_css_property("background-color").startswith("rgba") for t in tokens)
    first = samples[0].find_element(By.CLASS_NAME, "response").text
    browser.find_element(By.ID, "search").send_keys("no such text anywhere")
    assert browser.find_elements(By.CSS_SELECTOR, "#samples .sample") == []
    browser.find_element(By.ID, "search").clear()
    browser.execute_script(
        "const s = document.getElementById('search'); s.value = arguments[0]; s.dispatchEvent(new Event('input'));",
        first[:3],
    )
    assert 1 <= len(browser.find_elements(By.CSS_SELECTOR, "#samples .sample")) <= 16
    browser.execute_script(
        "const s = document.getElementById('search'); s.value = ''; s.dispatchEvent(new Event('input'));"
    )
    browser.execute_script(
        "const s = document.getElementById('score-min'); s.value = '2'; s.dispatchEvent(new Event('input'));"
    )
    assert browser.find_elements(By.CSS_SELECTOR, "#samples .sample") == []  # the addition task scores 0 or 1
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.execute_script(
        "const s = document.getElementById('score-min'); s.value = ''; s.dispatchEvent(new Event('input'));"
    )
    assert browser.save_screenshot(str(ARTIFACTS / "ui-inspector.png"))


def test_two_runs_side_by_side_show_only_the_config_keys_that_differ(browser, server, store):
    open_page(browser, server, select_runs={store["run_id"], store["hostile"]})
    rows = browser.find_elements(By.CSS_SELECTOR, "#config-diff tbody tr")
    keys = [row.find_element(By.TAG_NAME, "td").text for row in rows]
    # the hostile run set only the estimator
    assert "algorithm.adv_estimator" in keys and "data.train_batch_size" in keys
    assert (
        len(
            chart(browser, "score")
            .find_element(By.CLASS_NAME, "u-legend")
            .find_elements(By.CSS_SELECTOR, "tr.u-series")
        )
        == 3
    )


def chart_boxes(browser):
    return browser.execute_script(
        "return [...document.querySelectorAll('#curves .chart, #timeline .chart')].map(c => { const r ="
        " c.getBoundingClientRect(); const canvas = c.querySelector('canvas'); return {title: c.dataset.title, left:"
        " r.left, right: r.right, top: r.top, bottom: r.bottom, canvas: canvas ? canvas.getBoundingClientRect().width"
        " : null}; })"
    )


@pytest.mark.parametrize("width", [1600, 1000])
def test_every_chart_fits_its_own_cell(browser, server, store, width):
    open_page(browser, server, select_runs={store["run_id"], store["hostile"]}, width=width)
    viewport = browser.execute_script("return document.documentElement.clientWidth")
    # the page itself does not scroll sideways: no element reaches past the viewport
    assert browser.execute_script("return document.documentElement.scrollWidth") <= viewport, browser.execute_script(
        "return [...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > "
        "document.documentElement.clientWidth).slice(0, 5).map(e => e.tagName + '#' + e.id + '.' + e.className + ' ' + "
        "Math.round(e.getBoundingClientRect().right))"
    )
    boxes = chart_boxes(browser)
    assert len(boxes) >= 8  # six curves and a timeline per run
    for box in boxes:
        assert box["right"] <= viewport, box
        assert box["canvas"] is None or 0 < box["canvas"] <= box["right"] - box["left"] + 1, box  # None: a placeholder
    for a, b in itertools.combinations(boxes, 2):  # no two charts overlap
        apart = a["right"] <= b["left"] or b["right"] <= a["left"] or a["bottom"] <= b["top"] or b["bottom"] <= a["top"]
        assert apart, (a, b)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.set_window_size(width, browser.execute_script("return document.body.scrollHeight") + 100)
    assert browser.save_screenshot(str(ARTIFACTS / f"ui-inspector-{width}.png"))


def test_a_zoom_survives_a_refresh(browser, server, store):
    open_page(browser, server, select_runs={store["run_id"]})
    box = chart(browser, "score")
    over = box.find_element(By.CLASS_NAME, "u-over")
    width = over.size["width"]
    ActionChains(browser).move_to_element_with_offset(over, -width // 4, 0).click_and_hold().move_by_offset(
        width // 3, 0
    ).release().perform()
    zoomed = browser.execute_script("const x = arguments[0].uplot.scales.x; return [x.min, x.max]", box)
    full = browser.execute_script("const d = arguments[0].uplot.data[0]; return [d[0], d[d.length - 1]]", box)
    assert full[0] < zoomed[0] < zoomed[1] < full[1]
    browser.execute_async_script("refreshSelection().then(arguments[arguments.length - 1])")  # a full redraw
    assert chart(browser, "score") == box  # the same chart, given its data in place
    assert browser.execute_script("const x = arguments[0].uplot.scales.x; return [x.min, x.max]", box) == zoomed


def plain_ema(values, weight):
    """TensorBoard's debiased EMA, as a loop over the points."""
    out, mean = [], 0.0
    for n, value in enumerate(values, start=1):
        mean = weight * mean + (1 - weight) * value
        out.append(mean / (1 - weight**n))
    return out


def test_smoothing_is_tensorboards_debiased_ema(browser, server, store):
    open_page(browser, server)
    rng = random.Random(0)
    values = [rng.gauss(0, 1) for _ in range(50)]
    for weight in (0.0, 0.6, 0.95):
        smoothed = browser.execute_script("return ema(arguments[0], arguments[1])", values, weight)
        assert smoothed == pytest.approx(plain_ema(values, weight) if weight else values, rel=1e-9)


def test_any_logged_metric_can_be_charted(browser, server, store):
    open_page(browser, server, select_runs={store["run_id"]})
    browser.find_element(By.CSS_SELECTOR, "#metric-picker summary").click()
    groups = [g.text for g in browser.find_elements(By.CSS_SELECTOR, "#metric-groups legend")]
    assert any(g.startswith("actor (") for g in groups) and any(g.startswith("timing_s (") for g in groups)
    browser.find_element(By.ID, "metric-search").send_keys("pg_loss")
    browser.find_element(By.CSS_SELECTOR, "#metric-groups input[value='actor/pg_loss']").click()
    WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.CSS_SELECTOR, ".chart[data-title='actor/pg_loss']"))
    assert [c.get_attribute("data-title") for c in browser.find_elements(By.CSS_SELECTOR, "#curves .chart")] == [
        "actor/pg_loss"
    ]
    assert painted_pixels(browser, chart(browser, "actor/pg_loss").find_element(By.TAG_NAME, "canvas")) > 200
    browser.find_element(By.ID, "metric-defaults").click()  # the choice is remembered: back to the six for the rest
    WebDriverWait(browser, 30).until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#curves .chart")) == 6)


def test_samples_group_by_prompt_sort_and_show_a_compact_view(browser, server, store):
    open_page(browser, server, select_runs={store["run_id"]})
    Select(browser.find_element(By.ID, "sample-step")).select_by_value("3")
    groups = WebDriverWait(browser, 30).until(lambda b: b.find_elements(By.CSS_SELECTOR, "#samples .group"))
    assert len(groups) == 4 and all(len(g.find_elements(By.CLASS_NAME, "sample")) == 4 for g in groups)  # n = 4
    assert all("ground truth" in g.find_element(By.CLASS_NAME, "group-head").text for g in groups)
    Select(browser.find_element(By.ID, "sample-sort")).select_by_value("advantage")
    browser.execute_script("const c = document.getElementById('group-by-prompt'); c.click();")
    metas = [m.text for m in browser.find_elements(By.CSS_SELECTOR, "#samples .sample .meta")]
    advantages = [float(m.split("advantage ")[1].split(" ")[0]) for m in metas]
    assert len(advantages) == 16 and advantages == sorted(advantages, reverse=True)
    browser.execute_script("document.getElementById('compact').click();")
    rows = browser.find_elements(By.CSS_SELECTOR, "#samples tr.compact-row")
    assert len(rows) == 16
    assert not any("<|im_start|>" in row.text for row in rows)  # the chat template is hidden
    legend = browser.find_element(By.ID, "colour-legend").text
    assert "uncoloured at 0" in legend
    for box in ("compact", "group-by-prompt"):
        browser.execute_script(f"document.getElementById('{box}').click();")
    Select(browser.find_element(By.ID, "sample-sort")).select_by_value("batch")


def test_a_token_with_zero_advantage_is_not_tinted(browser):
    assert browser.execute_script("return tokenColour(0, 1, SCALES.advantage)").endswith(", 0.00)")
    assert browser.execute_script("return tokenColour(-1, 1, SCALES.kl)") == "rgba(31, 119, 180, 0.75)"


def test_an_empty_experiment_says_how_to_start_a_run(browser, server, store):
    MlflowClient(store["uri"]).create_experiment("empty-one")
    open_page(browser, server)
    browser.execute_async_script(
        "const done = arguments[arguments.length - 1]; const s = document.getElementById('experiment');"
        "if (![...s.options].some(o => o.value === 'empty-one')) s.append(new Option('empty-one', 'empty-one'));"
        "s.value = 'empty-one'; s.dispatchEvent(new Event('change')); state.queue.then(done);"
    )
    assert "ppoflow train" in browser.find_element(By.ID, "runs-empty").text
    assert "Tick a run" in browser.find_element(By.ID, "curves").text


def test_a_run_keeps_its_colour_when_another_run_appears(browser, server, store):
    open_page(browser, server, select_runs={store["run_id"]})

    def colours():
        return {
            row.get_attribute("data-run-id"): row.find_element(By.CLASS_NAME, "swatch").value_of_css_property("color")
            for row in browser.find_elements(By.CSS_SELECTOR, "#runs tbody tr")
        }

    before = colours()
    client = MlflowClient(store["uri"])
    newcomer = client.create_run(client.get_experiment_by_name("ppoflow").experiment_id, run_name="newcomer")
    try:
        browser.execute_async_script("refreshAll().then(arguments[arguments.length - 1])")
        after = colours()
        assert {run: after[run] for run in before} == before  # nobody's colour moved
        assert after[newcomer.info.run_id] not in before.values()
    finally:
        client.delete_run(newcomer.info.run_id)


def test_logged_strings_are_text_never_html(browser, server, store):
    open_page(browser, server, select_runs={store["hostile"]})
    wait = WebDriverWait(browser, 30)
    sample = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#samples .sample"))[0]
    assert HOSTILE in sample.find_element(By.CLASS_NAME, "prompt").text
    assert sample.find_element(By.CLASS_NAME, "response").text == "<script>alert(1)</script>"
    assert browser.execute_script("return window.__pwned") is None
    assert browser.find_elements(By.CSS_SELECTOR, "#samples script") == []
    assert sample.find_elements(By.TAG_NAME, "img") == []  # its "images" are no PNG data URLs: none is shown
    # the other sample's thumbnail is shown beside its response, drawn (the browser decoded the PNG)
    (thumbnail,) = browser.find_elements(By.CSS_SELECTOR, "#samples .thumbs img")
    assert thumbnail.get_attribute("src").startswith("data:image/png;base64,")
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", thumbnail) == 48


def test_the_server_only_reads(server, store):
    assert httpx.post(f"{server}/api/runs").status_code == 405
    assert httpx.delete(f"{server}/api/samples?run={store['run_id']}&step=1").status_code == 405
    page = httpx.get(f"{server}/")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(f"{server}/api/curves").status_code == 400  # no run named: a clear error, not a crash
    assert "error" in httpx.get(f"{server}/api/timeline?run=nope").json()


def test_a_page_elsewhere_cannot_read_the_store_through_a_rebound_dns_name(server, store):
    """DNS rebinding: evil.example resolved to 127.0.0.1 sends Host: evil.example. Only loopback names are served."""
    assert httpx.get(f"{server}/api/runs", headers={"Host": "evil.example"}).status_code == 400
    assert httpx.get(f"{server}/api/runs", headers={"Host": f"localhost:{server.rsplit(':', 1)[1]}"}).status_code == 200


def test_the_settings_never_echo_a_password():
    app = create_app("https://mlflow:hunter2@mlflow.internal", Links(), "ppoflow")  # a server behind basic auth
    settings = next(route for route in app.routes if getattr(route, "path", "") == "/api/settings")
    from starlette.testclient import TestClient

    assert (
        TestClient(app, base_url="http://127.0.0.1").get(settings.path).json()["tracking_uri"]
        == "https://mlflow:***@mlflow.internal"
    )


def test_ppoflow_ui_binds_to_loopback_by_default():
    from flows.cli import build_parser

    assert build_parser().parse_args(["ui"]).host == "127.0.0.1"
