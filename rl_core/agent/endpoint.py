"""The ``endpoint_agent`` loop: any agent trains through an OpenAI-compatible chat-completions endpoint. (Agent loops
of one's own, rl_core/agent/loops.py, are run here too: their token requests join the same batches.)

For one rollout, each trajectory's agent (``rollout.agent.endpoint``: a Python callable, or a command) gets a
``base_url`` of its own and the run's API key, and talks to the policy with any OpenAI client
(:mod:`rl_core.agent.chat_api` serves it on 127.0.0.1; the key is made at random for each rollout). ppoflow records
the exact tokens of the conversation and trains them as the tool loop's trajectories are trained::

    first request      its messages rendered by the chat template (the request's ``tools`` shown) = the prompt
                       (it replaces the row's; at most data.max_prompt_length tokens)
    a later request    that repeats the conversation so far (the last request's messages + the reply as returned)
                       and adds messages: those are appended as the template's fixed-base delta (mask 0,
                       rl_core/agent/observations.py), then the reply is sampled from the whole context
    every reply        its token ids as sampled (never decoded and re-encoded), mask 1, with their log-probs

so the trained sequence is exactly what the policy was conditioned on. ``rollout.response_length`` bounds everything
after the prompt: a request that does not fit is refused (``context_length_exceeded``) and the trajectory ends
(``length``). A request that rewrites the conversation instead (drops, edits or reorders earlier messages) is still
answered, from its own render, but neither it nor the trajectory's later calls are trained (counted:
``endpoint/untrained_calls_per_sample``). The same request sent again (a client's retry) gets the same reply.

Batching follows ``rollout.agent.batching``. ``rounds`` (a synchronous run's default): a round is generated when every
agent still running waits on a request (in trajectory order, chunks of ``generation_batch_size``, seeds
``sampling_seed(..., round * ROUND_STRIDE + chunk)``), so the batch does not depend on the agents' timing and a re-run
step draws the same samples. ``continuous`` (the asynchronous schedules' default): a batch is generated as soon as a
request waits and the engine is free (gathered for up to ``LINGER_S`` after the last arrival while fewer than a chunk
wait and some running agent does not), so an agent busy with a tool holds no one's turn; the batches, and so the
samples, then depend on timing. In that mode the tool loop's trajectories run here too, each as a coroutine of its own
(``MultiTurnRollout``'s ``_tool_loop``): a turn, its calls' answers, the next turn. An agent that raises,
exits non-zero or makes no request ends its trajectory with ``agent_error``; one whose own time (wall clock outside
its requests to the endpoint) passes ``timeout_s`` with ``agent_timeout`` (a command is killed; a Python agent's
thread is left to end on its own and its calls are refused): a hanging agent holds the others' next round up to
``timeout_s``, never longer, and their waiting is not counted against them. The trajectory keeps what it had (a
trajectory with no reply is one untrained EOS token). A callable's return value, or a command's last stdout line (JSON
if it parses), reaches the reward function as ``extra_info["agent_output"]``.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rl_core.agent.chat_api import ApiError, ChatRequest, ChatServer, completion_body, openai_tool_calls
from rl_core.agent.loops import (
    AgentLoopBase,
    AgentLoopOutput,
    TokenOutput,
    TokenRequest,
    TokenServer,
    configured_loops,
    fill_trajectory,
)
from rl_core.agent.observations import ObservationEncoder
from rl_core.agent.parsers import HERMES_CALL, parse_hermes
from rl_core.agent.user_agent import load_agent, start_agent, stop_agent
from rl_core.rollout.base import (
    SamplingParams,
    TokenEngine,
    data_parallel_rank,
    sampling_seed,
    stop_token_ids,
    with_images,
)

# seed parts of round r: r * ROUND_STRIDE + chunk (the tool loop's rounds too; its round 0: the single-turn seeds)
ROUND_STRIDE = 10_000
LINGER_S = 0.01  # continuous batching: how long a batch waits after the last request that joined it
MODEL_ID = "ppoflow-policy"


@dataclass
class _Call:
    """A request waiting for its reply (an answer body, a TokenOutput or an :class:`ApiError`); ``on_reply`` hands it
    over."""

    request: ChatRequest | TokenRequest
    on_reply: Callable[[Any], None]


def _extends_prompt(job: tuple) -> bool:
    """Whether a generation job's context starts with its trajectory's prompt (its images' tokens then lie where the
    prompt's do)."""
    session, context = job[0], job[2]
    return context[: len(session.trajectory.prompt)] == session.trajectory.prompt


@dataclass
class _Session:
    """One trajectory's agent and conversation."""

    trajectory: Any  # rl_core.agent.runner.Trajectory
    row: dict[str, Any]
    loop: type[AgentLoopBase] | None = None  # its agent loop (rl_core/agent/loops.py), else the endpoint's agent
    driver: Callable[[Any, TokenServer], Any] | None = None  # or async driver(trajectory, server): the tool loop
    task: Any = None  # the loop's running coroutine (a concurrent Future)
    history: list[dict[str, str]] | None = None  # the last recorded request's messages + its reply
    last: tuple[list[dict[str, str]], dict[str, Any]] | None = None  # the last request's messages and answer
    waiting: _Call | None = None
    done: bool = False
    deadline: float = float("inf")
    off_trajectory: bool = False  # the agent rewrote the conversation, or it ended: calls are served, not trained
    calls: int = 0
    untrained_calls: int = 0
    replied_at: float | None = None
    asked_at: float = 0.0  # when its waiting request arrived
    error: str | None = None
    timed_out: bool = False
    output: Any = None
    process: subprocess.Popen | None = None


class EndpointAgents:
    """Runs the endpoint agents of a rollout's trajectories (see the module doc) over ``engine``'s token primitive."""

    def __init__(
        self, engine: TokenEngine, tokenizer: Any, rollout_config: Any, observations: ObservationEncoder, format: str
    ):
        self.engine, self.tokenizer, self.config, self.observations = engine, tokenizer, rollout_config, observations
        endpoint = rollout_config.agent.endpoint
        configured = endpoint.function is not None or endpoint.command is not None
        self.agent = load_agent(endpoint) if configured else None
        self.loops = configured_loops(rollout_config.agent.agent_loop_config_path)
        self.loop_thread: tuple[asyncio.AbstractEventLoop, threading.Thread] | None = None
        self.timeout_s = float(rollout_config.agent.endpoint.timeout_s)
        self.response_length = int(rollout_config.response_length)
        self.prompt_length = int(rollout_config.prompt_length)  # the batch's prompt width, set by run()
        self.chunk_size = int(rollout_config.generation_batch_size)
        self.stop_ids = set(stop_token_ids(tokenizer, rollout_config))
        self.format = format
        self.continuous = rollout_config.agent.batching == "continuous"
        self.condition = threading.Condition()
        self.last_arrival = 0.0  # when the latest request was queued

    def run(
        self,
        trajectories: list[Any],
        rows: list[dict[str, Any]],
        agent_names: list[str],
        params: SamplingParams,
        meta_info: dict[str, Any],
        first_round: int,
        width: int,
        driver: Callable[[Any, TokenServer], Any] | None = None,
    ) -> None:
        """Fill ``trajectories`` (their prompt, ids, mask, log-probs, messages, finish) from their agents' calls;
        rounds are numbered from ``first_round`` (after the tool loop's, in a batch that has both); a prompt has at
        most ``width`` tokens (the batch's). With ``driver`` (continuous batching), the trajectories whose agent is
        not an endpoint agent or a loop of one's own are run by it: ``await driver(trajectory, server)``."""
        self.prompt_length = width
        sessions = [
            _Session(trajectory, row, loop=self.loops.get(name), driver=None if trajectory.by_endpoint else driver)
            for trajectory, row, name in zip(trajectories, rows, agent_names)
        ]
        api_key = secrets.token_urlsafe(24)
        by_endpoint = any(session.loop is None and session.driver is None for session in sessions)
        server = (
            ChatServer(api_key, MODEL_ID, lambda index, request: self._receive(sessions, index, request))
            if by_endpoint
            else None
        )
        self.sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
        rank, round_index = data_parallel_rank(), first_round
        try:
            for index, session in enumerate(sessions):
                if session.loop is not None or session.driver is not None:
                    self._start_loop(sessions, index)
                else:
                    self._start(session, server.base_url(index), api_key)
            while (waiting := self._next_round(sessions)) is not None:
                self._serve(waiting, params, meta_info, rank, round_index)
                round_index += 1
        finally:
            if server is not None:
                server.close()
            for session in sessions:
                stop_agent(session.process)
        for session in sessions:
            if session.driver is None:
                self._conclude(session)
            elif session.error is not None:
                raise RuntimeError(f"the tool loop failed on a trajectory: {session.error}")

    # ------------------------------------------------------------------ agents
    def _start(self, session: _Session, base_url: str, api_key: str) -> None:
        session.deadline = time.monotonic() + self.timeout_s
        session.process = start_agent(
            self.agent, session.row, base_url, api_key, lambda output, error: self._finished(session, output, error)
        )

    def _start_loop(self, sessions: list[_Session], index: int) -> None:
        session = sessions[index]
        session.deadline = time.monotonic() + self.timeout_s if session.driver is None else float("inf")
        if self.loop_thread is None:  # one event loop for every agent loop of the worker
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="ppoflow-agent-loops", daemon=True)
            thread.start()
            self.loop_thread = (loop, thread)
        session.task = asyncio.run_coroutine_threadsafe(self._run_loop(sessions, index), self.loop_thread[0])

    async def _run_loop(self, sessions: list[_Session], index: int) -> None:
        session, output, error = sessions[index], None, None
        try:
            server = TokenServer(lambda request, on_reply: self._enqueue(sessions, index, _Call(request, on_reply)))
            if session.driver is not None:
                await session.driver(session.trajectory, server)
            else:
                agent = session.loop(tokenizer=self.tokenizer, server_manager=server, config=self.config)
                output = await agent.run(dict(self.sampling), raw_prompt=session.row.get("prompt"), **session.row)
                problem = (
                    output.problem() if isinstance(output, AgentLoopOutput) else "it did not return an AgentLoopOutput"
                )
                if problem is not None:
                    output, error = None, f"{session.loop.__name__}.run: {problem}"
        except asyncio.CancelledError:  # timed out
            return
        except Exception as raised:
            error = f"{type(raised).__name__}: {raised}"
        self._finished(session, output, error)

    def _finished(self, session: _Session, output: Any, error: str | None) -> None:
        with self.condition:
            if session.done:  # timed out before
                return
            session.output, session.error, session.done = output, error, True
            self._refuse_waiting(session, "this trajectory's agent has ended")
            self.condition.notify_all()

    def _expire(self, session: _Session) -> None:
        """An agent past its deadline: ended, its call refused, its process killed (under the condition's lock)."""
        session.done, session.timed_out = True, True
        session.error = f"timed out after {self.timeout_s:g} s (rollout.agent.endpoint.timeout_s)"
        self._refuse_waiting(session, session.error)
        stop_agent(session.process)
        if session.task is not None:
            session.task.cancel()

    @staticmethod
    def _refuse_waiting(session: _Session, why: str) -> None:
        if session.waiting is not None:
            session.waiting.on_reply(ApiError(409, why, code="trajectory_ended"))
            session.waiting = None

    # ------------------------------------------------------------------ requests
    def _receive(self, sessions: list[_Session], index: int, request: ChatRequest) -> dict[str, Any]:
        """A request of trajectory ``index`` (an HTTP thread): queued for the next round, answered when generated."""
        replied, answer = threading.Event(), []
        self._enqueue(sessions, index, _Call(request, lambda reply: (answer.append(reply), replied.set())))
        replied.wait()
        if isinstance(answer[0], ApiError):
            raise answer[0]
        return answer[0]

    def _enqueue(self, sessions: list[_Session], index: int, call: _Call) -> None:
        """Queue ``call`` of trajectory ``index`` for the next round (or refuse it: an ApiError raised)."""
        with self.condition:
            if not 0 <= index < len(sessions):
                raise ApiError(404, f"this rollout has no trajectory {index}", code="unknown_trajectory")
            session = sessions[index]
            if session.done:
                raise ApiError(409, "this trajectory's agent has ended", code="trajectory_ended")
            if session.waiting is not None:
                raise ApiError(409, "one request at a time per trajectory", code="concurrent_request")
            session.waiting = call
            session.asked_at = self.last_arrival = time.monotonic()
            self.condition.notify_all()

    def _next_round(self, sessions: list[_Session]) -> list[tuple[_Session, _Call]] | None:
        """The requests to generate next, in trajectory order, or None when every agent has ended (agents past their
        deadline are expired meanwhile). Rounds: once every running agent waits on a request; continuous: once one
        waits and the batch is a chunk, holds every running agent, or no request joined for ``LINGER_S``."""
        with self.condition:
            while True:
                now = time.monotonic()
                for session in sessions:
                    if not session.done and session.waiting is None and now >= session.deadline:
                        self._expire(session)
                running = [session for session in sessions if not session.done]
                if not running:
                    return None
                waiting = [(session, session.waiting) for session in running if session.waiting is not None]
                timeout = min((s.deadline for s in running if s.waiting is None), default=now) - now
                if len(waiting) == len(running):
                    return waiting
                if self.continuous and waiting:
                    linger = self.last_arrival + LINGER_S - now
                    if len(waiting) >= self.chunk_size or linger <= 0:
                        return waiting
                    timeout = min(timeout, linger)
                waited_for = [session for session in running if session.waiting is None]
                self.condition.wait(timeout=timeout if timeout != float("inf") else None)
                for session in waited_for:  # the engine's idle time, shared by the agents it waited for
                    session.trajectory.tool_wait_s += (time.monotonic() - now) / len(waited_for)

    def _serve(
        self,
        waiting: list[tuple[_Session, _Call]],
        params: SamplingParams,
        meta_info: dict[str, Any],
        rank: int,
        round_index: int,
    ) -> None:
        """Generate the replies of one round's requests (a retried request is answered from its session's record)."""
        jobs = []
        for session, call in waiting:
            try:
                if isinstance(call.request, TokenRequest):
                    jobs.append((session, call, *self._token_context(call.request)))
                    continue
                if session.last is not None and session.last[0] == call.request.messages:
                    self._answer(session, call, session.last[1])
                    continue
                jobs.append((session, call, *self._context(session, call.request)))
            except ApiError as error:
                self._answer(session, call, error)
        for chunk, start in enumerate(range(0, len(jobs), self.chunk_size)):
            part = jobs[start : start + self.chunk_size]
            seed = sampling_seed(self.config, meta_info, rank, round_index * ROUND_STRIDE + chunk)
            # a context that goes on from its trajectory's prompt is given the prompt's images
            images = with_images([job[0].trajectory.vision if _extends_prompt(job) else None for job in part])
            samples = self.engine.generate_tokens(
                [job[2] for job in part], [job[3] for job in part], params, seed, **images
            )
            for (session, call, context, _, recorded), sample in zip(part, samples):
                session.trajectory.batch_sizes.append(len(part))
                if isinstance(call.request, TokenRequest):
                    session.calls += 1
                    output = TokenOutput(sample.token_ids, sample.log_probs, sample.finish_reason, sample.versions)
                    self._answer(session, call, output)
                else:
                    self._answer(session, call, self._reply(session, call.request, context, sample, recorded))

    def _answer(self, session: _Session, call: _Call, reply: dict[str, Any] | TokenOutput | ApiError) -> None:
        """Hand ``reply`` to the waiting agent (a successful answer is kept for a retry of the same request)."""
        with self.condition:
            if isinstance(reply, dict):
                session.last = (call.request.messages, reply)
            session.waiting = None
            session.replied_at = time.monotonic()
            session.deadline += session.replied_at - session.asked_at  # its time waiting on the endpoint is not its own
        call.on_reply(reply)

    def _token_context(self, request: TokenRequest) -> tuple[list[int], int, bool]:
        """An agent loop's request as (context, budget, recorded=False): the loop assembles its trajectory itself."""
        limit = self.prompt_length + self.response_length
        if not request.prompt_ids or len(request.prompt_ids) > limit:
            raise ApiError(400, f"prompt_ids must hold 1 to {limit} tokens, not {len(request.prompt_ids)}")
        budget = min(request.max_tokens or self.response_length, self.response_length)
        return list(request.prompt_ids), budget, False

    def _context(self, session: _Session, request: ChatRequest) -> tuple[list[int], int, bool]:
        """The ids a request's reply is sampled from, its token budget, and whether it is recorded in the trajectory
        (appending the request's new messages to it)."""
        if request.logprobs and not self.config.calculate_log_probs:
            raise ApiError(400, "logprobs need actor_rollout_ref.rollout.calculate_log_probs=true", "logprobs")
        trajectory, messages = session.trajectory, request.messages
        if trajectory.finish == "length":
            raise self._overflow()
        if session.history is None and not session.off_trajectory:
            prompt = self._render(messages, request.tools)
            if len(prompt) > self.prompt_length:
                raise ApiError(
                    400,
                    f"the first request renders to {len(prompt)} tokens; a trajectory's prompt has at most "
                    f"{self.prompt_length} (data.max_prompt_length)",
                    "messages",
                    "context_length_exceeded",
                )
            trajectory.prompt, delta = prompt, []
        elif (
            not session.off_trajectory
            and len(messages) > len(session.history)
            and messages[: len(session.history)] == session.history
        ):
            delta = self.observations.encode_messages(messages[len(session.history) :])
        else:
            session.off_trajectory = True
            context = self._render(messages, request.tools)
            budget = min(request.max_tokens or self.response_length, self.response_length)
            if len(context) > self.prompt_length + self.response_length:
                raise ApiError(
                    400, f"the conversation renders to {len(context)} tokens", "messages", "context_length_exceeded"
                )
            return context, budget, False
        if delta:  # the agent's messages are its record even when they do not fit (as the tool loop records calls)
            new = messages[len(session.history) :]
            trajectory.messages += new
            gap = time.monotonic() - session.replied_at
            trajectory.calls += [_tool_call(message, gap) for message in new if message["role"] == "tool"]
        room = self.response_length - len(trajectory.ids) - len(delta)
        if room <= 0:
            trajectory.finish = "length"
            raise self._overflow()
        if delta:
            trajectory.append(delta, from_policy=False)
            trajectory.user_turns += 1
        return trajectory.prompt + trajectory.ids, min(room, request.max_tokens or room), True

    def _take_loop_output(self, session: _Session) -> None:
        """An agent loop's output as its trajectory; its ``extra_fields`` become the agent's output."""
        output = session.output
        if isinstance(output, AgentLoopOutput):
            session.output = output.extra_fields
            problem = fill_trajectory(
                output, session.trajectory, self.prompt_length, self.response_length, self.tokenizer
            )
            if problem is not None:
                session.error = f"{session.loop.__name__}.run: {problem}"

    def _overflow(self) -> ApiError:
        return ApiError(
            400,
            f"the conversation does not fit: a trajectory has {self.response_length} tokens after its prompt "
            "(data.max_response_length)",
            "messages",
            "context_length_exceeded",
        )

    def _reply(
        self, session: _Session, request: ChatRequest, context: list[int], sample: Any, recorded: bool
    ) -> dict[str, Any]:
        """The answer to a request from its sampled ``sample`` (a TokenSample), recorded in the trajectory or not."""
        ids = sample.token_ids
        text_ids = ids[:-1] if sample.finish_reason == "stop" and ids and ids[-1] in self.stop_ids else ids
        content: str | None = self.tokenizer.decode(text_ids, skip_special_tokens=request.skip_special_tokens)
        calls = parse_hermes(content) if request.tools and self.format == "hermes" else []
        tool_calls = openai_tool_calls(calls) if calls and all(call.error is None for call in calls) else []
        if tool_calls:
            content = HERMES_CALL.sub("", content).strip() or None
        session.calls += 1
        trajectory = session.trajectory
        if recorded:
            trajectory.append(ids, from_policy=True, log_probs=sample.log_probs, versions=sample.versions)
            trajectory.assistant_turns += 1
            trajectory.turn_rewards.append(0.0)
            trajectory.messages.append(
                {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}
            )
            session.history = request.messages + [{"role": "assistant", "content": content or ""}]
            if len(trajectory.ids) >= self.response_length:
                trajectory.finish = "length"
        else:
            session.untrained_calls += 1
        log_probs = None
        if request.logprobs:
            log_probs = [(self.tokenizer.decode([token]), value) for token, value in zip(ids, sample.log_probs)]
        finish = "length" if recorded and trajectory.finish == "length" else sample.finish_reason
        finish = "tool_calls" if tool_calls and finish == "stop" else finish
        return completion_body(MODEL_ID, content, tool_calls, finish, (len(context), len(ids)), log_probs)

    def _render(self, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------------ the end
    def _conclude(self, session: _Session) -> None:
        trajectory = session.trajectory
        if session.loop is not None:
            self._take_loop_output(session)
        if session.error is None and session.calls == 0:
            session.error = "the agent made no request"
        if not trajectory.mask or not any(trajectory.mask):  # nothing recorded: one untrained EOS token
            trajectory.ids, trajectory.mask, trajectory.log_probs, trajectory.versions = [], [], [], []
            trajectory.append([self.tokenizer.eos_token_id], from_policy=False)
        if trajectory.finish is None and session.error is not None:
            trajectory.finish = "agent_timeout" if session.timed_out else "agent_error"
        trajectory.finish = trajectory.finish or "stop"
        trajectory.endpoint = {
            "agent_output": session.output,
            "agent_error": session.error,
            "endpoint_calls": session.calls,
            "untrained_calls": session.untrained_calls,
        }


def _tool_call(message: dict[str, str], gap_s: float) -> dict[str, Any]:
    """A tool message an agent sent, as the trajectory's record of a call (its latency: the agent's time between the
    reply and this request)."""
    return {
        "name": None,
        "arguments": None,
        "error": None,
        "latency_s": gap_s,
        "truncated": False,
        "answer": message["content"],
    }
