"""The Prefect API a command uses when no server is configured, and the settings every command gives Prefect.

Without PREFECT_API_URL (and no ``ppoflow up`` stack) Prefect would start a temporary API server at a flow's first
API call. :func:`start_temporary_server` starts that server early instead: it launches the server's process at once
(the command Prefect runs for its temporary server: uvicorn serving ``prefect.server.api.server:create_app``), so that
it boots while the run's modules import, and points Prefect's clients at it through PREFECT_API_URL (handing it over
as Prefect's own ``SubprocessASGIServer`` would import Prefect's whole server, its API routes, FastAPI and SQLAlchemy,
into the command: seconds of CPU on the start-up's path). It runs at the lowest CPU priority
(``infra.stack.LOWEST_PRIORITY``) from its start: the flow needs it only once its modules are imported, while Ray's
processes and the workers start beside it; and it records task runs from their events asynchronously, which at normal
priority on a small CPU machine preempts the workers mid-stage; once it answers, it runs under SCHED_IDLE
(:func:`infra.stack.lower_priority`). The command stops it (:func:`stop_temporary_server`;
at exit at the latest).
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from infra.stack import http_ok, lower_priority

if TYPE_CHECKING:
    import httpx


def configure_prefect() -> None:
    """Flow-run logs (the per-step lines) stay at INFO; Prefect's per-task-run state lines only when they warn. A
    temporary Prefect server gets the stack's server settings too (task runs recorded in batches, retention), and no
    usage telemetry leaves the command (infra/telemetry.py). Variables already set win."""
    from infra.stack import PREFECT_SERVER_SETTINGS
    from infra.telemetry import NO_TELEMETRY_ENV

    os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL", "WARNING")
    for key, value in {**NO_TELEMETRY_ENV, **PREFECT_SERVER_SETTINGS}.items():
        os.environ.setdefault(key, value)


class _WithoutTraceback(logging.Filter):
    """Prints a record's message without its traceback (the record went to Prefect's API, traceback included, before
    it reached the console: the API's handlers sit on Prefect's own loggers, the console's on the root)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def console_without_tracebacks() -> None:
    """A failed flow run prints one line on the console, like the command's own failure line (the traceback stays in
    the flow run's Logs tab in Prefect, and in the command's log file; the failed stage's task run holds the error)."""
    import prefect.main  # noqa: F401 (sets up Prefect's logging: the console handler on the root logger)
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler):
            handler.addFilter(_WithoutTraceback())


STARTED: dict[str, object] = {}  # the temporary server this process started: its "process", "api_url", "since"
FINAL_STATES = ["COMPLETED", "FAILED", "CRASHED", "CANCELLED"]


# what Prefect's SubprocessASGIServer gives its process: no UI, the ephemeral server's optimisations
TEMPORARY_SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
PORTS = range(8000, 9000)  # where Prefect looks for a free port for it


def free_port(ports: range = PORTS) -> int:
    for port in random.sample(ports, 20):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1} for Prefect's temporary server")


def server_command(port: int) -> list[str]:
    """The command line of Prefect's temporary server on ``port`` (``SubprocessASGIServer``'s, found without importing
    Prefect)."""
    prefect_dir = Path(importlib.util.find_spec("prefect").origin).parent
    app = "prefect.server.api.server:create_app"
    options = ["--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"]
    return [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect_dir.parent), "--factory", app, *options]


def start_temporary_server(timeout_s: float = 120.0) -> Callable[[], None]:
    """Launch Prefect's temporary server now and point PREFECT_API_URL at it; returns the wait for it (until it
    answers), to call before the flow runs (nothing to wait for when PREFECT_API_URL is already set). Its process gets
    this process's environment, Prefect's settings included."""
    if os.environ.get("PREFECT_API_URL"):
        return lambda: None
    port = free_port()
    process = subprocess.Popen(server_command(port), env={**os.environ, **TEMPORARY_SERVER_ENV})
    lower_priority(process.pid)  # it boots on what Ray's processes and the workers leave of the CPUs
    api_url = f"http://127.0.0.1:{port}/api"
    point_prefect_at({"PREFECT_API_URL": api_url, "PREFECT_UI_URL": ""})  # "": no links to a server without a UI
    STARTED.update(process=process, api_url=api_url, since=datetime.now(timezone.utc))
    atexit.register(_end, process)

    def wait_until_answering() -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"Prefect's temporary server exited with code {process.returncode} while starting")
            if http_ok(f"{api_url}/health", timeout_s=5):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prefect's temporary server did not answer within {timeout_s:.0f} s")
            time.sleep(0.1)

    failed: list[BaseException] = []

    def run() -> None:
        try:
            wait_until_answering()
            lower_priority(process.pid, idle=True)  # booted: from now on it runs on the CPU time the run leaves idle
        except BaseException as error:  # raised by the wait, in the command's thread
            process.kill()
            failed.append(error)

    thread = threading.Thread(target=run, name="ppoflow-prefect-server", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if failed:
            raise failed[0]

    return wait


def point_prefect_at(settings: dict[str, str | None]) -> None:
    """Set (or, for None, unset) environment variables, Prefect's settings among them; Prefect reads its settings
    when imported, so an imported Prefect reads them again."""
    for key, value in settings.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if "prefect.context" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


def _end(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def stop_temporary_server(timeout_s: float = 30.0) -> None:
    """Stop the temporary server this process started once it has recorded the task runs this process made (the
    client's queued events and logs are sent first; at most ``timeout_s``). Stopped earlier, its task-run recorder is
    cancelled mid-write: it prints tracebacks after a run that succeeded, and the last states are lost. Prefect is
    pointed at no server again."""
    process = STARTED.pop("process", None)
    if process is None:
        return
    try:
        if process.poll() is None:
            _record_then_end(process, timeout_s)
    finally:
        if os.environ.get("PREFECT_API_URL") == STARTED["api_url"]:  # not a server of its own for the next flow
            point_prefect_at({"PREFECT_API_URL": None, "PREFECT_UI_URL": None})


def _record_then_end(process: subprocess.Popen, timeout_s: float) -> None:
    """End the server once it has recorded this process's task runs, but those the process deleted (at most
    ``timeout_s``; past it, a warning says how many are lost)."""
    import httpx
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    from flows.prefect_view import PRUNED
    from flows.stages import TASK_RUNS, flush_reported_runs

    flush_reported_runs()
    EventsWorker.drain_all(timeout=5)
    APILogWorker.drain_all(timeout=5)
    deadline, recorded, expected = time.monotonic() + timeout_s, 0, TASK_RUNS["started"]
    with httpx.Client(timeout=5) as client:  # one for the polls: each new client builds an SSL context (~50 ms of CPU)
        while time.monotonic() < deadline:
            # read before the count: a deletion that finishes in between lowers the count, not yet the expected
            expected = TASK_RUNS["started"] - PRUNED["task_runs"]
            recorded = count_task_runs(client, STARTED["api_url"], STARTED["since"], FINAL_STATES)
            if recorded < 0 or recorded >= expected:  # < 0: the server does not answer
                break
            time.sleep(0.25)
    if recorded >= 0 and recorded < expected:
        logging.getLogger("ppoflow").warning(
            "Prefect's temporary server had recorded %d of this command's %d task runs after %.0f s; it stops "
            "without the rest",
            recorded,
            expected,
            timeout_s,
        )
    _end(process)


def count_task_runs(client: httpx.Client, api_url: str, since: datetime, states: list[str] | None = None) -> int:
    """The task runs (in ``states``, when given) of the flow runs that started after ``since``; -1 when the server
    does not answer."""
    import httpx

    task_runs = {"state": {"type": {"any_": states}}} if states else {}
    body = {"flow_runs": {"start_time": {"after_": since.isoformat()}}, "task_runs": task_runs}
    try:
        return int(client.post(f"{api_url}/task_runs/count", json=body).json())
    except (httpx.HTTPError, ValueError):
        return -1
