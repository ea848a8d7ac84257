"""The ``calculator`` tool: an arithmetic expression evaluated from its syntax tree (never ``eval``), bounded.

Numbers and ``+ - * / // % ** ( )`` with unary ``+``/``-``; at most ``max_length`` characters (64), exponents of at
most ``max_exponent`` (64) in magnitude, results of at most ``max_result`` (1e30) in magnitude. Integers stay exact;
``/`` gives a float; an integral float answer is shown without ``.0``."""

from __future__ import annotations

import ast
import asyncio
import operator
import random
from typing import Any

from rl_core.agent.tools.base import BaseTool, ToolError, ToolResponse

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses)",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 37*48"}},
            "required": ["expression"],
        },
    },
}
BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str, max_length: int = 64, max_exponent: int = 64, max_result: float = 1e30) -> int | float:
    """The value of ``expression``; a :class:`ToolError` saying what is not allowed otherwise."""
    if len(expression) > max_length:
        raise ToolError(f"the expression has {len(expression)} characters; at most {max_length}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r} as arithmetic") from None

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            result = node.value
        elif isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            result = UNARY[type(node.op)](value(node.operand))
        elif isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > max_exponent:
                raise ToolError(f"exponent {right} is larger than {max_exponent}")
            try:
                result = BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
        else:
            raise ToolError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")
        if isinstance(result, complex) or abs(result) > max_result:
            raise ToolError(f"the result is out of range (|x| <= {max_result:g})")
        return result

    return value(tree.body)


def show(number: int | float) -> str:
    return str(int(number)) if isinstance(number, float) and number.is_integer() else str(number)


class CalculatorTool(BaseTool):
    """Config: ``max_length``, ``max_exponent``, ``max_result`` (see :func:`evaluate`), and ``latency_s``: the answer
    comes that many seconds later, as from a remote service, or after a time drawn uniformly from ``[low, high]`` for
    each call, as from one whose answers take varying times (what bench/async_rl.py's tool workload uses)."""

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        latency = self.config.get("latency_s")
        if latency:
            low, high = (latency, latency) if isinstance(latency, (int, float)) else latency
            await asyncio.sleep(random.uniform(float(low), float(high)))
        expression = parameters.get("expression")
        if not isinstance(expression, str):
            raise ToolError("calculator takes {'expression': '<arithmetic>'}")
        limits = {key: self.config[key] for key in ("max_length", "max_exponent", "max_result") if key in self.config}
        return ToolResponse(show(evaluate(expression, **limits))), 0.0, {}
