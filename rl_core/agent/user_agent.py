"""The user's agent of the ``endpoint_agent`` loop (``actor_rollout_ref.rollout.agent.endpoint``): loaded and checked
without the rollout's imports (the up-front checks use it), and run for a trajectory."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import Any

ENDPOINT_AGENT = "endpoint_agent"


class AgentConfigError(ValueError):
    """``rollout.agent.endpoint`` names no agent that can run."""


def load_agent(settings: Any) -> Callable[..., Any] | list[str]:
    """The configured agent: the callable ``function`` names (``module:attr``) or the ``command`` argv."""
    function, command = settings.function, settings.command
    if (function is None) == (command is None):
        raise AgentConfigError("set exactly one of rollout.agent.endpoint.function (module:callable) and .command")
    if command is not None:
        if isinstance(command, str) or not command or not all(isinstance(part, str) for part in command):
            raise AgentConfigError(f"rollout.agent.endpoint.command must be a list of strings (argv), not {command!r}")
        return list(command)
    module, _, name = str(function).partition(":")
    if not module or not name:
        raise AgentConfigError(f"rollout.agent.endpoint.function={function!r}: write it as module.path:callable")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise AgentConfigError(f"rollout.agent.endpoint.function={function!r} cannot be loaded: {error}") from None
    if not callable(found):
        raise AgentConfigError(f"rollout.agent.endpoint.function={function!r} is not callable")
    return found


def start_agent(
    agent: Callable[..., Any] | list[str],
    row: dict[str, Any],
    base_url: str,
    api_key: str,
    finished: Callable[[Any, str | None], None],
) -> subprocess.Popen | None:
    """Run ``agent`` (:func:`load_agent`'s) for one trajectory in a daemon thread: a callable as ``agent(base_url=...,
    api_key=..., row=...)``, a command with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``PPOFLOW_ROW`` (the row as
    JSON) in its environment. When it ends, ``finished(output, error)``: the callable's return value or the command's
    last stdout line (JSON if it parses); the exception or the non-zero exit, else None. Returns the command's process
    (None for a callable)."""
    process = None
    if callable(agent):

        def run() -> None:
            output, error = None, None
            try:
                output = agent(base_url=base_url, api_key=api_key, row=row)
            except Exception as raised:
                error = f"{type(raised).__name__}: {raised}"
            finished(output, error)

    else:
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
        env["PPOFLOW_ROW"] = json.dumps(row, default=str)
        process = subprocess.Popen(
            agent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )

        def run() -> None:
            stdout, stderr = process.communicate()
            lines = [line for line in stdout.splitlines() if line.strip()]
            output: Any = lines[-1] if lines else None
            try:
                output = json.loads(output) if output is not None else None
            except json.JSONDecodeError:
                pass
            error = None if process.returncode == 0 else f"exited with {process.returncode}: {stderr.strip()[-500:]}"
            finished(output, error)

    threading.Thread(target=run, name="ppoflow-endpoint-agent", daemon=True).start()
    return process


def stop_agent(process: subprocess.Popen | None) -> None:
    """Kill a command agent's process group if it still runs."""
    if process is not None and process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
