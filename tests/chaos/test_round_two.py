"""Reliability, round two: what a second probe of faults found, each checked as it happens (a new store created by
processes at once, a watchdog of a command already gone, Ctrl-C in a Ray wait and during exit, ...)."""

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import ray
from mlflow.tracking import MlflowClient

from flows.prefect_view import one_line
from flows.tracking import open_store
from flows.train import train
from flows.workers import WORKERS_NAMESPACE_TAG
from infra import stack, watchdog
from rl_core.data.rows import write_rows
from rl_core.data.synthetic import addition_rows
from rl_core.reward.manager import RewardTimeoutError
from rl_core.step_checkpoint import StepCheckpoints
from tests.conftest import ROOT, free_port, small_run_overrides


def open_new_store(barrier, uri: str, results: dict, index: int) -> None:
    barrier.wait()  # every process at once
    try:
        open_store(uri).search_experiments()
        results[index] = "ok"
    except Exception as error:  # noqa: BLE001 - the failure is what is compared
        results[index] = f"{type(error).__name__}: {error}"


def test_processes_creating_one_new_sqlite_store_at_once_all_open_it(tmp_path):
    """MLflow migrates a new SQLite store when a client first touches it: four processes doing so together failed
    ("Online migration expected to match one row", "table ... already exists") before the lock came first."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results, barrier = manager.dict(), manager.Barrier(4)
        processes = [
            context.Process(target=open_new_store, args=(barrier, f"sqlite:///{tmp_path}/new.db", results, i))
            for i in range(4)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(120)
        assert dict(results) == {i: "ok" for i in range(4)}


def test_a_watchdog_for_a_command_already_gone_ends_at_once():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    started = time.monotonic()
    dog = subprocess.Popen([sys.executable, "-m", "infra.watchdog", str(gone.pid)], cwd=ROOT)
    assert dog.wait(10) == 0 and time.monotonic() - started < 2  # it polled forever before
    assert watchdog.watch(gone.pid) == []


RAY_WAITING_COMMAND = """
import argparse, sys, time
import ray
from flows.cli.flow_commands import run_flow_command
from infra.cluster import connect

connect(sys.argv[1], namespace="ppoflow-tests")

@ray.remote(num_cpus=0)
def sleep():
    time.sleep(60)

def flow_command(args):
    ref = sleep.remote()
    print("waiting", flush=True)
    ray.wait([ref])  # a stage waiting on its workers

sys.exit(run_flow_command(argparse.Namespace(command="train", verbose=False, flow_command=flow_command)))
"""

EXITING_COMMAND = """
import argparse, atexit, sys, time
from flows.cli.flow_commands import run_flow_command

def slow_exit():
    print("exiting", flush=True)
    time.sleep(60)  # Ray and Prefect's server being stopped

def flow_command(args):
    atexit.register(slow_exit)
    return 0

sys.exit(run_flow_command(argparse.Namespace(command="train", verbose=False, flow_command=flow_command)))
"""


def interrupt_when(command: subprocess.Popen, line: str) -> str:
    """Send SIGINT once ``line`` is printed; the output after it."""
    while (printed := command.stdout.readline()) != line:
        assert printed, f"the command ended before printing {line!r}"
    command.send_signal(signal.SIGINT)
    return command.stdout.read()


def test_ctrl_c_inside_a_ray_wait_is_a_clean_stop(ray_address):
    """Ray turns the handler's Interrupted into a plain KeyboardInterrupt: it used to end with exit code 1 and a
    traceback."""
    command = subprocess.Popen(
        [sys.executable, "-c", RAY_WAITING_COMMAND, ray_address],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = interrupt_when(command, "waiting\n")
    assert command.wait(30) == 130, output
    assert "ppoflow train: stopped by SIGINT; the run is marked KILLED" in output and "Traceback" not in output


def test_ctrl_c_while_exiting_is_a_clean_stop():
    """It used to end with exit code 0 and "Exception ignored in atexit callback"."""
    command = subprocess.Popen(
        [sys.executable, "-c", EXITING_COMMAND], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = interrupt_when(command, "exiting\n")
    assert command.wait(10) == 130, output
    assert output.strip() == "ppoflow train: stopped by SIGINT while exiting"


def test_a_folder_in_use_overlong_prompts_and_a_damaged_resume_path_are_refused_before_anything_starts(
    tmp_path, tiny_model_path
):
    """They were found only after the start-up (~37-44 s: its own Ray cluster and Prefect server booted, the first run
    slowed meanwhile, exit code 1)."""
    rows = addition_rows(12, seed=0, max_operand=9, split="train")
    long_prompt = dict(rows[0], prompt=[{"role": "user", "content": "1+1=" * 40}])
    train = write_rows(rows, tmp_path / "train.parquet")
    val = write_rows([long_prompt] + rows[:3], tmp_path / "val.jsonl")
    held = StepCheckpoints(tmp_path / "in-use").lock({"run": "the-first-run"})  # the first run holds its folder
    damaged = tmp_path / "old" / "global_step_3"
    damaged.mkdir(parents=True)
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "train",
            f"actor_rollout_ref.model.path={tiny_model_path}",
            f"data.train_files={train}",
            f"data.val_files={val}",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "data.max_prompt_length=64",
            f"trainer.default_local_dir={tmp_path / 'in-use'}",
            "trainer.resume_mode=resume_path",
            f"trainer.resume_from_path={damaged}",
            f"trainer.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PPOFLOW_HOME": str(tmp_path)},
    )
    seconds = time.monotonic() - started
    held.release()
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        lines[0].startswith(f"ppoflow train: data.val_files: {val}: row 0: the prompt has ")
        and "> data.max_prompt_length=64" in lines[0]
    )
    assert lines[1].startswith(
        f"ppoflow train: trainer.default_local_dir: folder {tmp_path / 'in-use'} is in use by run the-first-run (pid "
        f"{os.getpid()}, started "
    )
    assert lines[2].startswith(f"ppoflow train: trainer.resume_from_path: checkpoint {damaged} is incomplete")
    assert seconds < 20 and not (tmp_path / "mlflow.db").exists()
    print(f"refused in {seconds:.1f} s (interpreter start and imports included)")


def test_ppoflow_up_refuses_a_port_ray_keeps_before_starting_anything(tmp_path, monkeypatch):
    """`ray start` on a port in its worker range failed in seconds, but `up` then waited 180 s for it."""
    monkeypatch.setenv("PPOFLOW_HOME", str(tmp_path))
    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"port 12345 for ray is in the range Ray keeps for its client and workers \(10001-19999\)"
    ):
        stack.up(ports={"prefect": free_port(), "mlflow": free_port(), "ray": 12345})
    assert (
        time.monotonic() - started < 2
        and not (tmp_path / "stack.json").exists()
        and not (tmp_path / "data" / "logs").exists()
    )


def test_a_service_that_dies_while_starting_is_seen_at_once_with_its_own_error(tmp_path, monkeypatch):
    """It was left a zombie that still answered os.killpg(pid, 0): `up` waited 180 s, then ~35 s per service to stop
    it, and never showed the log's error."""
    monkeypatch.setenv("PPOFLOW_HOME", str(tmp_path))
    dying = [
        sys.executable,
        "-c",
        "import sys; print('starting'); print('ValueError: the port is not usable'); sys.exit(3)",
    ]
    monkeypatch.setattr(
        stack, "service_command", lambda name, port, data, stores: (dying, {}, f"http://127.0.0.1:{port}")
    )
    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"prefect exited while starting \(exit code 3\): ValueError: the port is not usable"
    ):
        stack.up(ports={"prefect": free_port(), "mlflow": free_port(), "ray": free_port()})
    assert time.monotonic() - started < 10 and not (tmp_path / "stack.json").exists()


def test_a_stale_stack_file_never_makes_down_kill_a_stranger(tmp_path, monkeypatch):
    """After a reboot the recorded pids may belong to other programs: `down` used to SIGTERM, then SIGKILL, whatever
    process group had that id. A service is its group *and* its leader's start time."""
    monkeypatch.setenv("PPOFLOW_HOME", str(tmp_path))
    stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)  # a process group of someone else's
    ours = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        services = {
            "prefect": stack.Service("prefect", stranger.pid, free_port(), "http://127.0.0.1:1/api", "log", started=1),
            "mlflow": stack.Service(
                "mlflow", ours.pid, free_port(), "http://127.0.0.1:1", "log", started=watchdog.stat(ours.pid)[3]
            ),
        }
        stack.Stack(str(tmp_path), services).save()
        assert not services["prefect"].alive() and services["mlflow"].alive()
        assert stack.down() == ["prefect", "mlflow"]
        assert stranger.poll() is None  # untouched
        assert ours.wait(10) == -signal.SIGTERM  # what the stack started is stopped
    finally:
        stranger.kill()
        ours.kill()


def test_a_reward_function_that_hangs_fails_the_run_within_its_timeout(tmp_path, demo_cache, ray_address, prefect_api):
    """It hung the run forever (rule rewards run in the controller; trainer.worker_timeout_s covers worker calls only),
    the MLflow run RUNNING. (On the session's persistent cluster a failed run would keep its workers for a retry:
    keep_workers=false stands for `ppoflow train`'s embedded cluster, which ends with the command.)"""
    reward = tmp_path / "hangs.py"
    reward.write_text(
        "import time\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    "
        "time.sleep(600)\n"
    )
    started = time.monotonic()
    with pytest.raises(RewardTimeoutError) as raised:
        train(
            overrides=small_run_overrides(
                tmp_path,
                demo_cache,
                f"custom_reward_function.path={reward}",
                "reward.timeout_s=2",
                "trainer.val_before_train=false",
                "trainer.keep_workers=false",
            )
        )
    seconds = time.monotonic() - started
    assert one_line(raised.value).startswith(
        "RewardTimeoutError: reward function 'compute_score' did not return within reward.timeout_s=2s (on sample 0 of "
        "16, data_source='ppoflow/addition')"
    )
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("ppoflow").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["ppoflow.error"].startswith("RewardTimeoutError")
    assert not [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == run.data.tags[WORKERS_NAMESPACE_TAG]
    ]
    print(f"failed in {seconds:.1f} s (start-up included)")
