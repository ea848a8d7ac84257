"""pass@k, validation metrics, DAPO's group filter and the balanced batch order, on hand-made inputs."""

import itertools
import math

import numpy as np
import pytest
import torch

from rl_core.batch import Batch
from rl_core.metrics import (
    pass_at_k,
    rollout_probs_diff_from_sums,
    rollout_probs_diff_metrics,
    rollout_probs_diff_sums,
    validation_metrics,
)
from rl_core.ppo_step import balanced_order, informative_groups


@pytest.mark.parametrize("n,c,k", [(4, 1, 1), (4, 1, 2), (5, 2, 3), (6, 0, 2), (6, 6, 4), (8, 3, 8)])
def test_pass_at_k_is_the_chance_that_a_random_k_subset_holds_a_correct_sample(n, c, k):
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute_force = sum(any(samples[i] for i in subset) for subset in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(brute_force)


def test_validation_metrics_per_data_source():
    sources = ["a"] * 4 + ["b"] * 4
    uids = ["p1", "p1", "p2", "p2", "q1", "q1", "q2", "q2"]
    scores = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    metrics = validation_metrics(sources, uids, scores, n=2)
    assert metrics["val-core/a/acc/mean@2"] == 0.25 and metrics["val-core/b/acc/mean@2"] == 0.75
    assert metrics["val-core/a/acc/pass@2"] == 0.5 and metrics["val-core/b/acc/pass@2"] == 1.0
    assert metrics["val-aux/a/acc/pass@1"] == pytest.approx(0.25)
    assert validation_metrics(["a"], ["p"], [1.0], n=1) == {"val-core/a/acc/mean@1": 1.0}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rollout_probs_diff_from_sums_over_parts_is_the_whole_batchs(seed):
    """The sums add over micro-batches (and ranks): the metrics of the parts' sums are those of the whole batch,
    written out directly (each token's |p_old - p_rollout|, their unbiased std, numpy's Pearson correlation)."""
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 5, generator=generator) * 3
    rollout = (old + 0.4 * torch.randn(6, 5, generator=generator)).clamp(max=0.0)
    mask = (torch.rand(6, 5, generator=generator) > 0.3).float()
    x = [math.exp(o) for o, m in zip(old.flatten().tolist(), mask.flatten().tolist()) if m]
    y = [math.exp(r) for r, m in zip(rollout.flatten().tolist(), mask.flatten().tolist()) if m]
    d = [abs(a - b) for a, b in zip(x, y)]
    mean = sum(d) / len(d)
    parts = [rollout_probs_diff_sums(rollout[rows], old[rows], mask[rows]) for rows in (slice(0, 2), slice(2, 6))]
    metrics = rollout_probs_diff_from_sums(sum(p[0] for p in parts), max(float(p[1]) for p in parts))
    assert metrics == pytest.approx(rollout_probs_diff_metrics(rollout, old, mask), rel=1e-9)
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(max(d), rel=1e-6)
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(mean, rel=1e-6)
    assert metrics["training/rollout_probs_diff_std"] == pytest.approx(
        math.sqrt(sum((v - mean) ** 2 for v in d) / (len(d) - 1)), rel=1e-6
    )
    assert metrics["training/rollout_actor_probs_pearson_corr"] == pytest.approx(
        float(np.corrcoef(x, y)[0, 1]), rel=1e-6
    )
    nothing = rollout_probs_diff_metrics(rollout, old, torch.zeros_like(mask))
    assert nothing["training/rollout_probs_diff_valid"] == 0.0
    assert math.isnan(nothing["training/rollout_probs_diff_max"])


def test_informative_groups_drop_groups_with_one_score():
    scores = torch.zeros(6, 3)
    scores[0, 1], scores[4, 2] = 1.0, 1.0  # group u0 (rows 0,1) mixed; u1 (2,3) all 0; u2 (4,5) mixed
    batch = Batch({"token_level_scores": scores}, {"uid": ["u0", "u0", "u1", "u1", "u2", "u2"]})
    assert informative_groups(batch, "seq_reward") == [0, 1, 4, 5]
    assert informative_groups(batch, "seq_final_reward") == [0, 1, 4, 5]


def test_informative_groups_by_a_value_the_scorer_reported():
    scores = torch.zeros(4, 2)  # all scores equal: only the scorer's own 'acc' tells the samples apart
    batch = Batch({"token_level_scores": scores}, {"uid": ["u0", "u0", "u1", "u1"], "acc": [True, False, True, True]})
    assert informative_groups(batch, "acc") == [0, 1]
    with pytest.raises(KeyError, match="reported no per-sample 'pred'"):
        informative_groups(batch, "pred")


def test_balanced_order_gives_equal_sized_shards_with_similar_token_counts():
    lengths = [100, 90, 10, 5, 50, 45, 20, 30]
    order = balanced_order(lengths, 2)
    assert sorted(order) == list(range(8))
    shards = [order[:4], order[4:]]
    totals = [sum(lengths[r] for r in shard) for shard in shards]
    assert abs(totals[0] - totals[1]) <= 20 and math.isclose(sum(totals), sum(lengths))
