"""Per-step data metrics with verl's names (``critic/score/mean``, ``response_length/mean``, ...)."""

from __future__ import annotations

import math

import torch

from rl_core.batch import Batch
from rl_core.batch_fields import (
    ADVANTAGES,
    ATTENTION_MASK,
    RESPONSE_MASK,
    RETURNS,
    TOKEN_LEVEL_REWARDS,
    TOKEN_LEVEL_SCORES,
    VALUES,
)


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def compute_data_metrics(batch: Batch) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of a finished step's batch."""
    mask = batch.tensors[RESPONSE_MASK].bool()
    metrics: dict[str, float] = {}
    if TOKEN_LEVEL_SCORES in batch:
        metrics |= _stats("critic/score", batch.tensors[TOKEN_LEVEL_SCORES].sum(-1))
    if TOKEN_LEVEL_REWARDS in batch:
        metrics |= _stats("critic/rewards", batch.tensors[TOKEN_LEVEL_REWARDS].sum(-1))
    for key, name in ((ADVANTAGES, "critic/advantages"), (RETURNS, "critic/returns"), (VALUES, "critic/values")):
        if key in batch:
            metrics |= _stats(name, batch.tensors[key][mask])
    lengths = batch.tensors[RESPONSE_MASK].sum(-1).float()
    metrics |= _stats("response_length", lengths)
    metrics["response_length/clip_ratio"] = (lengths >= batch.tensors[RESPONSE_MASK].shape[-1]).float().mean().item()
    metrics |= _stats("prompt_length", batch.tensors[ATTENTION_MASK].sum(-1) - lengths)
    return metrics


def rollout_probs_diff_metrics(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """verl's check that the samples come from the policy that is trained: over response tokens, |p_rollout - p_old| of
    each sampled token (probabilities, from the sampler's log-probs and the recomputed old ones) as
    ``training/rollout_probs_diff_{max,mean,std}``, their Pearson correlation, and ``..._valid`` (0 when there is no
    response token)."""
    mask = response_mask.bool()
    if not mask.any():
        nan = float("nan")
        return {
            "training/rollout_probs_diff_valid": 0.0,
            "training/rollout_probs_diff_max": nan,
            "training/rollout_probs_diff_mean": nan,
            "training/rollout_probs_diff_std": nan,
            "training/rollout_actor_probs_pearson_corr": nan,
        }
    rollout_probs, old_probs = rollout_log_probs.float().exp()[mask], old_log_probs.float().exp()[mask]
    diff = (rollout_probs - old_probs).abs()
    correlation = (
        torch.corrcoef(torch.stack([old_probs, rollout_probs]))[0, 1]
        if diff.numel() > 1
        else torch.tensor(float("nan"))
    )
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": diff.max().item(),
        "training/rollout_probs_diff_mean": diff.mean().item(),
        "training/rollout_probs_diff_std": diff.std().item() if diff.numel() > 1 else 0.0,
        "training/rollout_actor_probs_pearson_corr": correlation.item(),
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def validation_metrics(data_sources: list[str], uids: list[str], scores: list[float], n: int) -> dict[str, float]:
    """Per data source: ``val-core/<ds>/acc/mean@n`` (mean score of all samples) and, when n > 1, the unbiased
    ``pass@k`` (a sample counts as correct when its score is > 0) for k = n (val-core) and powers of 2 < n (val-aux)."""
    metrics: dict[str, float] = {}
    for source in sorted(set(data_sources)):
        rows = [i for i, s in enumerate(data_sources) if s == source]
        metrics[f"val-core/{source}/acc/mean@{n}"] = sum(scores[i] for i in rows) / len(rows)
        if n > 1:
            correct: dict[str, list[bool]] = {}
            for i in rows:
                correct.setdefault(uids[i], []).append(scores[i] > 0)
            ks = sorted({k for k in (2**p for p in range(n.bit_length())) if k < n} | {n})
            for k in ks:
                value = sum(pass_at_k(len(c), sum(c), k) for c in correct.values()) / len(correct)
                metrics[f"{'val-core' if k == n else 'val-aux'}/{source}/acc/pass@{k}"] = value
    return metrics
