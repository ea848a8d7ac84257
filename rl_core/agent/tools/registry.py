"""Which tools a run has: verl's tool YAML (``multi_turn.tool_config_path``), or the built-in tools by name.

```yaml
tools:
  - class_name: rl_core.agent.tools.calculator.CalculatorTool
    config: {type: native}
    tool_schema: {type: function, function: {name: calculator, description: ..., parameters: {...}}}
```
Every problem names the file and the tool (its position and name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rl_core.agent.tools import calculator, python_sandbox
from rl_core.agent.tools.base import BaseTool
from rl_core.agent.yaml_classes import import_class, yaml_entries

BUILTIN = {
    "calculator": (calculator.CalculatorTool, calculator.SCHEMA),
    "python": (python_sandbox.PythonTool, python_sandbox.SCHEMA),
}


class ToolConfigError(ValueError):
    """The tool YAML cannot be used."""


def builtin_tool(name: str, config: dict[str, Any] | None = None) -> BaseTool:
    if name not in BUILTIN:
        raise ToolConfigError(f"no built-in tool {name!r}: the built-in ones are {', '.join(sorted(BUILTIN))}")
    cls, schema = BUILTIN[name]
    return cls(config or {}, schema)


def load_tools(path: str | Path) -> dict[str, BaseTool]:
    """{name: tool} of the tool YAML at ``path``."""
    tools: dict[str, BaseTool] = {}
    for where, entry in yaml_entries(path, "tools", "tool config", "tool", ToolConfigError):
        if not isinstance(entry, dict) or not {"class_name", "tool_schema"} <= set(entry):
            raise ToolConfigError(f"{where}: needs class_name and tool_schema (and optionally config)")
        try:
            name = entry["tool_schema"]["function"]["name"]
        except (KeyError, TypeError):
            raise ToolConfigError(f"{where}: tool_schema needs function.name (OpenAI's function schema)") from None
        where = f"{where} ({name})"
        cls = import_class(entry["class_name"], where, BaseTool, ToolConfigError)
        if name in tools:
            raise ToolConfigError(f"{where}: a second tool named {name!r}")
        try:
            tools[name] = cls(entry.get("config") or {}, entry["tool_schema"])
        except Exception as error:
            raise ToolConfigError(f"{where}: {error}") from None
    return tools


def configured_tools(multi_turn: Any) -> dict[str, BaseTool]:
    """The tools of a run (``actor_rollout_ref.rollout.multi_turn``): those of its tool YAML when multi-turn rollouts
    are on, else none."""
    if not multi_turn.enable or not multi_turn.tool_config_path:
        return {}
    return load_tools(multi_turn.tool_config_path)


def tool_schemas(multi_turn: Any) -> list[dict[str, Any]]:
    """The OpenAI function schemas of a run's tools (what the chat template shows the policy); none when off."""
    return [tool.tool_schema for tool in configured_tools(multi_turn).values()]
