"""Multi-turn rollouts that call tools, as a rollout engine: ``ppo_step``, the flows and dispatch do not change.

:class:`MultiTurnRollout` wraps an engine with the token primitive (:class:`rl_core.rollout.base.TokenEngine`) and
runs every prompt row as a trajectory of rounds::

    round r:  the trajectories still running, in row order, are continued in chunks of generation_batch_size
              (seed: sampling_seed(..., part=r * ROUND_STRIDE + chunk)); each chunk's tool calls are read from its
              turns and started at once, so they run while the next chunk generates
              then every call's answer is awaited and appended as the template's tokens (mask 0)

Token in, token out: the policy's ids are appended as sampled (never decoded and re-encoded), tool answers as the
fixed-base delta of the chat template (:mod:`rl_core.agent.observations`). ``response_mask`` is 1 exactly on the
policy's tokens (each turn's stop token included), 0 on tool answers, template glue and padding; attention covers
every real token; ``response_length`` bounds the whole response (an answer that does not fit is dropped and the
trajectory ends on its last policy token). Round membership depends only on the previous round's outcome, never on
the tools' timing, so a step re-run draws the same trajectories (``generate`` stays retry-safe when every tool is
idempotent). Round 0 is exactly the single-turn rollout: with no tools configured the batch is bit-identical to it.

That is ``rollout.agent.batching=rounds``, a synchronous run's default. With ``continuous`` (the default when the
rollout runs ahead of the trainer, ``async_training.mode`` one_step_off or fully_async) each trajectory proceeds on its
own instead (:meth:`MultiTurnRollout._tool_loop`, batched with the endpoint agents' requests in
:mod:`rl_core.agent.endpoint`): its next turn joins the next batch as soon as its calls are answered, so a trajectory
waiting on a slow tool holds no other's turn; the same turns are taken (the tokens, masks and records are assembled
the same way), but which batch, and so which random stream, samples each turn depends on the tools' timing.

A row whose ``agent_name`` is ``single_turn_agent`` (verl's column; ``rollout.agent.default_agent_loop`` for rows
without one, ``tool_agent`` by default) ends after its first turn, whatever it says; ``tool_agent`` rows run the loop.
A row with an interaction (``extra_info.interaction_kwargs``, :mod:`rl_core.agent.interactions`): a turn without
calls is answered by the simulated user (its reply appended as a user message, mask 0, like a tool answer), until it
ends the dialogue. A trajectory ends with ``stop`` (a turn without calls, no interaction), ``interaction`` (the
interaction ended it), ``length`` (the response is full), ``max_turns`` (``max_assistant_turns`` / ``max_user_turns``
reached) or ``parse_error`` (``on_parse_error=stop``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_core.agent.checks import agent_loop_problem
from rl_core.agent.endpoint import ROUND_STRIDE, EndpointAgents
from rl_core.agent.executor import CallResult, ToolExecutor, ToolSession, refused
from rl_core.agent.interactions import configured_interactions
from rl_core.agent.loops import REGISTERED, TokenServer
from rl_core.agent.observations import ObservationEncoder
from rl_core.agent.parsers import ToolCall, parse_calls
from rl_core.agent.tools.base import BaseTool
from rl_core.batch import Batch
from rl_core.batch_fields import (
    AGENT_NAME,
    DATA_SOURCE,
    EXTRA_INFO,
    INPUT_IDS,
    MULTI_MODAL_INPUTS,
    MULTI_TURN,
    NUM_TURNS,
    RAW_PROMPT,
    REWARD_MODEL,
    TEMPERATURE,
)
from rl_core.data.dataset import left_padded
from rl_core.data.rows import interaction_kwargs_of, tools_kwargs_of
from rl_core.rollout.base import (
    TokenEngine,
    TokenSample,
    assemble_samples,
    data_parallel_rank,
    prompt_contexts,
    sampling_params,
    sampling_seed,
    stop_token_ids,
    with_images,
)

SINGLE_TURN = "single_turn_agent"
STUCK_MARGIN_S = 30  # past the calls' own timeouts: only a tools' loop that is itself stuck makes the rollout wait this
FINISH_REASONS = ("stop", "interaction", "length", "max_turns", "parse_error", "agent_error", "agent_timeout")


@dataclass
class Trajectory:
    """One prompt row's conversation as tokens: ``ids`` (the response so far), ``mask`` (1 on policy tokens),
    ``log_probs`` (the sampler's, 0 on other tokens), ``versions`` (partial rollout: the weights' version that sampled
    each policy token; other tokens carry the one before them)."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0  # rounds of tool answers or of the interaction's replies
    messages: list[dict[str, str]] = field(default_factory=list)
    context: list[dict[str, Any]] = field(default_factory=list)  # the prompt's messages (what an interaction reads)
    calls: list[dict[str, Any]] = field(default_factory=list)
    pending: list[tuple[ToolCall, concurrent.futures.Future]] = field(default_factory=list)
    reply: concurrent.futures.Future | None = None  # the interaction's answer to the last turn
    tool_wait_s: float = 0.0  # how long generation waited for this trajectory's answers (or its agent's request)
    batch_sizes: list[int] = field(default_factory=list)  # of the generate calls that sampled its turns
    finish: str | None = None
    single_turn: bool = False  # its row's agent loop is single_turn_agent
    session: ToolSession = field(default_factory=ToolSession)  # its tool instances (rl_core/agent/executor.py)
    tool_rewards: list[float] = field(default_factory=list)  # the calls' step rewards, in call order
    reward_scores: dict[str, float] = field(default_factory=dict)  # each tool's calc_reward at the end
    tool_problems: list[str] = field(default_factory=list)  # a calc_reward, release or interaction that failed
    turn_scores: list[float] = field(default_factory=list)  # the interaction's score of each reply
    vision: dict[str, Any] | None = None  # its prompt's image inputs (a vision-language run): every turn takes them
    turn_rewards: list[float] = field(default_factory=list)  # per policy turn: its calls' step rewards + reply score
    by_endpoint: bool = False  # endpoint_agent or a loop of one's own (rl_core/agent/endpoint.py, loops.py) runs it
    endpoint: dict[str, Any] = field(default_factory=dict)  # what its endpoint agent returned and how its calls went

    def append(
        self, ids: list[int], from_policy: bool, log_probs: list[float] | None = None, versions: list[int] | None = None
    ) -> None:
        self.ids += ids
        self.mask += [int(from_policy)] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [self.versions[-1] if self.versions else 0] * len(ids)

    def summary(self) -> dict[str, Any]:
        """What the reward function (``extra_info``) and the samples table get."""
        answers = [m["content"] for m in self.messages if m["role"] == "assistant"]
        return {
            "messages": self.messages,
            "tool_calls": self.calls,
            "finish_reason": self.finish,
            "final_answer": answers[-1] if answers else "",
            "tool_wait_s": self.tool_wait_s,
            "batch_sizes": self.batch_sizes,
            "tool_rewards": self.tool_rewards,
            "rollout_reward_scores": self.reward_scores,
            "turn_scores": self.turn_scores,
            "turn_rewards": self.turn_rewards,
            **({"tool_problems": self.tool_problems} if self.tool_problems else {}),
            **self.endpoint,
        }


class MultiTurnRollout:
    """``generate_sequences`` with tool calls (see the module doc) over ``engine``'s ``generate_tokens``."""

    def __init__(self, engine: TokenEngine, tokenizer: Any, rollout_config: Any, tools: dict[str, BaseTool]):
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = rollout_config
        self.settings = rollout_config.multi_turn
        self.response_length = int(rollout_config.response_length)
        self.chunk_size = int(rollout_config.generation_batch_size)
        self.pad_token_id = tokenizer.pad_token_id
        self.tools = tools
        self.interactions = configured_interactions(self.settings)
        self.schemas = [tool.tool_schema for tool in tools.values()]
        answered = bool(tools or self.interactions)  # something may answer a turn
        self.executor = (
            ToolExecutor(tools, self.settings.tool_timeout_s, self.settings.max_concurrent_tools) if answered else None
        )
        endpoint = rollout_config.agent.endpoint
        by_endpoint = endpoint.function is not None or endpoint.command is not None
        by_endpoint |= bool(rollout_config.agent.agent_loop_config_path or REGISTERED)  # loops of one's own
        self.observations = (
            ObservationEncoder(
                tokenizer,
                stop_token_ids(tokenizer, rollout_config),
                self.settings.max_tool_response_length,
                self.settings.max_tool_response_tokens,
                self.settings.tool_response_truncate_side,
            )
            if answered or by_endpoint
            else None
        )
        self.continuous = rollout_config.agent.batching == "continuous"
        self.endpoint_agents = (
            EndpointAgents(engine, tokenizer, rollout_config, self.observations, self.settings.format)
            if by_endpoint or self.continuous
            else None
        )

    @torch.no_grad()
    def generate_sequences(self, prompts: Batch) -> Batch:
        params = sampling_params(self.config, prompts.meta_info)
        rank = data_parallel_rank()
        width = prompts.tensors[INPUT_IDS].shape[1]
        extras = prompts.non_tensors.get(EXTRA_INFO, [None] * len(prompts))
        raw_prompts = prompts.non_tensors.get(RAW_PROMPT, [[]] * len(prompts))
        images = prompts.non_tensors.get(MULTI_MODAL_INPUTS, [None] * len(prompts))
        agents = self._agent_names(prompts)
        trajectories = [
            Trajectory(
                ids,
                session=self._session(extra),
                context=_as_messages(raw),
                single_turn=agent == SINGLE_TURN,
                by_endpoint=agent not in (SINGLE_TURN, "tool_agent"),
                vision=vision,
            )
            for ids, extra, raw, agent, vision in zip(prompt_contexts(prompts), extras, raw_prompts, agents, images)
        ]
        with self.engine.rollout(prompts.meta_info):
            if self.continuous:  # every trajectory on its own; the built-in loop's as coroutines (endpoint.py)
                rows = [task_row(prompts, row) for row in range(len(prompts))]
                meta_info = prompts.meta_info
                self.endpoint_agents.run(trajectories, rows, agents, params, meta_info, 0, width, self._tool_loop)
            else:
                rounds = self._run_rounds(trajectories, params, prompts.meta_info, rank)
                by_endpoint = [row for row, trajectory in enumerate(trajectories) if trajectory.by_endpoint]
                if by_endpoint:
                    self.endpoint_agents.run(
                        [trajectories[row] for row in by_endpoint],
                        [task_row(prompts, row) for row in by_endpoint],
                        [agents[row] for row in by_endpoint],
                        params,
                        prompts.meta_info,
                        first_round=rounds,
                        width=width,
                    )
        self._finish_sessions(trajectories)
        partial = getattr(self.engine, "newer_weights", None) is not None  # versions per token (partial rollout)
        samples = [
            TokenSample(
                t.ids,
                t.log_probs if self.config.calculate_log_probs else None,
                t.finish,
                t.versions if partial else None,
            )
            for t in trajectories
        ]
        if any(t.by_endpoint for t in trajectories):  # an agent's first request is its trajectory's prompt
            tensors = left_padded([t.prompt for t in trajectories], width, self.pad_token_id)
            prompts = Batch({**prompts.tensors, **tensors}, dict(prompts.non_tensors), dict(prompts.meta_info))
        out = assemble_samples(
            prompts, samples, self.response_length, self.pad_token_id, [t.mask for t in trajectories]
        )
        num_turns = [1 + t.assistant_turns + t.user_turns for t in trajectories]
        out.union(Batch(non_tensors={NUM_TURNS: num_turns, MULTI_TURN: [t.summary() for t in trajectories]}))
        out.meta_info[TEMPERATURE] = params.temperature
        return out

    def _run_rounds(self, trajectories: list[Trajectory], params: Any, meta_info: dict[str, Any], rank: int) -> int:
        """The built-in loop's trajectories in rounds (the module doc); returns how many rounds ran."""
        round_index = 0
        while active := [t for t in trajectories if t.finish is None and not t.by_endpoint]:
            for chunk, start in enumerate(range(0, len(active), self.chunk_size)):
                part = active[start : start + self.chunk_size]
                seed = sampling_seed(self.config, meta_info, rank, round_index * ROUND_STRIDE + chunk)
                budgets = [self.response_length - len(t.ids) for t in part]
                contexts, images = [t.prompt + t.ids for t in part], with_images([t.vision for t in part])
                samples = self.engine.generate_tokens(contexts, budgets, params, seed, **images)
                for trajectory, sample in zip(part, samples):
                    trajectory.batch_sizes.append(len(part))
                    self._take_turn(trajectory, sample)
            for trajectory in active:
                if trajectory.finish is None:
                    self._append_answers(trajectory)
            round_index += 1
        return round_index

    def _agent_names(self, prompts: Batch) -> list[str]:
        """Each row's agent loop (its ``agent_name``, else the default), refused when the settings cannot run it."""
        default = self.config.agent.default_agent_loop or ("tool_agent" if self.settings.enable else SINGLE_TURN)
        agents = [name or default for name in prompts.non_tensors.get(AGENT_NAME, [""] * len(prompts))]
        loops = self.endpoint_agents.loops if self.endpoint_agents is not None else dict(REGISTERED)  # loaded once
        for name in set(agents) - {SINGLE_TURN, "tool_agent"}:
            problem = agent_loop_problem(name, self.config, loops)
            if problem is not None:
                raise ValueError(f"a row's agent_name is {name}: {problem}")
        return agents

    async def _tool_loop(self, trajectory: Trajectory, server: TokenServer) -> None:
        """One trajectory of the built-in loop on its own (continuous batching): a turn, its calls' answers once they
        are all in (no other trajectory waits for them), the next turn."""
        while trajectory.finish is None:
            budget = {"max_tokens": self.response_length - len(trajectory.ids)}
            output = await server.generate("", prompt_ids=trajectory.prompt + trajectory.ids, sampling_params=budget)
            turn = TokenSample(output.token_ids, output.log_probs, output.finish_reason, output.versions)
            self._take_turn(trajectory, turn)
            if trajectory.finish is None:
                answers = [future for _, future in trajectory.pending]
                answers += [trajectory.reply] if trajectory.reply is not None else []
                await asyncio.wait([asyncio.wrap_future(f) for f in answers], timeout=self._stuck_after(calls=2))
                self._append_answers(trajectory)

    def _stuck_after(self, calls: int) -> float:
        """How long to wait for ``calls`` answers of the tools' loop (an interaction's reply counts two: it may call
        tools itself), each bounded by ``tool_timeout_s``, before taking the loop itself as stuck."""
        return calls * float(self.settings.tool_timeout_s) + STUCK_MARGIN_S

    # ------------------------------------------------------------------ one turn
    def _take_turn(self, trajectory: Trajectory, sample: TokenSample) -> None:
        """Append the policy's turn; read its calls and start them, or end the trajectory."""
        trajectory.append(sample.token_ids, from_policy=True, log_probs=sample.log_probs, versions=sample.versions)
        trajectory.assistant_turns += 1
        trajectory.turn_rewards.append(0.0)
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        trajectory.messages.append({"role": "assistant", "content": text})
        if sample.finish_reason == "length" or len(trajectory.ids) >= self.response_length:
            trajectory.finish = "length"
            return
        if trajectory.single_turn:
            trajectory.finish = "stop"
            return
        calls = parse_calls(self.tokenizer.decode(sample.token_ids), self.settings.format, self.schemas)
        calls = calls if self.tools else []
        if not calls and trajectory.session.interaction is None:
            trajectory.finish = "stop"
            return
        if self.settings.on_parse_error == "stop" and any(call.error is not None for call in calls):
            trajectory.finish = "parse_error"
            return
        settings = self.settings
        turns_left = settings.max_assistant_turns is None or trajectory.assistant_turns < settings.max_assistant_turns
        rounds_left = settings.max_user_turns is None or trajectory.user_turns < settings.max_user_turns
        if not (turns_left and rounds_left):
            trajectory.finish = "max_turns"
            return
        if not calls:  # the simulated user answers
            trajectory.reply = self.executor.reply(trajectory.session, trajectory.context + trajectory.messages)
            return
        allowed = int(settings.max_parallel_calls)
        trajectory.pending = [(call, self.executor.submit(call, trajectory.session)) for call in calls[:allowed]]
        trajectory.pending += [
            (call, refused(f"at most {allowed} calls per turn", "limit")) for call in calls[allowed:]
        ]

    def _append_answers(self, trajectory: Trajectory) -> None:
        """Append the answers of the trajectory's calls or its interaction's reply (one delta), or end it when they do
        not fit."""
        if trajectory.reply is not None:
            self._append_reply(trajectory)
            return
        answers = []
        for call, future in trajectory.pending:
            waiting = time.perf_counter()
            try:
                result = future.result(timeout=self._stuck_after(calls=1))
            except concurrent.futures.TimeoutError:  # the tools' loop itself is stuck (a tool blocking in async code)
                result = CallResult(f"error: {call.name} did not answer", "timeout", float("nan"))
            trajectory.tool_wait_s += time.perf_counter() - waiting
            trajectory.tool_rewards.append(result.reward)
            trajectory.turn_rewards[-1] += result.reward
            text, truncated = self.observations.cap(result.text)
            answers.append(text)
            trajectory.calls.append(
                {
                    "name": call.name,
                    "arguments": call.arguments,
                    "error": result.error,
                    "latency_s": result.latency_s,
                    "truncated": truncated,
                    "answer": text,
                }
            )
            trajectory.messages.append({"role": "tool", "content": text})
        trajectory.pending = []
        self._append_observation(trajectory, self.observations.encode(answers))

    def _append_reply(self, trajectory: Trajectory) -> None:
        try:
            done, text, score, problem = trajectory.reply.result(timeout=self._stuck_after(calls=2))
        except concurrent.futures.TimeoutError:  # the loop itself is stuck
            done, text, score, problem = True, "", 0.0, "the interaction did not answer"
        trajectory.reply = None
        trajectory.turn_scores.append(score)
        trajectory.turn_rewards[-1] += score
        if problem is not None:
            trajectory.tool_problems.append(problem)
        if done:
            trajectory.finish = "interaction"
            return
        trajectory.messages.append({"role": "user", "content": text})
        self._append_observation(trajectory, self.observations.encode([text], role="user"))

    def _append_observation(self, trajectory: Trajectory, delta: list[int]) -> None:
        """What answered the last turn, as tokens (mask 0), or the trajectory's end when it and a next turn do not
        fit."""
        if len(trajectory.ids) + len(delta) >= self.response_length:
            trajectory.finish = "length"
            return
        trajectory.append(delta, from_policy=False)
        trajectory.user_turns += 1

    def _session(self, extra_info: Any) -> ToolSession:
        """A trajectory's tools and interaction, from its row's ``extra_info``."""
        session = ToolSession(tools_kwargs_of(extra_info))
        wanted = interaction_kwargs_of(extra_info)
        if wanted is not None:
            if wanted["name"] not in self.interactions:
                configured = ", ".join(sorted(self.interactions)) or "none"
                raise ValueError(
                    f"a row's extra_info.interaction_kwargs.name is {wanted['name']!r}, which names no interaction of "
                    f"multi_turn.interaction_config_path (configured: {configured})"
                )
            session.interaction, session.interaction_kwargs = self.interactions[wanted["name"]], wanted
        return session

    def _finish_sessions(self, trajectories: list[Trajectory]) -> None:
        """Every trajectory's tool instances asked their rewards and released, all at once."""
        finishing = [
            (t, self.executor.finish(t.session))
            for t in trajectories
            if t.session.created or t.session.interaction_id is not None
        ]
        for trajectory, future in finishing:
            try:
                trajectory.reward_scores, problems = future.result(
                    timeout=self._stuck_after(calls=2 * (len(trajectory.session.created) + 1))
                )
                trajectory.tool_problems += problems
            except concurrent.futures.TimeoutError:  # the tools' loop itself is stuck
                trajectory.tool_problems.append("the tools did not answer calc_reward/release")


def task_row(prompts: Batch, row: int) -> dict[str, Any]:
    """A prompt row as an endpoint agent gets it: the dataset's columns (``prompt`` = the raw messages)."""
    columns = {"prompt": RAW_PROMPT, "data_source": DATA_SOURCE, "reward_model": REWARD_MODEL, "extra_info": EXTRA_INFO}
    columns["ability"] = "ability"
    return {name: prompts.non_tensors[key][row] for name, key in columns.items() if key in prompts.non_tensors}


def _as_messages(raw_prompt: Any) -> list[dict[str, Any]]:
    """A row's prompt as chat messages (a plain-string prompt is one user message)."""
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    return [dict(message) for message in raw_prompt]
