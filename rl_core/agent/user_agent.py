"""The user's agent of the ``endpoint_agent`` loop (``actor_rollout_ref.rollout.agent.endpoint``), loaded and checked
without the rollout's imports (the up-front checks use it)."""

from __future__ import annotations

import importlib
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
