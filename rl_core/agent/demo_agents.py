"""Agents of the ``endpoint_agent`` loop that ship with ppoflow: ordinary OpenAI-client programs (they know nothing of
ppoflow's rollout), for the demo and as templates.

``calc_agent``: the tool demo's task (``data.synthetic.task=calc``) through the endpoint::

    ppoflow train data.synthetic.task=calc actor_rollout_ref.rollout.agent.default_agent_loop=endpoint_agent \\
        actor_rollout_ref.rollout.agent.endpoint.function=rl_core.agent.demo_agents:calc_agent

It plays the built-in tool loop's part (``format=tag``, ``max_assistant_turns=2``): it asks the policy, runs each
``<call>EXPR</call>`` of the reply with the calculator and sends the answers back as tool messages, at most
``max_turns`` replies; a call it cannot read is answered with what is wrong, as the loop answers it.
"""

from __future__ import annotations

import functools
from typing import Any

from rl_core.agent.parsers import parse_tag
from rl_core.agent.tools.base import ToolError
from rl_core.agent.tools.calculator import SCHEMA, evaluate, show


@functools.cache
def ssl_context() -> Any:
    """One SSL context for every agent's HTTP client: each ``OpenAI`` client otherwise builds its own, ~24 ms (measured:
    more than the policy takes to answer the demo). Each agent keeps a connection pool of its own: many agents on one
    httpx pool slow down more than linearly (128 agents' two rounds: 2 s on one pool, 0.7 s on their own)."""
    import ssl

    return ssl.create_default_context()


def calc_agent(base_url: str, api_key: str, row: dict[str, Any], max_turns: int = 2) -> None:
    import httpx
    from openai import OpenAI  # the agent's own client: any OpenAI-compatible one would do

    with httpx.Client(verify=ssl_context(), timeout=600) as http:
        client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http)
        messages = [dict(message) for message in row["prompt"]]
        for turn in range(max_turns):
            reply = client.chat.completions.create(model="policy", messages=messages).choices[0]
            content = reply.message.content or ""
            messages.append({"role": "assistant", "content": content})
            calls = parse_tag(content, SCHEMA)
            if not calls or reply.finish_reason == "length" or turn == max_turns - 1:
                return
            messages += [{"role": "tool", "content": calculate(call)} for call in calls]


def calculate(call: Any) -> str:
    """A ``<call>`` answered as the calculator tool answers it."""
    if call.error:
        return f"error: {call.error}"
    try:
        return show(evaluate(call.arguments["expression"]))
    except ToolError as error:
        return f"error: {error}"
