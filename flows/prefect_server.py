"""The Prefect API a command uses when no server is configured, and the settings every command gives Prefect.

Without PREFECT_API_URL (and no ``ppoflow up`` stack) Prefect starts a temporary API server at a flow's first API
call. :func:`start_temporary_server` starts that server early instead, in a thread, so that it boots while the run's
modules import, and at the lowest CPU priority (``infra.stack.LOWEST_PRIORITY``): it records task runs from their
events asynchronously, and at normal priority on a small CPU machine it preempts the workers mid-stage. Prefect's
clients then find the running server (it is a per-process singleton).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone


def configure_prefect() -> None:
    """Flow-run logs (the per-step lines) stay at INFO; Prefect's per-task-run state lines only when they warn. A
    temporary Prefect server gets the stack's server settings too (task runs recorded in batches, retention).
    Variables already set win."""
    from infra.stack import PREFECT_SERVER_SETTINGS

    os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    for key, value in PREFECT_SERVER_SETTINGS.items():
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


STARTED: dict[str, object] = {}  # the temporary server this process started ("server") and since when ("since")
FINAL_STATES = ["COMPLETED", "FAILED", "CRASHED", "CANCELLED"]


def start_temporary_server() -> Callable[[], None]:
    """Start Prefect's temporary server in a thread; returns the wait for it, to call before the flow runs (nothing to
    wait for when PREFECT_API_URL is set)."""
    if os.environ.get("PREFECT_API_URL"):
        return lambda: None

    def start() -> None:
        from prefect.server.api.server import SubprocessASGIServer

        from infra.stack import lower_priority

        server = SubprocessASGIServer()
        server.start()
        lower_priority(server.server_process.pid)
        STARTED.update(server=server, since=datetime.now(timezone.utc))

    thread = threading.Thread(target=start, name="ppoflow-prefect-server", daemon=True)
    thread.start()
    return thread.join


def stop_temporary_server(task_runs: int, timeout_s: float = 30.0) -> None:
    """Stop the temporary server this process started once it has recorded the ``task_runs`` task runs this process
    made (the client's queued events and logs are sent first; at most ``timeout_s``). Stopped earlier, its task-run
    recorder is cancelled mid-write: it prints tracebacks after a run that succeeded, and the last states are lost."""
    server = STARTED.pop("server", None)
    if server is None or server.server_process is None:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    from flows.stages import flush_reported_runs

    flush_reported_runs()
    EventsWorker.drain_all(timeout=5)
    APILogWorker.drain_all(timeout=5)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        recorded = count_task_runs(server.api_url, STARTED["since"], FINAL_STATES)
        if recorded < 0 or recorded >= task_runs:  # < 0: the server does not answer
            break
        time.sleep(0.25)
    server.stop()


def count_task_runs(api_url: str, since: datetime, states: list[str] | None = None) -> int:
    """The task runs (in ``states``, when given) of the flow runs that started after ``since``; -1 when the server
    does not answer."""
    import httpx

    task_runs = {"state": {"type": {"any_": states}}} if states else {}
    body = {"flow_runs": {"start_time": {"after_": since.isoformat()}}, "task_runs": task_runs}
    try:
        return int(httpx.post(f"{api_url}/task_runs/count", json=body, timeout=5).json())
    except (httpx.HTTPError, ValueError):
        return -1
