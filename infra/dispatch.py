"""The dispatch modes of :mod:`rl_core.workers.dispatch`, implemented over a list of Ray actor handles."""

from __future__ import annotations

from typing import Any

from rl_core.batch import Batch
from rl_core.workers.dispatch import DP_COMPUTE, ONE_TO_ALL, RANK_ZERO, reduce_rank_metrics


def split_arguments(mode: str, world_size: int, args: tuple, kwargs: dict) -> tuple[list[tuple[tuple, dict]], int]:
    """Per-rank (args, kwargs) and the pad size to remove on collect (DP_COMPUTE splits every Batch argument)."""
    if mode in (ONE_TO_ALL, RANK_ZERO):
        ranks = 1 if mode == RANK_ZERO else world_size
        return [(args, kwargs)] * ranks, 0
    if mode != DP_COMPUTE:
        raise ValueError(f"unknown dispatch mode {mode!r}")
    pad_size = 0
    per_rank_args: list[list[Any]] = [[] for _ in range(world_size)]
    per_rank_kwargs: list[dict[str, Any]] = [{} for _ in range(world_size)]

    def shards(value: Any) -> list[Any]:
        nonlocal pad_size
        if not isinstance(value, Batch):
            return [value] * world_size
        padded, pad_size = value.pad_to_multiple(world_size)
        return padded.chunk(world_size)

    for value in args:
        for rank, shard in enumerate(shards(value)):
            per_rank_args[rank].append(shard)
    for key, value in kwargs.items():
        for rank, shard in enumerate(shards(value)):
            per_rank_kwargs[rank][key] = shard
    return [(tuple(a), k) for a, k in zip(per_rank_args, per_rank_kwargs)], pad_size


def collect_results(mode: str, results: list[Any], pad_size: int) -> Any:
    """Rank 0's result; with DP_COMPUTE the ranks' Batches concatenated with the padding removed, or their metric dicts
    reduced (:func:`rl_core.workers.dispatch.reduce_rank_metrics`)."""
    if mode != DP_COMPUTE:
        return results[0]
    if isinstance(results[0], dict):
        return reduce_rank_metrics(results)
    if not isinstance(results[0], Batch):
        return results[0]
    if len(results) == 1:  # one rank: nothing to merge, no copy on the per-step path
        return results[0].unpad(pad_size)
    return Batch.concat(results).unpad(pad_size)
