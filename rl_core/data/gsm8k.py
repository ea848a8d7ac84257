"""GSM8K -> verl's dataset format, from a local copy of the public files (``train.jsonl``, ``test.jsonl`` of
github.com/openai/grade-school-math, or the parquet files of the HF dataset ``openai/gsm8k``).

Each source row has ``question`` and ``answer``; the answer ends with ``#### <number>``, the ground truth.
The prompt asks for that format, which the ``openai/gsm8k`` rule scorer checks.
"""

from __future__ import annotations

import re
from pathlib import Path

from rl_core.data.rows import DatasetError, read_rows, write_rows

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def extract_solution(answer: str) -> str:
    """The number after ``####`` with thousands separators removed."""
    match = re.search(r"#### (\-?[0-9\.\,]+)", answer)
    if match is None:
        raise ValueError("no '#### <number>' in the answer")
    return match.group(1).replace(",", "")


def convert_rows(rows: list[dict], split: str, source: str = "") -> list[dict]:
    converted = []
    for index, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise DatasetError(f"{source}: row {index} lacks 'question' or 'answer' (not a GSM8K file?)")
        try:
            ground_truth = extract_solution(row["answer"])
        except ValueError as error:
            raise DatasetError(f"{source}: row {index}, column 'answer': {error}") from error
        converted.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": ground_truth},
                "extra_info": {"split": split, "index": index, "answer": row["answer"], "question": row["question"]},
            }
        )
    return converted


def preprocess(input_dir: str | Path, output_dir: str | Path) -> dict[str, Path]:
    """Convert every ``train``/``test`` file found in ``input_dir`` to ``output_dir/<split>.parquet``."""
    input_dir, written = Path(input_dir), {}
    for split in ("train", "test"):
        candidates = sorted(input_dir.glob(f"{split}*.jsonl")) + sorted(input_dir.glob(f"{split}*.parquet"))
        if candidates:
            written[split] = write_rows(
                convert_rows(read_rows(candidates[0]), split, str(candidates[0])), Path(output_dir) / f"{split}.parquet"
            )
    if not written:
        raise DatasetError(f"{input_dir}: no train*.jsonl / test*.jsonl / *.parquet GSM8K files found")
    return written
