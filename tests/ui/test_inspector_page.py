"""The run inspector in a real headless Chromium (Debian's chromium + chromedriver, driven by Selenium), served by
ui/server.py over an MLflow store that holds a real 3-step training run and a run with hostile strings."""

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from mlflow.tracking import MlflowClient
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.conftest import ROOT, free_port, small_run_overrides
from ui.server import Links, create_app

ARTIFACTS = Path(os.environ.get("PPOFLOW_TEST_ARTIFACTS", ROOT / "test-artifacts"))
HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


@pytest.fixture(scope="module")
def store(tmp_path_factory, demo_cache, ray_address, prefect_api):
    """A real training run (GRPO, 3 steps, samples every step) and a second run whose logged strings are hostile."""
    from flows.train import train

    folder = tmp_path_factory.mktemp("inspector")
    result = train(overrides=small_run_overrides(folder, demo_cache, "trainer.experiment_name=inspected"))
    client = MlflowClient(result["tracking_uri"])
    experiment = client.get_experiment_by_name("ppoflow").experiment_id
    hostile = client.create_run(experiment, run_name="hostile").info.run_id
    client.log_param(hostile, "algorithm.adv_estimator", "rloo")
    client.log_metric(hostile, "critic/score/mean", 0.5, step=1)
    client.log_table(
        hostile,
        {
            "prompt": [HOSTILE],
            "response": [HOSTILE],
            "score": [1.0],
            "advantage": [0.5],
            "response_tokens": [["<script>", "alert(1)", "</script>"]],
            "token_advantages": [[0.5, -0.5, 0.1]],
        },
        artifact_file="samples/step_000001.json",
    )
    client.set_terminated(hostile)
    return {"uri": result["tracking_uri"], "run_id": result["run_id"], "hostile": hostile}


@pytest.fixture(scope="module")
def server(store):
    port = free_port()
    app = create_app(
        store["uri"], Links("http://127.0.0.1:5000", "http://127.0.0.1:4200", "http://127.0.0.1:8265"), "ppoflow"
    )
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
    # a fresh machine: install them, as .ci/run does
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        installed = subprocess.run(
            [str(Path(__file__).with_name("install_chromium.sh"))], capture_output=True, text=True
        )
        assert installed.returncode == 0, (
            f"the page tests need Debian's chromium and chromium-driver: {installed.stderr[-500:]}"
        )
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,2400",
    ):
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    yield chrome
    chrome.quit()


def open_page(browser, server, select_runs=None):
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
    assert row.find_element(By.LINK_TEXT, "MLflow").get_attribute("href").endswith(f"/runs/{store['run_id']}")
    assert "/runs/flow-run/" in row.find_element(By.LINK_TEXT, "Prefect").get_attribute("href")
    assert browser.find_element(By.LINK_TEXT, "Ray dashboard").get_attribute("href").startswith("http://127.0.0.1:8265")


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


def test_logged_strings_are_text_never_html(browser, server, store):
    open_page(browser, server, select_runs={store["hostile"]})
    wait = WebDriverWait(browser, 30)
    sample = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#samples .sample"))[0]
    assert HOSTILE in sample.find_element(By.CLASS_NAME, "prompt").text
    assert sample.find_element(By.CLASS_NAME, "response").text == "<script>alert(1)</script>"
    assert browser.execute_script("return window.__pwned") is None
    assert browser.find_elements(By.CSS_SELECTOR, "#samples script, #samples img") == []


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
