"""Rule-based scorers with verl's signature ``(data_source, solution_str, ground_truth, extra_info) -> score``.

:func:`default_compute_score` dispatches on ``data_source`` and gives verl 0.9's scores:
  openai/gsm8k                                    1.0 when the last ``#### <number>`` (in the final 300 characters,
                                                  commas dropped) equals the ground truth, else 0.0
  lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500
                                                  the MATH rules on the last boxed answer: 1.0 or 0.0
  math_dapo, math, math_dapo_reasoning, aime*     Minerva's rules: ``{"score": 1.0 | -1.0, "acc", "pred"}``
  ppoflow/addition                                the demo task: the first integer of the response
  ppoflow/calc                                    the tool demo: the last assistant message is the product
  ppoflow/shapes                                  the visual demo: the response's first word is the colour
  hiyouga/geometry3k                              verl's geo3k: 0.9 x the boxed answer is right (the MATH rules;
                                                  verl grades with mathruler) + 0.1 x the <think>...</think> format
With ``lenient=True`` (``reward.lenient_answers``) gsm8k also accepts a trailing period after the number and a
ground truth written with commas, and the MATH sources are judged by math-verify when it is installed.
"""

from __future__ import annotations

import re
from typing import Any

from rl_core.data import gsm8k, synthetic
from rl_core.reward.math_rules import dapo_math_score, hendrycks_math_score, last_boxed

HENDRYCKS_MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_MATH_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # and every data source starting with "aime"
GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_score(solution_str: str, ground_truth: Any, lenient: bool = False) -> float:
    """1.0 if the last ``#### <number>`` of the final 300 characters, commas removed, equals ``ground_truth``."""
    matches = GSM8K_ANSWER.findall(solution_str[-300:])
    if not matches:
        return 0.0
    answer = matches[-1].replace(",", "")
    if lenient:
        return 1.0 if answer.rstrip(".") == str(ground_truth).replace(",", "") else 0.0
    return 1.0 if answer == ground_truth else 0.0


def lenient_math_score(solution_str: str, ground_truth: Any) -> float:
    """math-verify's judgement of the last boxed answer (the MATH rules when math-verify is not installed)."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return hendrycks_math_score(solution_str, str(ground_truth))
    predicted = last_boxed(solution_str)
    if predicted is None:
        return 0.0
    return 1.0 if verify(parse(f"\\boxed{{{ground_truth}}}"), parse(predicted)) else 0.0


def addition_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the first integer in the response equals the ground truth, else 0.0."""
    match = re.search(r"-?\d+", solution_str)
    return 1.0 if match is not None and match.group(0) == str(ground_truth) else 0.0


def calc_score(solution_str: str, ground_truth: str, extra_info: dict | None) -> float:
    """1.0 if the final answer (a multi-turn trajectory's last assistant message, else the response) is the ground
    truth."""
    answer = (extra_info or {}).get("final_answer", solution_str)
    return 1.0 if str(answer).strip() == str(ground_truth) else 0.0


def shapes_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response's first word (case and punctuation aside) is the ground truth's colour, else 0.0."""
    words = re.findall(r"[a-z]+", solution_str.lower())
    return 1.0 if words and words[0] == str(ground_truth).lower() else 0.0


GEO3K_SOURCE, GEO3K_FORMAT = "hiyouga/geometry3k", re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def geo3k_score(solution_str: str, ground_truth: str, format_score: float = 0.1) -> float:
    """verl's geo3k score: (1 - format_score) x [the last boxed answer equals the ground truth] + format_score x [the
    response is ``<think>...</think>`` then a boxed answer]."""
    formatted = 1.0 if GEO3K_FORMAT.fullmatch(solution_str) else 0.0
    return (1.0 - format_score) * hendrycks_math_score(solution_str, str(ground_truth)) + format_score * formatted


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, lenient: bool = False
) -> float | dict:
    """Score one response with the rule scorer for ``data_source`` (see the module doc)."""
    if data_source == gsm8k.DATA_SOURCE:
        return gsm8k_score(solution_str, ground_truth, lenient)
    if data_source in HENDRYCKS_MATH_SOURCES:
        return (
            lenient_math_score(solution_str, ground_truth)
            if lenient
            else hendrycks_math_score(solution_str, ground_truth)
        )
    if data_source in DAPO_MATH_SOURCES or data_source.startswith("aime"):
        return dapo_math_score(solution_str, ground_truth)
    if data_source == synthetic.DATA_SOURCE:
        return addition_score(solution_str, ground_truth)
    if data_source == synthetic.CALC_DATA_SOURCE:
        return calc_score(solution_str, ground_truth, extra_info)
    if data_source == synthetic.SHAPES_DATA_SOURCE:
        return shapes_score(solution_str, ground_truth)
    if data_source == GEO3K_SOURCE:
        return geo3k_score(solution_str, ground_truth)
    known = [gsm8k.DATA_SOURCE, *HENDRYCKS_MATH_SOURCES, *DAPO_MATH_SOURCES, "aime*", synthetic.DATA_SOURCE]
    known += [synthetic.CALC_DATA_SOURCE, synthetic.SHAPES_DATA_SOURCE, GEO3K_SOURCE]
    raise ValueError(
        f"no rule scorer for data_source={data_source!r} (built in: {known}); set custom_reward_function.path to a "
        "file defining compute_score(data_source, solution_str, ground_truth, extra_info)"
    )
