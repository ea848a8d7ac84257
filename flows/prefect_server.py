"""The Prefect API a command uses when no server is configured, and the settings every command gives Prefect.

Without PREFECT_API_URL (and no ``ppoflow up`` stack) Prefect starts a temporary API server at a flow's first API
call. :func:`start_temporary_server` starts that server early instead, in a thread, so that it boots while the run's
modules import, and at the lowest CPU priority (``infra.stack.LOWEST_PRIORITY``): it records task runs from their
events asynchronously, and at normal priority on a small CPU machine it preempts the workers mid-stage. Prefect's
clients then find the running server (it is a per-process singleton).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


def configure_prefect() -> None:
    """Flow-run logs (the per-step lines) stay at INFO; Prefect's per-task-run state lines only when they warn. A
    temporary Prefect server gets the stack's retention settings too. Variables already set win."""
    from infra.stack import PREFECT_RETENTION

    os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    for key, value in PREFECT_RETENTION.items():
        os.environ.setdefault(key, value)


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

    thread = threading.Thread(target=start, name="ppoflow-prefect-server", daemon=True)
    thread.start()
    return thread.join
