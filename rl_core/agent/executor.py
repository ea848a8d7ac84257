"""Tool calls run concurrently with generation: one asyncio loop in a daemon thread per rollout worker.

The rollout submits a chunk's calls as soon as the chunk is generated and collects the answers before the next round,
so tools of chunk k run while chunk k+1 generates. Every call is bounded: ``max_concurrent_tools`` in flight at once
and ``tool_timeout_s`` each (a timed-out call is cancelled: the python tool kills its process group). A call that
cannot be read, names an unknown tool, fails or times out is answered ``error: ...`` and counted by kind
(``tool/errors/<kind>``), never raised.

Tools are async (verl's :class:`~rl_core.agent.tools.base.BaseTool`): one that blocks inside ``async def`` holds up
every other call of its worker, so anything that can hang belongs in a subprocess (as the python tool does).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from rl_core.agent.parsers import ToolCall
from rl_core.agent.tools.base import BaseTool, run_call

ERROR_KINDS = ("parse", "unknown", "exception", "timeout", "limit")
REFUSED_KINDS = ("parse", "unknown", "limit")  # answered without running the tool


@dataclass
class CallResult:
    """A call's answer as the policy reads it; ``error``: None when it succeeded, else one of ``ERROR_KINDS``."""

    text: str
    error: str | None
    latency_s: float


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

    def submit(self, call: ToolCall) -> Future:
        """Start ``call``; its :class:`CallResult` arrives in the returned future."""
        if call.error is not None:
            return refused(call.error, "parse")
        if call.name not in self.tools:
            return refused(f"no tool named {call.name!r}; the tools are {', '.join(sorted(self.tools))}", "unknown")
        return asyncio.run_coroutine_threadsafe(self._run(self.tools[call.name], call.arguments), self.loop)

    async def _run(self, tool: BaseTool, arguments: dict) -> CallResult:
        async with self.slots:
            started = time.perf_counter()
            try:
                response, ok = await asyncio.wait_for(run_call(tool, arguments), self.timeout_s)
            except asyncio.TimeoutError:
                text = f"error: {tool.name} timed out after {self.timeout_s:g} s"
                return CallResult(text, "timeout", time.perf_counter() - started)
            return CallResult(response.text, None if ok else "exception", time.perf_counter() - started)
