"""The multi-turn settings' up-front check (``actor_rollout_ref.rollout.multi_turn``, :class:`rl_core.config.
MultiTurnConfig`), run by :func:`rl_core.config.check_config` before anything starts."""

from __future__ import annotations

from typing import Any

from rl_core.agent.interactions import InteractionConfigError, configured_interactions
from rl_core.agent.loops import AgentLoopConfigError, configured_loops
from rl_core.agent.parsers import tag_argument
from rl_core.agent.tools.registry import ToolConfigError, configured_tools
from rl_core.agent.user_agent import ENDPOINT_AGENT, AgentConfigError, load_agent
from rl_core.config_checks import ConfigValueError
from rl_core.data.rows import AGENT_LOOPS


def agent_loop_problem(name: str, rollout: Any, loops: dict[str, type] | None = None) -> str | None:
    """Why the agent loop ``name`` cannot run with these rollout settings (what to set), or None; ``loops``: the
    configured loops of one's own when already loaded (else read from ``agent_loop_config_path``)."""
    if name not in AGENT_LOOPS:
        if loops is None:
            try:
                loops = configured_loops(rollout.agent.agent_loop_config_path)
            except AgentLoopConfigError as error:
                return f"actor_rollout_ref.rollout.agent.agent_loop_config_path: {error}"
        if name not in loops:
            known = ", ".join([*AGENT_LOOPS, *sorted(loops)])
            return f"no agent loop of that name ({known}; loops of one's own: agent_loop_config_path)"
        return None
    if name == "tool_agent" and not rollout.multi_turn.enable:
        return (
            "tool_agent needs actor_rollout_ref.rollout.multi_turn.enable=true (and its tool_config_path or "
            "interaction_config_path)"
        )
    endpoint = rollout.agent.endpoint
    if name == ENDPOINT_AGENT and endpoint.function is None and endpoint.command is None:
        return (
            "endpoint_agent needs an agent: set actor_rollout_ref.rollout.agent.endpoint.function (module:callable) "
            "or .command"
        )
    return None


def check_multi_turn(rollout: Any) -> None:
    """Refuse a multi-turn setting that cannot run: an unknown default agent loop, or one its settings cannot run
    (:func:`agent_loop_problem`), an endpoint agent that does not load; vLLM with tensor parallelism, a turn limit
    below 1, a tool or interaction YAML that does not load, ``format=tag`` without exactly one tool of one required
    argument."""
    settings = rollout.multi_turn
    key = "actor_rollout_ref.rollout.multi_turn"
    default = rollout.agent.default_agent_loop
    try:
        loops = configured_loops(rollout.agent.agent_loop_config_path)
    except AgentLoopConfigError as error:
        raise ConfigValueError(f"actor_rollout_ref.rollout.agent.agent_loop_config_path: {error}") from None
    problem = agent_loop_problem(default, rollout, loops) if default is not None else None
    if problem is not None:
        raise ConfigValueError(f"actor_rollout_ref.rollout.agent.default_agent_loop={default}: {problem}")
    endpoint = rollout.agent.endpoint
    if endpoint.function is not None or endpoint.command is not None:
        try:
            load_agent(endpoint)
        except AgentConfigError as error:
            raise ConfigValueError(f"actor_rollout_ref.{error}") from None
    if not settings.enable:
        return
    if rollout.name == "vllm" and int(rollout.tensor_model_parallel_size) > 1:
        raise ConfigValueError(
            f"{key}.enable=true with rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size}: the "
            "agent loop runs on each worker's own prompts, and vLLM's tensor-parallel ranks must send the same "
            "requests; set actor_rollout_ref.rollout.tensor_model_parallel_size=1"
        )
    for limit in ("max_assistant_turns", "max_user_turns"):
        value = settings[limit]
        if value is not None and value < 1:
            raise ConfigValueError(f"{key}.{limit}={value}: at least 1, or null for no limit")
    try:
        tools = configured_tools(settings)
    except ToolConfigError as error:
        raise ConfigValueError(f"{key}.tool_config_path: {error}") from None
    try:
        configured_interactions(settings)
    except InteractionConfigError as error:
        raise ConfigValueError(f"{key}.interaction_config_path: {error}") from None
    if settings.format == "tag":
        if len(tools) != 1:
            raise ConfigValueError(
                f"{key}.format=tag: a <call>TEXT</call> names no tool, so the run needs exactly one tool "
                f"({len(tools)} in {key}.tool_config_path); use format=hermes for several"
            )
        try:
            tag_argument(next(iter(tools.values())).tool_schema)
        except ValueError as error:
            raise ConfigValueError(f"{key}.format=tag: {error}") from None
