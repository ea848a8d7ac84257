"""Rule-based scorers with verl's signature ``(data_source, solution_str, ground_truth, extra_info) -> float``.

:func:`default_compute_score` dispatches on ``data_source``:
  openai/gsm8k                   the answer after ``####`` must equal the ground truth
  math sources (MATH, DAPO, ...) the last ``\\boxed{...}`` must match; math-verify decides when installed
  ppoflow/addition               the first integer of the response must equal the ground truth
"""

from __future__ import annotations

import re
from typing import Any

from rl_core.data import gsm8k, synthetic

MATH_SOURCES = {"lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math", "math_dapo", "aime24", "aime25"}


def gsm8k_score(solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` if the last ``#### <number>`` equals ``ground_truth``; ``format_score`` if wrong but present; else 0."""
    matches = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str)
    if not matches:
        return 0.0
    answer = matches[-1].replace(",", "").rstrip(".")
    return score if answer == str(ground_truth).replace(",", "") else format_score


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for position in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[brace + 1 : position]
    return None


def _normalise(answer: str) -> str:
    answer = answer.strip().replace(" ", "").replace("\\!", "").replace("dfrac", "frac").replace("tfrac", "frac")
    answer = answer.replace("\\left", "").replace("\\right", "").replace("^\\circ", "").replace("^{\\circ}", "").rstrip(".")
    answer = re.sub(r"\\text\{(.*?)\}", r"\1", answer)
    return answer[:-2] if answer.endswith(".0") else answer


def math_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last boxed answer equals the ground truth (math-verify's judgement when installed), else 0.0."""
    predicted = last_boxed(solution_str)
    if predicted is None:
        return 0.0
    try:
        from math_verify import parse, verify
    except ImportError:
        return 1.0 if _normalise(predicted) == _normalise(str(ground_truth)) else 0.0
    return 1.0 if verify(parse(f"\\boxed{{{ground_truth}}}"), parse(f"\\boxed{{{predicted}}}")) else 0.0


def addition_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the first integer in the response equals the ground truth, else 0.0."""
    match = re.search(r"-?\d+", solution_str)
    return 1.0 if match is not None and match.group(0) == str(ground_truth) else 0.0


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """Score one response with the rule scorer for ``data_source``."""
    if data_source == gsm8k.DATA_SOURCE:
        return gsm8k_score(solution_str, ground_truth)
    if data_source in MATH_SOURCES:
        return math_score(solution_str, ground_truth)
    if data_source == synthetic.DATA_SOURCE:
        return addition_score(solution_str, ground_truth)
    raise ValueError(f"no rule scorer for data_source={data_source!r} (built in: {sorted({gsm8k.DATA_SOURCE, synthetic.DATA_SOURCE} | MATH_SOURCES)}); "
                     f"set custom_reward_function.path to a file defining compute_score(data_source, solution_str, ground_truth, extra_info)")
