"""Tool calls read from the text of one assistant turn (``multi_turn.format``).

``hermes`` (verl's and Qwen's)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>

any number per turn. ``tag`` (the CPU demo's): ``<call>37*48</call>``, the text being the one required string argument
of the run's only tool. A call that cannot be read is kept as a :class:`ToolCall` with an ``error`` (the policy is told
what was wrong), never dropped and never an exception.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

FORMATS = ("hermes", "tag")
HERMES_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
TAG_CALL = re.compile(r"<call>(.*?)(</call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    """One call as the policy wrote it: the tool's name and arguments, or ``error`` (the call could not be read;
    ``name`` may still be known)."""

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None = None


def parse_hermes(text: str) -> list[ToolCall]:
    calls = []
    for body, closing in HERMES_CALL.findall(text):
        if not closing:
            calls.append(ToolCall(None, None, "a <tool_call> without </tool_call>"))
            continue
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as error:
            calls.append(ToolCall(None, None, f"the tool call is not valid JSON ({error.msg})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolCall(None, None, 'a tool call is {"name": ..., "arguments": {...}}'))
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            kind = type(arguments).__name__
            calls.append(ToolCall(call["name"], None, f"the arguments of {call['name']} must be an object, not {kind}"))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


def tag_argument(schema: dict[str, Any]) -> str:
    """The argument a ``tag`` call's text fills: the tool's only required parameter."""
    required = schema["function"].get("parameters", {}).get("required", [])
    if len(required) != 1:
        name = schema["function"]["name"]
        raise ValueError(f"format=tag fills one argument, but tool {name!r} requires {len(required)}: {required}")
    return required[0]


def parse_tag(text: str, tool_schema: dict[str, Any]) -> list[ToolCall]:
    name, argument = tool_schema["function"]["name"], tag_argument(tool_schema)
    calls = []
    for body, closing in TAG_CALL.findall(text):
        if not closing:
            calls.append(ToolCall(name, None, "a <call> without </call>"))
        else:
            calls.append(ToolCall(name, {argument: body.strip()}))
    return calls


def parse_calls(text: str, format: str, tool_schemas: list[dict[str, Any]]) -> list[ToolCall]:
    """The calls in one turn's ``text`` (decoded with its special tokens) in the order written."""
    if format == "hermes":
        return parse_hermes(text)
    if format == "tag":
        return parse_tag(text, tool_schemas[0]) if tool_schemas else []
    raise ValueError(f"multi_turn.format={format!r}: choose one of {FORMATS}")
