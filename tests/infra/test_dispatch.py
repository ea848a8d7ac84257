"""Dispatch arithmetic (no Ray): splitting a batch over ranks and collecting the shards back."""

import pytest
import torch

from infra.dispatch import collect_results, split_arguments
from rl_core.batch import Batch
from rl_core.workers.dispatch import DP_COMPUTE, ONE_TO_ALL, RANK_ZERO


@pytest.mark.parametrize("size,world", [(7, 2), (5, 3), (2, 4), (8, 4)])
def test_dp_split_pads_and_collect_unpads(size, world):
    batch = Batch({"x": torch.arange(size)}, {"uid": [f"u{i}" for i in range(size)]})
    per_rank, pad = split_arguments(DP_COMPUTE, world, (batch,), {"flag": True})
    assert len(per_rank) == world and pad == (-size) % world
    assert len({len(args[0]) for args, _ in per_rank}) == 1  # equal shards
    assert all(kwargs == {"flag": True} for _, kwargs in per_rank)
    outputs = [Batch({"y": args[0].tensors["x"] + 1}, meta_info={"metrics": {"m": float(rank)}}) for rank, (args, _) in enumerate(per_rank)]
    merged = collect_results(DP_COMPUTE, outputs, pad)
    assert merged.tensors["y"].tolist() == [i + 1 for i in range(size)]
    assert merged.meta_info["metrics"]["m"] == pytest.approx(sum(range(world)) / world)


def test_one_to_all_and_rank_zero():
    per_rank, _ = split_arguments(ONE_TO_ALL, 3, (1,), {})
    assert per_rank == [((1,), {})] * 3
    assert len(split_arguments(RANK_ZERO, 3, (1,), {})[0]) == 1
    assert collect_results(ONE_TO_ALL, ["a", "b", "c"], 0) == "a"
