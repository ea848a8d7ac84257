"""Dataset files and their rows, read and checked without torch (the run's input checks use them before anything
starts): .parquet or .jsonl files of verl-format rows (:mod:`rl_core.data.dataset` describes a row)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    """A dataset file or row is unusable; the message names the file, row and column."""


def read_rows(path: str | Path) -> list[dict]:
    """All rows of a .parquet, .jsonl or .json file as dicts."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).read().to_pylist()  # not pq.read_table: its dataset reader imports pandas (~0.15 s)
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open() as handle:
            for number, line in enumerate(handle):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as error:
                        raise DatasetError(f"{path}: line {number + 1} is not valid JSON ({error})") from error
        return rows
    raise DatasetError(f"{path}: unsupported file type {path.suffix!r}; use .parquet or .jsonl")


def peek_rows(path: str | Path, count: int) -> tuple[int, list[dict]]:
    """(number of rows, the first ``count`` rows) of a .parquet or .jsonl file without reading it all (a parquet
    file's row count is in its footer; a jsonl file's lines are counted, not parsed)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            source = pq.ParquetFile(path)
            first = next(source.iter_batches(batch_size=count), None)
        except Exception as error:  # pyarrow's own errors: not a parquet file, truncated, ...
            raise DatasetError(f"{path}: not a readable parquet file ({type(error).__name__}: {error})") from None
        return source.metadata.num_rows, first.to_pylist() if first is not None else []
    if path.suffix in (".jsonl", ".json"):
        rows, total = [], 0
        with path.open() as handle:
            for number, line in enumerate(handle):
                if not line.strip():
                    continue
                total += 1
                if len(rows) < count:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as error:
                        raise DatasetError(f"{path}: line {number + 1} is not valid JSON ({error})") from error
        return total, rows
    raise DatasetError(f"{path}: unsupported file type {path.suffix!r}; use .parquet or .jsonl")


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows as parquet (``.parquet``) or JSON lines (``.jsonl``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def validate_row(row: dict, where: str, prompt_key: str = "prompt") -> None:
    """Check the columns every stage needs; ``where`` is "file: row N" for the message."""
    if not isinstance(row.get("data_source"), str):
        raise DatasetError(f"{where} has no string 'data_source' column (it picks the reward scorer)")
    prompt = row.get(prompt_key)
    if isinstance(prompt, str) or (
        isinstance(prompt, (list, tuple))
        and prompt
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    ):
        pass
    else:
        raise DatasetError(
            f"{where}: column '{prompt_key}' must be a list of {{'role', 'content'}} messages or a string, got "
            f"{prompt!r:.80}"
        )
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise DatasetError(f"{where} has no 'reward_model.ground_truth' (needed by the rule and custom reward scorers)")
    agent = row.get("agent_name")
    if agent is not None and not isinstance(agent, str):  # the name itself is checked against the config's loops
        raise DatasetError(f"{where}: agent_name must be a string (an agent loop's name), not {agent!r}")
    try:
        tools_kwargs_of(row.get("extra_info"))
        interaction_kwargs_of(row.get("extra_info"))
    except DatasetError as error:
        raise DatasetError(f"{where}: {error}") from None


# the built-in agent loops a row may name (verl's agent_name column): one turn, the loop with tools and interactions,
# or a user's agent through the OpenAI-compatible endpoint (rl_core/agent/endpoint.py); loops of one's own:
# rl_core/agent/loops.py
AGENT_LOOPS = ("single_turn_agent", "tool_agent", "endpoint_agent")

# verl's per-tool lifecycle keys of a multi-turn row's extra_info.tools_kwargs.<tool> (rl_core/agent/executor.py)
LIFECYCLE_KWARGS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")


def tools_kwargs_of(extra_info: Any) -> dict[str, Any]:
    """The row's ``extra_info.tools_kwargs`` checked: a mapping of tool names to mappings of the four lifecycle keys,
    each a mapping; a DatasetError naming what is wrong otherwise."""
    found = extra_info.get("tools_kwargs") if isinstance(extra_info, dict) else None
    if found is None:
        return {}
    if not isinstance(found, dict):
        raise DatasetError(f"extra_info.tools_kwargs must map tool names to their kwargs, not {type(found).__name__}")
    for tool, stages in found.items():
        if not isinstance(stages, dict) or not set(stages) <= set(LIFECYCLE_KWARGS):
            raise DatasetError(
                f"extra_info.tools_kwargs.{tool} must be a mapping with some of {', '.join(LIFECYCLE_KWARGS)}, not "
                f"{stages!r}"
            )
        for stage, value in stages.items():
            if value is not None and not isinstance(value, dict):
                raise DatasetError(f"extra_info.tools_kwargs.{tool}.{stage} must be a mapping, not {value!r}")
    return found


def interaction_kwargs_of(extra_info: Any) -> dict[str, Any] | None:
    """The row's ``extra_info.interaction_kwargs`` checked (a mapping whose ``name`` picks the interaction), or None;
    a DatasetError naming what is wrong otherwise."""
    found = extra_info.get("interaction_kwargs") if isinstance(extra_info, dict) else None
    if found is None:
        return None
    if not isinstance(found, dict) or not isinstance(found.get("name"), str):
        raise DatasetError(
            f"extra_info.interaction_kwargs must be a mapping with a string 'name' (the interaction), not {found!r:.80}"
        )
    return found
