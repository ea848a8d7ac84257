"""Reliability, round two: what a second probe of faults found, each checked as it happens (a new store created by
processes at once, a watchdog of a command already gone, Ctrl-C in a Ray wait and during exit, ...)."""

import multiprocessing
import signal
import subprocess
import sys
import time

from flows.tracking import open_store
from infra import watchdog
from tests.conftest import ROOT


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
        processes = [context.Process(target=open_new_store, args=(barrier, f"sqlite:///{tmp_path}/new.db", results, i)) for i in range(4)]
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
from flows.cli import _run_flow_command
from infra.cluster import connect

connect(sys.argv[1], namespace="ppoflow-tests")

@ray.remote(num_cpus=0)
def sleep():
    time.sleep(60)

def flow_command(args):
    ref = sleep.remote()
    print("waiting", flush=True)
    ray.wait([ref])  # a stage waiting on its workers

sys.exit(_run_flow_command(argparse.Namespace(command="train", verbose=False, flow_command=flow_command)))
"""

EXITING_COMMAND = """
import argparse, atexit, sys, time
from flows.cli import _run_flow_command

def slow_exit():
    print("exiting", flush=True)
    time.sleep(60)  # Ray and Prefect's server being stopped

def flow_command(args):
    atexit.register(slow_exit)
    return 0

sys.exit(_run_flow_command(argparse.Namespace(command="train", verbose=False, flow_command=flow_command)))
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
    command = subprocess.Popen([sys.executable, "-c", RAY_WAITING_COMMAND, ray_address], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    output = interrupt_when(command, "waiting\n")
    assert command.wait(30) == 130, output
    assert "ppoflow train: stopped by SIGINT; the run is marked KILLED" in output and "Traceback" not in output


def test_ctrl_c_while_exiting_is_a_clean_stop():
    """It used to end with exit code 0 and "Exception ignored in atexit callback"."""
    command = subprocess.Popen([sys.executable, "-c", EXITING_COMMAND], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = interrupt_when(command, "exiting\n")
    assert command.wait(10) == 130, output
    assert output.strip() == "ppoflow train: stopped by SIGINT while exiting"
