"""A controller that is killed leaves nothing running, and the run it left is marked KILLED by the next run in its
folder; SIGTERM and SIGINT stop a run cleanly (MLflow KILLED, workers freed, exit 143 / 130)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_API_URL

from flows.train import train
from flows.workers import WORKERS_NAMESPACE_TAG
from infra import watchdog
from tests.conftest import ROOT, small_run_overrides


def alive(pid: int) -> bool:
    """Running, and not a zombie (this container's init does not reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_the_watchdog_ends_what_a_killed_process_left_and_nothing_else(tmp_path):
    script = (
        "import subprocess, time\n"
        "orphan = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"  # not in the parent's process group
        "print(orphan.pid, flush=True)\ntime.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    orphan = int(parent.stdout.readline())
    bystander = subprocess.Popen(["sleep", "600"])
    dog = watchdog.start(parent.pid)
    try:
        time.sleep(3 * watchdog.POLL_S)  # it has seen the child
        parent.kill()
        parent.wait()
        wait_until(lambda: not alive(orphan), 5 + watchdog.GRACE_S, "the killed process's child outlived it")
        assert dog.wait(10) == 0
        assert bystander.poll() is None  # not a descendant: untouched
    finally:
        bystander.kill()
        parent.kill()


def test_sigkill_of_the_controller_leaves_no_process_and_the_next_run_marks_it_killed(
    tmp_path, demo_cache, ray_address, prefect_api
):
    """The embedded default's helpers: Prefect's temporary API server and a local Ray cluster, both started by the
    run."""
    overrides = small_run_overrides(
        tmp_path,
        demo_cache,
        "trainer.total_training_steps=50",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "RAY_ADDRESS", "MLFLOW_TRACKING"))}
    # no stack: everything is the run's own
    env.update(PPOFLOW_HOME=str(tmp_path / "home"), PREFECT_HOME=str(tmp_path / "prefect"))
    log = tmp_path / "controller.log"
    with open(log, "w") as output:
        controller = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "train", *overrides],
            env=env,
            cwd=ROOT,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    wait_until(
        lambda: "step 2/50" in log.read_text() or controller.poll() is not None, 300, "the run never reached step 2"
    )
    assert controller.poll() is None, log.read_text()[-3000:]
    started = watchdog.descendants(controller.pid, watchdog.processes())
    lines = [command_line(pid) for pid in started]
    assert any("uvicorn" in line and "prefect.server" in line for line in lines), lines  # Prefect's temporary server
    assert any("raylet" in line for line in lines), lines
    # a one-machine cluster of one driver: neither of Ray's monitors (infra/cluster.py::_without_monitors)
    assert not any(script in line for line in lines for script in ("/monitor.py", "/log_monitor.py")), lines
    controller.kill()
    controller.wait()
    wait_until(
        lambda: not any(alive(pid) for pid in started),
        30,
        "processes outlived the killed controller: " + str([command_line(pid) for pid in started if alive(pid)]),
    )

    lock = json.loads((tmp_path / "checkpoints" / ".lock").read_text())  # what the killed controller left
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert lock["pid"] == controller.pid and client.get_run(lock["mlflow_run_id"]).info.status == "RUNNING"
    train(
        overrides=small_run_overrides(
            tmp_path,
            demo_cache,
            "trainer.total_training_steps=1",
            "trainer.resume_mode=disable",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
        )
    )
    killed = client.get_run(lock["mlflow_run_id"])
    assert killed.info.status == "KILLED"
    assert killed.data.tags["ppoflow.error"].startswith(f"its controller (pid {controller.pid}, started ")


SLEEPING_COMMAND = """
import argparse, sys, time
from flows.cli.flow_commands import run_flow_command
def flow_command(args):
    try:
        print("running", flush=True)
        time.sleep(60)
    finally:
        print("cleaned up", flush=True)  # what run_training's handlers do: mark the run, free the workers
sys.exit(run_flow_command(argparse.Namespace(command="train", verbose=False, flow_command=flow_command)))
"""


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_first_signal_interrupts_the_command_and_sets_its_exit_code(signum, code):
    command = subprocess.Popen(
        [sys.executable, "-c", SLEEPING_COMMAND], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert command.stdout.readline() == "running\n"
    command.send_signal(signum)
    output = command.stdout.read()
    assert command.wait(10) == code
    assert output.startswith("cleaned up\n") and f"stopped by {signal.Signals(signum).name}" in output


def test_sigterm_stops_a_training_run_cleanly(tmp_path, demo_cache, ray_address, prefect_api):
    signum, code = signal.SIGTERM, 143
    overrides = small_run_overrides(
        tmp_path,
        demo_cache,
        "trainer.total_training_steps=50",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.ray.address={ray_address}",
    )
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PPOFLOW_HOME": str(tmp_path / "home")}
    controller = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "train", *overrides],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = []
    for line in controller.stdout:
        output.append(line)
        if "step 2/50" in line:
            break
    controller.send_signal(signum)
    output.extend(controller.stdout)
    assert controller.wait(60) == code, "".join(output)[-3000:]
    assert f"ppoflow train: stopped by {signal.Signals(signum).name}; the run is marked KILLED" in "".join(output)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("ppoflow").experiment_id])
    assert run.info.status == "KILLED"
    namespace = run.data.tags[WORKERS_NAMESPACE_TAG]
    assert [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace
    ] == []  # workers freed
    assert (tmp_path / "checkpoints" / ".lock").read_text() == ""  # let go of the folder


def test_a_long_run_keeps_only_its_recent_task_runs_in_prefect(
    tmp_path, demo_cache, ray_address, prefect_api, monkeypatch
):
    """Prefect's database stays bounded: the task runs of all but the last ``trainer.prefect_history_steps`` steps
    go."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows import prefect_view

    monkeypatch.setattr(prefect_view, "PRUNE_EVERY_STEPS", 2)
    result = train(
        overrides=small_run_overrides(
            tmp_path,
            demo_cache,
            "trainer.total_training_steps=8",
            "trainer.prefect_history_steps=2",
            "trainer.save_freq=-1",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
        )
    )
    flow_run_id = (
        MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).data.tags["ppoflow.prefect_flow_run_id"]
    )

    def generate_starts() -> list:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        return sorted(run.start_time for run in runs if run.name.endswith("/generate"))

    # at step 8 the task runs started before step 6 were deleted (steps of ~0.2 s: most of them were recorded by the
    # server after their batch went, and the pruner's last pass at the run's end took them)
    wait_until(lambda: len(generate_starts()) >= 3, 60, "the last steps' task runs are missing")
    assert len(generate_starts()) == 3, generate_starts()
