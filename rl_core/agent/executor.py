"""Tool calls run concurrently with generation: one asyncio loop in a daemon thread per rollout worker.

The rollout submits a chunk's calls as soon as the chunk is generated and collects the answers before the next round,
so tools of chunk k run while chunk k+1 generates (with continuous batching, each trajectory's answers as soon as they
are all in). Every call is bounded: ``max_concurrent_tools`` in flight at once
and ``tool_timeout_s`` each (a timed-out call is cancelled: the python tool kills its process group). A call that
cannot be read, names an unknown tool, fails or times out is answered ``error: ...`` and counted by kind
(``tool/errors/<kind>``), never raised.

Tools are async (verl's :class:`~rl_core.agent.tools.base.BaseTool`): one that blocks inside ``async def`` holds up
every other call of its worker, so anything that can hang belongs in a subprocess (as the python tool does).

Each trajectory is a :class:`ToolSession` (verl's tool lifecycle and its dataset field ``extra_info.tools_kwargs``):
a tool is created on the trajectory's first call of it (``create_kwargs``), its later calls execute on that instance
(``execute_kwargs``; each returns a step reward), and when the rollout ends every instance is asked its reward
(``calc_reward_kwargs``) and released (``release_kwargs``). The rewards reach the reward function as verl passes them:
``extra_info["tool_rewards"]`` (the step rewards, in call order) and ``extra_info["rollout_reward_scores"]``
(``{tool: calc_reward}``). A trajectory's interaction (rl_core/agent/interactions.py) lives in its session too.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rl_core.agent.interactions import BaseInteraction
from rl_core.agent.parsers import ToolCall
from rl_core.agent.tools.base import BaseTool, ToolResponse, run_call

ERROR_KINDS = ("parse", "unknown", "exception", "timeout", "limit")
REFUSED_KINDS = ("parse", "unknown", "limit")  # answered without running the tool


@dataclass
class CallResult:
    """A call's answer as the policy reads it; ``error``: None when it succeeded, else one of ``ERROR_KINDS``."""

    text: str
    error: str | None
    latency_s: float
    reward: float = 0.0  # the tool's step reward (0 for a call that did not run)


@dataclass
class ToolSession:
    """One trajectory's tool instances: ``tools_kwargs`` is its row's ``extra_info.tools_kwargs`` (``{tool:
    {create_kwargs: {...}, execute_kwargs: ..., calc_reward_kwargs: ..., release_kwargs: ...}}``, all optional);
    ``interaction`` its simulated user, started with ``interaction_kwargs`` (its row's) on its first reply."""

    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    created: dict[str, asyncio.Future] = field(default_factory=dict)  # tool name -> its instance id, created once
    interaction: BaseInteraction | None = None
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)
    interaction_id: str | None = None

    def kwargs(self, tool: str, stage: str) -> dict[str, Any]:
        return dict((self.tools_kwargs.get(tool) or {}).get(f"{stage}_kwargs") or {})

    async def instance(self, tool: BaseTool) -> str:
        """The trajectory's instance of ``tool``, created on first use (concurrent calls share one creation)."""
        if tool.name not in self.created:
            self.created[tool.name] = asyncio.ensure_future(tool.create(None, **self.kwargs(tool.name, "create")))
        return await asyncio.shield(self.created[tool.name])


def refused(text: str, kind: str) -> Future:
    """A call answered without running anything (one of ``REFUSED_KINDS``)."""
    future: Future = Future()
    future.set_result(CallResult(f"error: {text}", kind, 0.0))
    return future


class ToolExecutor:
    def __init__(self, tools: dict[str, BaseTool], timeout_s: float, max_concurrent: int):
        self.tools = tools
        self.timeout_s = float(timeout_s)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="ppoflow-tools", daemon=True)
        self.thread.start()
        self.slots = asyncio.Semaphore(int(max_concurrent))

    def submit(self, call: ToolCall, session: ToolSession) -> Future:
        """Start ``call`` on the trajectory ``session``'s instance; its :class:`CallResult` arrives in the returned
        future."""
        if call.error is not None:
            return refused(call.error, "parse")
        if call.name not in self.tools:
            return refused(f"no tool named {call.name!r}; the tools are {', '.join(sorted(self.tools))}", "unknown")
        return asyncio.run_coroutine_threadsafe(self._run(self.tools[call.name], call.arguments, session), self.loop)

    async def _run(self, tool: BaseTool, arguments: dict, session: ToolSession) -> CallResult:
        async with self.slots:
            started = time.perf_counter()
            try:
                response, ok, reward = await asyncio.wait_for(self._call(tool, arguments, session), self.timeout_s)
            except asyncio.TimeoutError:
                text = f"error: {tool.name} timed out after {self.timeout_s:g} s"
                return CallResult(text, "timeout", time.perf_counter() - started)
            return CallResult(response.text, None if ok else "exception", time.perf_counter() - started, reward)

    @staticmethod
    async def _call(tool: BaseTool, arguments: dict, session: ToolSession) -> tuple[Any, bool, float]:
        try:
            instance = await session.instance(tool)
        except Exception as error:  # its creation failed: every call of it in this trajectory says so
            return ToolResponse(f"error: {tool.name} could not start: {type(error).__name__}: {error}"), False, 0.0
        return await run_call(tool, arguments, instance, session.kwargs(tool.name, "execute"))

    def reply(self, session: ToolSession, messages: list[dict[str, Any]]) -> Future:
        """The session's interaction answers the conversation ``messages``: the future holds (whether the dialogue
        ends, the reply, the turn's score, a problem or None). A failing or hanging interaction (``tool_timeout_s``)
        ends the dialogue with score 0 and the problem named."""
        return asyncio.run_coroutine_threadsafe(self._reply(session, list(messages)), self.loop)

    async def _reply(self, session: ToolSession, messages: list[dict[str, Any]]) -> tuple[bool, str, float, str | None]:
        interaction, kwargs = session.interaction, session.interaction_kwargs
        try:
            if session.interaction_id is None:
                session.interaction_id = await asyncio.wait_for(
                    interaction.start_interaction(None, **kwargs), self.timeout_s
                )
            done, text, score, _ = await asyncio.wait_for(
                interaction.generate_response(session.interaction_id, messages, **kwargs), self.timeout_s
            )
            return bool(done), str(text), float(score), None
        except Exception as error:
            kind = f"timed out after {self.timeout_s:g} s" if isinstance(error, asyncio.TimeoutError) else repr(error)
            return True, "", 0.0, f"{interaction.name}.generate_response: {kind}"

    def finish(self, session: ToolSession) -> Future:
        """Ask each of the session's instances its reward and release it, and finalize its interaction; the future
        holds (``{tool: reward}``, [what failed]). Each is bounded by ``tool_timeout_s``; a failing reward counts as 0
        and is reported."""
        return asyncio.run_coroutine_threadsafe(self._finish(session), self.loop)

    async def _finish(self, session: ToolSession) -> tuple[dict[str, float], list[str]]:
        rewards, problems = {}, []
        for name, created in session.created.items():
            tool = self.tools[name]
            try:
                instance = await created
            except Exception:  # never created: its calls said so already
                continue
            try:
                reward = tool.calc_reward(instance, **session.kwargs(name, "calc_reward"))
                rewards[name] = float(await asyncio.wait_for(reward, self.timeout_s))
            except Exception as error:
                rewards[name] = 0.0
                problems.append(f"{name}.calc_reward: {type(error).__name__}: {error}")
            try:
                await asyncio.wait_for(tool.release(instance, **session.kwargs(name, "release")), self.timeout_s)
            except Exception as error:
                problems.append(f"{name}.release: {type(error).__name__}: {error}")
        if session.interaction_id is not None:
            try:
                await asyncio.wait_for(session.interaction.finalize_interaction(session.interaction_id), self.timeout_s)
            except Exception as error:
                problems.append(f"{session.interaction.name}.finalize_interaction: {type(error).__name__}: {error}")
        return rewards, problems
