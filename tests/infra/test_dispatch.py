"""Dispatch arithmetic (no Ray): splitting a batch over ranks and collecting the shards back, one row in, one row
out."""

from collections import Counter

import pytest
import torch

from infra.dispatch import collect_results, split_arguments
from rl_core.batch import Batch
from rl_core.workers.dispatch import DP_COMPUTE, ONE_TO_ALL, RANK_ZERO, reduce_rank_metrics


@pytest.mark.parametrize("size,world", [(7, 2), (5, 3), (2, 4), (8, 4)])
def test_dp_split_pads_and_collect_unpads(size, world):
    batch = Batch({"x": torch.arange(size)}, {"uid": [f"u{i}" for i in range(size)]})
    per_rank, pad = split_arguments(DP_COMPUTE, world, (batch,), {"flag": True})
    assert len(per_rank) == world and pad == (-size) % world
    assert len({len(args[0]) for args, _ in per_rank}) == 1  # equal shards
    assert all(kwargs == {"flag": True} for _, kwargs in per_rank)
    outputs = [Batch({"y": args[0].tensors["x"] + 1}) for args, _ in per_rank]
    merged = collect_results(DP_COMPUTE, outputs, pad)
    assert merged.tensors["y"].tolist() == [i + 1 for i in range(size)]


def fake_generate(prompts: Batch) -> Batch:
    """An engine's contract: one response row per prompt row, the row's non-tensors kept."""
    return Batch({"responses": prompts.tensors["prompt"] * 10}, dict(prompts.non_tensors))


@pytest.mark.parametrize("prompts,world,n", [(3, 2, 4), (5, 4, 2), (1, 3, 8), (6, 4, 3)])
def test_generation_on_a_batch_that_does_not_divide_over_the_ranks_keeps_n_samples_per_prompt(prompts, world, n):
    """The controller repeats each prompt n times before dispatch (rl_core.ppo_step.generate): padding and unpadding
    stay 1:1, so 3 prompts on 2 ranks with n=4 give exactly 12 rows, 4 per uid, in order."""
    batch = Batch({"prompt": torch.arange(prompts)}, {"uid": [f"u{i}" for i in range(prompts)]}).repeat_interleave(n)
    per_rank, pad = split_arguments(DP_COMPUTE, world, (batch,), {})
    merged = collect_results(DP_COMPUTE, [fake_generate(args[0]) for args, _ in per_rank], pad)
    assert len(merged) == prompts * n
    assert Counter(merged.non_tensors["uid"]) == {f"u{i}": n for i in range(prompts)}
    assert merged.tensors["responses"].tolist() == [10 * i for i in range(prompts) for _ in range(n)]


def test_the_ranks_metrics_are_averaged_and_peaks_maxed():
    per_rank = [
        {"actor/pg_loss": 1.0, "perf/max_memory_allocated_gb": 3.0, "perf/mfu/actor": 0.2},
        {"actor/pg_loss": 3.0, "perf/max_memory_allocated_gb": 5.0, "perf/mfu/actor": 0.4},
    ]
    assert reduce_rank_metrics(per_rank) == pytest.approx(
        {"actor/pg_loss": 2.0, "perf/max_memory_allocated_gb": 5.0, "perf/mfu/actor": 0.3}
    )
    _, pad = split_arguments(DP_COMPUTE, 2, (Batch({"x": torch.arange(3)}),), {})
    assert collect_results(DP_COMPUTE, per_rank, pad) == reduce_rank_metrics(per_rank)


def test_one_to_all_and_rank_zero():
    per_rank, _ = split_arguments(ONE_TO_ALL, 3, (1,), {})
    assert per_rank == [((1,), {})] * 3
    assert len(split_arguments(RANK_ZERO, 3, (1,), {})[0]) == 1
    assert collect_results(ONE_TO_ALL, ["a", "b", "c"], 0) == "a"
