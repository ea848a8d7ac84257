"""Reliability, round two: what a second probe of faults found, each checked as it happens (a new store created by
processes at once, a watchdog of a command already gone, Ctrl-C in a Ray wait and during exit, ...)."""

import multiprocessing
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
