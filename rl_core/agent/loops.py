"""Agent loops of one's own, verl's way: a class registered under a name runs each trajectory of the rows whose
``agent_name`` is that name, in the rollout worker, asking the policy for tokens itself.

    @register("my_agent")
    class MyAgent(AgentLoopBase):
        async def run(self, sampling_params, **row) -> AgentLoopOutput:
            prompt = self.tokenizer.apply_chat_template(row["raw_prompt"], add_generation_prompt=True)
            output = await self.server_manager.generate(request_id="x", prompt_ids=prompt, sampling_params={})
            return AgentLoopOutput(prompt, output.token_ids, [1] * len(output.token_ids), output.log_probs)

Loops are listed in verl's agent-loop YAML, ``actor_rollout_ref.rollout.agent.agent_loop_config_path``:
``[{name: my_agent, _target_: package.module.MyAgent}]`` (or found by ``@register`` where the driver and the workers
import the module).
``run`` gets the rollout's sampling settings as a dict and the row's columns (``raw_prompt``, ``extra_info``,
``reward_model``, ``data_source``, ``ability``) and returns the trajectory as tokens: its prompt (at most
``data.max_prompt_length`` tokens), its response (cut at ``data.max_response_length``), which response tokens the
policy sampled (``response_mask`` 1: trained) and their log-probs. ``server_manager.generate`` is token in, token out
(verl's ``AsyncLLMServerManager.generate``): the sampled ids up to and including a stop token, their log-probs (with
``rollout.calculate_log_probs``), at most ``sampling_params["max_tokens"]`` or ``data.max_response_length`` of them.
The loops' requests are batched with the endpoint agents' (rl_core/agent/endpoint.py: in rounds, the batch not
depending on their timing, or continuously with ``rollout.agent.batching=continuous``); a loop that raises or passes
``rollout.agent.endpoint.timeout_s`` of its own time ends its trajectory as an endpoint agent's does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rl_core.agent.yaml_classes import import_class

REGISTERED: dict[str, type[AgentLoopBase]] = {}


class AgentLoopConfigError(ValueError):
    """``rollout.agent.agent_loop_config_path`` names loops that cannot run."""


@dataclass
class TokenOutput:
    """What ``server_manager.generate`` returns: the sampled ids, their log-probs (or None), ``stop`` or ``length``;
    with partial rollout each token's weights version (ppoflow's, not verl's)."""

    token_ids: list[int]
    log_probs: list[float] | None
    finish_reason: str
    versions: list[int] | None = None


@dataclass
class AgentLoopOutput:
    """A trajectory as a loop assembled it (verl's fields): ``response_mask`` 1 on the tokens the policy sampled."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    num_turns: int = 2
    extra_fields: dict[str, Any] = field(default_factory=dict)

    def problem(self) -> str | None:
        """Why this output cannot be a trajectory, or None."""
        if not self.prompt_ids:
            return "its prompt_ids are empty"
        if len(self.response_mask) != len(self.response_ids):
            return f"{len(self.response_ids)} response_ids but {len(self.response_mask)} response_mask entries"
        if self.response_logprobs is not None and len(self.response_logprobs) != len(self.response_ids):
            return f"{len(self.response_ids)} response_ids but {len(self.response_logprobs)} response_logprobs"
        if any(value not in (0, 1) for value in self.response_mask):
            return "response_mask holds values other than 0 and 1"
        return None


@dataclass
class TokenRequest:
    """A loop's ``generate``: token ids in, at most ``max_tokens`` sampled (None: the response's length)."""

    prompt_ids: list[int]
    max_tokens: int | None


class TokenServer:
    """A loop's ``server_manager``: ``generate`` hands a :class:`TokenRequest` to ``enqueue(request, on_reply)`` (the
    rollout's rounds, rl_core/agent/endpoint.py; it raises when the request is refused) and awaits the reply (a
    TokenOutput, or an exception: raised as a RuntimeError)."""

    def __init__(self, enqueue: Callable[[TokenRequest, Callable[[Any], None]], None]):
        self.enqueue = enqueue

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any] | None = None, **_: Any
    ) -> TokenOutput:
        """The policy's continuation of ``prompt_ids`` (the rollout's sampling; ``sampling_params["max_tokens"]``
        bounds its length)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def on_reply(reply: Any) -> None:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(reply))

        try:
            self.enqueue(TokenRequest(list(prompt_ids), (sampling_params or {}).get("max_tokens")), on_reply)
        except Exception as error:
            raise RuntimeError(str(error)) from None
        reply = await future
        if isinstance(reply, Exception):
            raise RuntimeError(str(reply))
        return reply


def fill_trajectory(
    output: AgentLoopOutput, trajectory: Any, prompt_length: int, response_length: int, tokenizer: Any
) -> str | None:
    """``trajectory`` (rl_core.agent.runner.Trajectory) made of a loop's output, the response cut at
    ``response_length``; why it cannot be (a prompt over ``prompt_length`` tokens), or None."""
    if len(output.prompt_ids) > prompt_length:
        return f"its prompt has {len(output.prompt_ids)} tokens, at most {prompt_length} (data.max_prompt_length)"
    kept = min(len(output.response_ids), response_length)
    log_probs = output.response_logprobs or [0.0] * kept
    trajectory.prompt = list(output.prompt_ids)
    trajectory.ids, trajectory.mask = list(output.response_ids[:kept]), list(output.response_mask[:kept])
    trajectory.log_probs = [float(value) if used else 0.0 for value, used in zip(log_probs, trajectory.mask)]
    trajectory.assistant_turns = max(int(output.num_turns) - 1, 1)
    answer = tokenizer.decode(_last_turn(trajectory.ids, trajectory.mask), skip_special_tokens=True)
    trajectory.messages = [{"role": "assistant", "content": answer}]
    if len(output.response_ids) >= response_length:
        trajectory.finish = "length"
    return None


def _last_turn(ids: list[int], mask: list[int]) -> list[int]:
    """The ids of the last run of policy tokens."""
    end = max((index + 1 for index, value in enumerate(mask) if value), default=0)
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return ids[start:end]


class AgentLoopBase:
    """One trajectory's loop (a new instance per trajectory): ``tokenizer``, ``server_manager`` (its ``generate``)
    and ``config`` (the rollout's settings)."""

    def __init__(self, tokenizer: Any, server_manager: Any, config: Any, **kwargs: Any):
        self.tokenizer, self.server_manager, self.config = tokenizer, server_manager, config

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        raise NotImplementedError


def register(name: str) -> Callable[[type[AgentLoopBase]], type[AgentLoopBase]]:
    """Make a loop class the one rows name ``name`` in their ``agent_name`` column."""

    def decorator(cls: type[AgentLoopBase]) -> type[AgentLoopBase]:
        REGISTERED[name] = cls
        return cls

    return decorator


def configured_loops(config_path: str | None) -> dict[str, type[AgentLoopBase]]:
    """The registered loops and those of verl's agent-loop YAML at ``config_path`` (``[{name, _target_}]``)."""
    loops = dict(REGISTERED)
    if config_path is None:
        return loops
    try:
        entries = yaml.safe_load(Path(config_path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise AgentLoopConfigError(f"{config_path}: {error}") from None
    if not isinstance(entries, list):
        raise AgentLoopConfigError(f"{config_path}: a list of {{name, _target_}} entries, not {type(entries).__name__}")
    for number, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or "_target_" not in entry:
            raise AgentLoopConfigError(f"{config_path}: entry {number} must have a name and a _target_ (module.Class)")
        where = f"{config_path}: entry {number}"
        loops[entry["name"]] = import_class(entry["_target_"], where, AgentLoopBase, AgentLoopConfigError)
    return loops
