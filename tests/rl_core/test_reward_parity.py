"""ppoflow's rule scorers give verl 0.9's scores: 420 generated responses scored by verl's own scorer files
(tests/rl_core/make_verl_reward_cases.py, run in a scratch venv with verl), and hand-checked cases."""

import json
from pathlib import Path

import pytest

from rl_core.reward.scorers import default_compute_score

CASES = [
    json.loads(line) for line in (Path(__file__).parent / "data" / "verl_reward_cases.jsonl").read_text().splitlines()
]


def test_every_generated_response_scores_as_in_verl():
    mismatches = [
        (c["data_source"], c["response"][-80:], c["ground_truth"], c["verl_score"], ours)
        for c in CASES
        if (ours := default_compute_score(c["data_source"], c["response"], c["ground_truth"])) != c["verl_score"]
    ]
    assert mismatches == []
    # the cases exercise both outcomes of every scorer
    for source in ("openai/gsm8k", "lighteval/MATH", "math_dapo"):
        scores = {json.dumps(c["verl_score"]) for c in CASES if c["data_source"] == source}
        assert len(scores) >= 2, source


@pytest.mark.parametrize(
    "data_source,response,truth,expected",
    [
        # gsm8k: the last "#### N" of the final 300 characters, commas dropped, compared as a string
        ("openai/gsm8k", "3+4 = 7\n#### 7", "7", 1.0),
        ("openai/gsm8k", "#### 1,234", "1234", 1.0),
        ("openai/gsm8k", "#### 7.", "7", 0.0),  # verl keeps the period: wrong (lenient_answers accepts it)
        ("openai/gsm8k", "#### 7\n#### 8", "7", 0.0),  # the last one counts
        ("openai/gsm8k", "the answer is 7", "7", 0.0),
        ("openai/gsm8k", "#### 7" + " pad" * 80, "7", 0.0),  # beyond the final 300 characters
        # MATH: the last boxed answer, normalised by the MATH rules
        ("lighteval/MATH", r"so \boxed{\dfrac{1}{2}}.", r"\frac{1}{2}", 1.0),
        ("lighteval/MATH", r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        ("lighteval/MATH", r"\boxed{1/2}", r"\frac{1}{2}", 1.0),
        ("lighteval/MATH", r"\boxed{\frac34}", r"\frac{3}{4}", 1.0),
        ("lighteval/MATH", r"\boxed{x = 5}", "5", 1.0),
        ("lighteval/MATH", r"\boxed{5 \text{ cm}}", "5", 1.0),
        ("lighteval/MATH", r"\boxed{90^\circ}", "90", 1.0),
        ("lighteval/MATH", r"\boxed{3} and \boxed{7}", "3", 0.0),
        ("lighteval/MATH", r"\fbox{5}", "5", 0.0),  # found, but verl cannot unbox it
        ("lighteval/MATH", r"\boxed 5$ done", "5", 1.0),
        ("lighteval/MATH", "no box 5", "5", 0.0),
        # DAPO / Minerva: "Answer: ..." first, +1 / -1
        ("math_dapo", "Answer: 42", "42", {"score": 1.0, "acc": True, "pred": "42"}),
        ("math_dapo", "Answer: 1,000", "1000", {"score": 1.0, "acc": True, "pred": "1000"}),
        ("aime24", "Answer: 5 dollars", "5", {"score": 1.0, "acc": True, "pred": "5"}),
        ("math", "Answer: 7", "42", {"score": -1.0, "acc": False, "pred": "7"}),
        ("math_dapo", r"so \boxed{42}", "42", {"score": 1.0, "acc": True, "pred": "42"}),
        ("math_dapo", "no answer", "42", {"score": -1.0, "acc": False, "pred": "[INVALID]"}),
    ],
)
def test_hand_checked_cases(data_source, response, truth, expected):
    assert default_compute_score(data_source, response, truth) == expected


def test_lenient_answers_is_opt_in():
    assert default_compute_score("openai/gsm8k", "#### 7.", "7") == 0.0
    assert default_compute_score("openai/gsm8k", "#### 7.", "7", lenient=True) == 1.0
    assert default_compute_score("openai/gsm8k", "#### 1234", "1,234", lenient=True) == 1.0
