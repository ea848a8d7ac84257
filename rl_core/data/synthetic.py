"""The synthetic demo task: add two small numbers. A tiny model learns it on CPU in minutes; rule-rewarded.

Rows are in verl's dataset format, so the demo exercises exactly the path a user's data takes::

    {"data_source": "ppoflow/addition", "prompt": [{"role": "user", "content": "7+12="}], "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "19"}, "extra_info": {"split": "train", "index": 0}}
"""

from __future__ import annotations

import random

DATA_SOURCE = "ppoflow/addition"


def addition_rows(count: int, seed: int, max_operand: int = 20, split: str = "train") -> list[dict]:
    """``count`` random problems a + b with 0 <= a, b <= ``max_operand``, deterministic in ``seed``."""
    rng = random.Random(f"{split}-{seed}")
    rows = []
    for index in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": index},
            }
        )
    return rows


def corpus(max_operand: int = 20) -> list[str]:
    """Every problem and answer of the task as text: what the tiny tokenizer is trained on."""
    return [f"{a}+{b}={a + b}" for a in range(max_operand + 1) for b in range(max_operand + 1)]
