"""verl's tool interface: a tool is created per trajectory, executed with the arguments of each call, asked for a
reward and released. Methods are async (a tool may wait on a process or a service); a failing call is answered with
an ``error: ...`` message to the policy, never an exception that ends the step (:func:`run_call`). In a rollout each
trajectory has its own instance of each tool it calls (rl_core/agent/executor.py: ``ToolSession``)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolResponse:
    """What the policy reads back from a call."""

    text: str


class ToolError(Exception):
    """A call the tool refuses (bad arguments, a limit): its message is what the policy reads."""


class BaseTool:
    """A tool as verl defines it: ``config`` (its own settings) and ``tool_schema`` (the OpenAI function schema the
    chat template shows the policy). ``idempotent``: a retried rollout may call it again with the same effect."""

    idempotent = True

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]):
        self.config = dict(config or {})
        self.tool_schema = tool_schema
        self.name = tool_schema["function"]["name"]

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """A new instance (per trajectory); returns its id."""
        return instance_id or uuid.uuid4().hex

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """One call: (the response, a step reward, metrics)."""
        raise NotImplementedError

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Free what the instance holds (always called, after the last call)."""


async def run_call(
    tool: BaseTool, parameters: Any, instance_id: str, execute_kwargs: dict[str, Any] | None = None
) -> tuple[ToolResponse, bool, float]:
    """One call of ``tool`` on its instance ``instance_id``: (the response, whether it succeeded, the step reward).
    Arguments that are not an object, a :class:`ToolError` or any exception become ``error: ...`` text (reward 0)."""
    if not isinstance(parameters, dict):
        kind = type(parameters).__name__
        return ToolResponse(f"error: {tool.name} takes a JSON object of arguments, not {kind}"), False, 0.0
    try:
        response, reward, _ = await tool.execute(instance_id, parameters, **(execute_kwargs or {}))
        return response, not response.text.startswith("error:"), float(reward or 0.0)
    except ToolError as error:
        return ToolResponse(f"error: {error}"), False, 0.0
    except Exception as error:  # a tool's own bug: the policy reads it, the step goes on
        return ToolResponse(f"error: {tool.name} failed: {type(error).__name__}: {error}"), False, 0.0


def call_tool(tool: BaseTool, parameters: Any) -> ToolResponse:
    """One call in a fresh instance, from synchronous code (``ppoflow tools call``)."""

    async def once() -> ToolResponse:
        instance = await tool.create()
        try:
            return (await run_call(tool, parameters, instance))[0]
        finally:
            await tool.release(instance)

    return asyncio.run(once())
