"""Writes tests/rl_core/data/verl_reward_cases.jsonl: generated responses scored by verl 0.9's own rule scorers.

Run it with a Python that has verl installed (a scratch venv: `pip install --no-deps verl==0.9.1`); ppoflow does not
depend on verl, so CI reads the stored scores and checks that ppoflow's scorers give the same ones
(tests/rl_core/test_reward_parity.py). Only verl's scorer files are loaded (by path), not its package.

    python tests/rl_core/make_verl_reward_cases.py /path/to/site-packages/verl
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

OUT = Path(__file__).parent / "data" / "verl_reward_cases.jsonl"
FILLER = "Let me think step by step about the numbers involved and check each partial result carefully. "

GSM8K_TRUTHS = ["7", "72", "1234", "-5", "0", "18", "3.5"]
GSM8K_ANSWERS = [
    "#### {a}",
    "#### {a}.",
    "####{a}",
    "#### {c}",
    "#### ${a}",
    "The answer is {a}",
    "#### {a}\n#### 9",
    "#### 9\n#### {a}",
    "#### {a} dollars",
    "so #### -{a}",
    "#### {a},",
    "answer: #### {a}.0",
]
MATH_TRUTHS = [
    "\\frac{1}{2}",
    "42",
    "\\sqrt{2}",
    "3\\sqrt{3}",
    "x+1",
    "90",
    "(1,2)",
    "\\frac{3}{4}",
    "10\\%",
    "0.25",
    "2\\pi",
    "5",
]
MATH_ANSWERS = [
    "\\boxed{{{a}}}",
    "\\boxed{{\\dfrac{{1}}{{2}}}}",
    "\\boxed{{0.5}}",
    "\\boxed{{1/2}}",
    "\\boxed {a}$",
    "\\fbox{{{a}}}",
    "\\boxed{{{a} \\text{{ cm}}}}",
    "\\boxed{{x = {a}}}",
    "\\boxed{{\\sqrt2}}",
    "\\boxed{{\\left( 1,2 \\right)}}",
    "\\boxed{{90^\\circ}}",
    "\\boxed{{10\\%}}",
    "\\boxed{{.25}}",
    "\\boxed{{{a}}} and \\boxed{{7}}",
    "\\boxed{{\\frac34}}",
    "\\boxed{{{a}",
    "\\boxed{{}}",
    "\\boxed{{\\frac}}",
    "\\boxed{{{a} \\text{{ m}} \\text{{ s}}}}",
    "\\boxed{{2 \\pi}}",
    "no box, just {a}",
    "\\boxed{{3\\sqrt3}}",
    "\\boxed{{ {a} }}",
    "\\boxed{{\\tfrac{{3}}{{4}}}}",
    "$\\boxed{{{a}}}$.",
]
DAPO_TRUTHS = ["42", "1000", "\\frac{1}{2}", "5", "x^2", "12"]
DAPO_ANSWERS = [
    "Answer: {a}",
    "answer : {a}",
    "Answer: ${a}$",
    "Answer: {a} dollars",
    "Answer: 1,000",
    "Answer: x = {a}",
    "\\boxed{{{a}}}",
    "Answer: {a}\nAnswer: 7",
    "The final answer is {a}",
    "Answer: \\boxed{{{a}}}",
    "Answer: \\text{{{a}}}",
    "Answer: {a}.",
    "Answer: the value is {a}",
    "ANSWER:{a}",
    "\\boxed{{{a}}} " + "then some more words " * 8,
]


def load(verl_root: Path, relative: str):
    spec = importlib.util.spec_from_file_location(relative.replace("/", "_"), verl_root / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cases(rng: random.Random):
    for _ in range(140):
        truth = rng.choice(GSM8K_TRUTHS)
        answer = rng.choice(GSM8K_ANSWERS).format(a=rng.choice([truth, truth, "8"]), c=f"{int(float(truth)) * 1000:,}")
        yield "openai/gsm8k", FILLER * rng.choice([0, 1, 4]) + answer + FILLER * rng.choice([0, 0, 4]), truth
    for _ in range(160):
        truth = rng.choice(MATH_TRUTHS)
        answer = rng.choice(MATH_ANSWERS).format(a=rng.choice([truth, truth, "7"]))
        yield (
            rng.choice(["lighteval/MATH", "HuggingFaceH4/MATH-500"]),
            FILLER * rng.choice([0, 1]) + "So " + answer,
            truth,
        )
    for _ in range(120):
        truth = rng.choice(DAPO_TRUTHS)
        answer = rng.choice(DAPO_ANSWERS).format(a=rng.choice([truth, truth, "7"]))
        yield rng.choice(["math_dapo", "aime24", "math"]), FILLER * rng.choice([0, 1, 4]) + answer, truth


def main() -> None:
    verl_root = Path(sys.argv[1]).parent
    gsm8k = load(verl_root, "verl/utils/reward_score/gsm8k.py")
    math_reward = load(verl_root, "verl/utils/reward_score/math_reward.py")
    math_dapo = load(verl_root, "verl/utils/reward_score/math_dapo.py")
    rows = []
    for data_source, response, truth in cases(random.Random(0)):
        if data_source == "openai/gsm8k":
            score = gsm8k.compute_score(response, truth)
        elif data_source in ("lighteval/MATH", "HuggingFaceH4/MATH-500"):
            score = math_reward.compute_score(response, truth)
        else:
            score = math_dapo.compute_score(response, truth)
        rows.append({"data_source": data_source, "response": response, "ground_truth": truth, "verl_score": score})
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} cases to {OUT}")


if __name__ == "__main__":
    main()
