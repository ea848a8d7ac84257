"""``ppoflow up / status / down`` on loopback: real Prefect, MLflow and Ray servers, started and stopped by the test
(PPOFLOW_HOME in a temporary folder), and a training run that uses them, seen in their UIs by a real Chromium."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
from mlflow.tracking import MlflowClient
from selenium.webdriver.common.by import By

from flows.prefect_view import mlflow_run_url
from infra.stack import port_open
from tests.browser import chromium, page_text_once_it_shows, screenshot
from tests.conftest import free_port
from tests.infra.conftest import SMALL_DEMO, ppoflow, process_group_alive


def test_up_status_train_down(stack_env, tmp_path, demo_cache):
    # as on a machine that never ran Ray: a home of its own, without ~/.ray/auth_token (`up` makes the token its Ray
    # head needs; the head exited at once without it)
    stack_env = {**stack_env, "HOME": str(tmp_path / "user")}
    ports = {"prefect": free_port(), "mlflow": free_port(), "ray": free_port()}
    started = ppoflow(
        stack_env,
        "up",
        "--prefect-port",
        str(ports["prefect"]),
        "--mlflow-port",
        str(ports["mlflow"]),
        "--ray-port",
        str(ports["ray"]),
    )
    assert started.returncode == 0, started.stdout + started.stderr
    state = json.loads((tmp_path / "home" / "stack.json").read_text())
    services = state["services"]
    assert {name: s["port"] for name, s in services.items() if name != "launcher"} == ports
    assert services["launcher"]["url"] == f"unix:{tmp_path / 'home' / 'launcher.sock'}"
    assert f"export PREFECT_API_URL=http://127.0.0.1:{ports['prefect']}/api" in started.stdout
    assert httpx.get(f"http://127.0.0.1:{ports['prefect']}/api/health").status_code == 200
    threads = os.listdir(f"/proc/{services['prefect']['pid']}/task")  # it answers: on the CPU time runs leave idle
    assert {os.sched_getscheduler(int(thread)) for thread in threads} == {os.SCHED_IDLE}, threads
    assert httpx.get(f"http://127.0.0.1:{ports['mlflow']}/health").status_code == 200
    assert port_open(ports["ray"])
    token = tmp_path / "user" / ".ray" / "auth_token"
    assert token.stat().st_mode & 0o777 == 0o600  # the owner's only
    status = ppoflow(stack_env, "status", timeout=60)
    assert status.returncode == 0 and status.stdout.count("running, answers") == 4
    again = ppoflow(stack_env, "up")  # idempotent: nothing new
    assert again.returncode == 0 and again.stdout.count("already running") == 4
    assert json.loads((tmp_path / "home" / "stack.json").read_text())["services"] == services

    # a training run uses the stack: its Ray head, its MLflow server, its Prefect server. As the README has it: the
    # embedded demo from a folder of one's own, with its relative paths (.ppoflow, checkpoints/...), which the stack's
    # workers (running in the stack's folder) find
    work = tmp_path / "work"
    work.mkdir()
    (work / ".ppoflow").symlink_to(demo_cache)  # the demo's assets, built once for the session
    overrides = [*SMALL_DEMO, "trainer.total_training_steps=1", "trainer.test_freq=-1"]
    trained = ppoflow(stack_env, "train", "--verbose", *overrides, timeout=600, cwd=work)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    # it ran in a process forked by the stack's launcher (its modules imported), which found the stack as the
    # command would have
    lines = trained.stdout.splitlines()
    assert lines[0].startswith("ppoflow train: runs in a process of the stack's launcher"), lines[:3]
    assert lines[1].startswith("ppoflow train: using the ppoflow stack"), lines[:3]
    # --verbose: the start-up phases, in seconds since the command began, in order; the set-up line has the rest
    phases = [line.split(" s ", 1)[1] for line in trained.stdout.splitlines() if " +" in line and " s " in line]
    assert phases[:2] == ["Prefect and the stack configured", "config, inputs and resume checked"], phases
    # the workers were built while the flow's modules imported (their namespace is the checkpoint folder's)
    assert "workers built while Prefect's server started" in trained.stdout + trained.stderr
    result = json.loads(trained.stdout.strip().splitlines()[-1])
    assert result["tracking_uri"] == f"http://127.0.0.1:{ports['mlflow']}"
    assert MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).info.status == "FINISHED"
    flow_runs = httpx.post(f"http://127.0.0.1:{ports['prefect']}/api/flow_runs/filter", json={}).json()
    assert [run["name"] for run in flow_runs] and all(run["state_type"] == "COMPLETED" for run in flow_runs)
    assert (work / "checkpoints" / "ppoflow" / "demo" / "global_step_1" / "actor").is_dir()
    views_of_the_run(ports, flow_runs[0]["id"], result)
    # it ended by leaving its worker group on the stack (started as a standby group's), for the next run
    assert "left 1 standby worker(s) in " in trained.stdout + trained.stderr
    assert "the run's own, their imports done" in trained.stdout + trained.stderr

    # Ctrl-C reaches a run in the launcher's process: the command passes SIGINT on, the run stops as in a process of
    # its own (exit 130, its MLflow run KILLED). Its workers are the standby ones the first run left
    command = [sys.executable, "-m", "flows.cli", "train", *SMALL_DEMO, "trainer.experiment_name=interrupted"]
    interrupted = subprocess.Popen(
        [*command, "trainer.total_training_steps=50"],
        env=stack_env,
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    before_step = []
    for line in interrupted.stdout:
        before_step.append(line)
        if "step 1/" in line:
            interrupted.send_signal(signal.SIGINT)
            break
    output = "".join(before_step) + interrupted.communicate(timeout=120)[0]
    assert "rank(s): actor_rollout_ref; started as standby workers)" in output, output[-3000:]
    assert interrupted.returncode == 130, output[-3000:]
    assert "stopped by SIGINT; the run is marked KILLED" in output
    assert "left 1 standby worker(s) in " in output  # for the user's next run, changed or not

    # the stack started again: its launcher offers the standby workers the last run left (what they were made from is
    # kept in the stack's folder), and the first run after `up` adopts them
    assert ppoflow(stack_env, "down", timeout=120).returncode == 0
    # Ray's head ended on SIGTERM at once, though the standby workers live (Ray drains a node first, up to 30 s)
    assert "Draining for up to" not in (tmp_path / "home" / "data" / "logs" / "ray.log").read_text()
    assert ppoflow(stack_env, *started.args[3:]).returncode == 0  # `up` on the same ports
    launcher_log = tmp_path / "home" / "data" / "logs" / "launcher.log"
    deadline = time.monotonic() + 60
    while "standby workers offered" not in launcher_log.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "launcher: standby workers offered as the stack's last run left them" in launcher_log.read_text()
    after_up = ppoflow(stack_env, "train", *overrides, "trainer.experiment_name=after-up", timeout=600, cwd=work)
    assert after_up.returncode == 0, after_up.stdout[-3000:] + after_up.stderr[-3000:]
    assert "started as standby workers)" in after_up.stdout + after_up.stderr
    # which, having served it, stay the standby workers: their processes serve the next run
    assert "left 1 standby worker(s) in " in after_up.stdout + after_up.stderr
    assert "the run's own, their imports done" in after_up.stdout + after_up.stderr

    stopped = ppoflow(stack_env, "down", timeout=120)
    assert stopped.returncode == 0 and "stopped prefect, mlflow, ray, launcher" in stopped.stdout
    assert not any(process_group_alive(s["pid"]) for s in services.values())
    assert not any(port_open(port) for port in ports.values())
    assert ppoflow(stack_env, "status", timeout=60).returncode == 1


def views_of_the_run(ports: dict[str, int], flow_run_id: str, result: dict) -> None:
    """The run in the two UIs the stack serves, as a fresh browser opens them (screenshots in test-artifacts/): the
    Prefect flow run with its per-step line and its task runs named by step; ppoflow's link to the MLflow run opens its
    model-training view with the metrics and params (a fresh browser would open MLflow 3's GenAI view)."""
    browser = chromium()
    try:
        browser.get(f"http://127.0.0.1:{ports['prefect']}/runs/flow-run/{flow_run_id}")
        page_text_once_it_shows(browser, "step 1/1 | score", "set-up: Ray")
        screenshot(browser, "prefect-flow-run.png")
        browser.find_elements(By.XPATH, "//*[normalize-space(.)='Task Runs']")[-1].click()
        page_text_once_it_shows(browser, "step-1/generate", "step-1/update_actor", "load-inputs")
        screenshot(browser, "prefect-task-runs.png")
        client = MlflowClient(result["tracking_uri"])
        run = client.get_run(result["run_id"])
        browser.get(mlflow_run_url(result["tracking_uri"], run.info.experiment_id, run.info.run_id))
        text = page_text_once_it_shows(browser, "Metrics (", "Parameters (", "actor/pg_loss")
        assert "algorithm.adv_estimator" in text
        screenshot(browser, "mlflow-run.png")
    finally:
        browser.quit()


def test_the_prefect_server_records_in_batches_and_deletes_task_run_events_after_an_hour(tmp_path):
    """The settings the stack's Prefect server (and a temporary one) starts with are ones Prefect accepts."""
    from datetime import timedelta

    from prefect.settings import Settings

    from infra.stack import service_command

    _, env, _ = service_command("prefect", 4200, tmp_path)
    settings = Settings(
        server={
            "services": {
                "db_vacuum": {
                    "event_retention_overrides": json.loads(
                        env["PREFECT_SERVER_SERVICES_DB_VACUUM_EVENT_RETENTION_OVERRIDES"]
                    ),
                    "loop_seconds": env["PREFECT_SERVER_SERVICES_DB_VACUUM_LOOP_SECONDS"],
                }
            }
        }
    )
    vacuum = settings.server.services.db_vacuum
    assert vacuum.event_retention_overrides["prefect.task-run.Completed"] == timedelta(hours=1)
    recorder = Settings(
        server={
            "services": {
                "task_run_recorder": {
                    "batch_size": env["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"],
                    "flush_interval": env["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL"],
                }
            }
        }
    ).server.services.task_run_recorder
    assert recorder.batch_size == 100 and recorder.flush_interval == 1
    assert "events" in vacuum.enabled_vacuum_types and vacuum.loop_seconds == 600
