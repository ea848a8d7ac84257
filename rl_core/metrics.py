"""Per-step data metrics with verl's names (``critic/score/mean``, ``response_length/mean``, ...)."""

from __future__ import annotations

import math

import torch

from rl_core.agent.executor import ERROR_KINDS, REFUSED_KINDS
from rl_core.agent.runner import FINISH_REASONS
from rl_core.batch import Batch
from rl_core.batch_fields import (
    ADVANTAGES,
    ATTENTION_MASK,
    MULTI_TURN,
    NUM_TURNS,
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
    # verl's lengths count every real token of the response (a multi-turn response's tool answers too); the policy's
    # own tokens are response_length/model_tokens
    width = batch.tensors[RESPONSE_MASK].shape[-1]
    attention = batch.tensors[ATTENTION_MASK]
    lengths = attention[:, -width:].sum(-1).float()
    metrics |= _stats("response_length", lengths)
    metrics["response_length/clip_ratio"] = (lengths >= width).float().mean().item()
    metrics["response_length/model_tokens/mean"] = batch.tensors[RESPONSE_MASK].sum(-1).float().mean().item()
    metrics |= _stats("prompt_length", attention[:, :-width].sum(-1))
    if NUM_TURNS in batch.non_tensors:
        metrics |= multi_turn_metrics(list(batch.non_tensors[NUM_TURNS]), list(batch.non_tensors[MULTI_TURN]))
    return metrics


def multi_turn_metrics(num_turns: list[int], trajectories: list[dict]) -> dict[str, float]:
    """verl's ``num_turns/{mean,max,min}`` and the tools' figures of multi-turn rollouts (rl_core.agent.runner):
    ``tool/call_rate`` (share of samples that called a tool), ``tool/calls_per_sample``, ``tool/success_rate``,
    ``tool/errors/<kind>`` (calls per sample answered with that error), ``tool/latency_s/{mean,max}``,
    ``tool/response_truncated_ratio``, ``multi_turn/finish/<reason>`` (share of samples) and ``timing_s/tools``: the
    seconds generation waited for tool answers (or agents' requests) that had not arrived when it could have gone on
    (the time the tools were not overlapped; each such wait shared among the trajectories it waited for), summed over
    the batch's trajectories (so over ranks too); ``multi_turn/batch_size/mean``: how many turns the generate call
    that sampled a turn sampled at once, over every turn (rounds batch whole rounds; continuous batching, smaller and
    more calls). With endpoint agents (rl_core/agent/endpoint.py)
    ``endpoint/calls_per_sample`` and ``endpoint/untrained_calls_per_sample``; their tool messages count as calls."""
    metrics = _stats("num_turns", torch.tensor(num_turns, dtype=torch.float32))
    calls = [call for trajectory in trajectories for call in trajectory["tool_calls"]]
    samples = len(trajectories)
    metrics["tool/call_rate"] = sum(bool(t["tool_calls"]) for t in trajectories) / samples
    metrics["tool/calls_per_sample"] = len(calls) / samples
    metrics["timing_s/tools"] = sum(t["tool_wait_s"] for t in trajectories)
    sizes = [size for trajectory in trajectories for size in trajectory["batch_sizes"]]
    if sizes:
        metrics["multi_turn/batch_size/mean"] = sum(sizes) / len(sizes)
    for kind in ERROR_KINDS:
        metrics[f"tool/errors/{kind}"] = sum(call["error"] == kind for call in calls) / samples
    for reason in FINISH_REASONS:
        metrics[f"multi_turn/finish/{reason}"] = sum(t["finish_reason"] == reason for t in trajectories) / samples
    if any("endpoint_calls" in t for t in trajectories):
        metrics["endpoint/calls_per_sample"] = sum(t.get("endpoint_calls", 0) for t in trajectories) / samples
        untrained = sum(t.get("untrained_calls", 0) for t in trajectories)
        metrics["endpoint/untrained_calls_per_sample"] = untrained / samples
    if calls:
        metrics["tool/success_rate"] = sum(call["error"] is None for call in calls) / len(calls)
        metrics["tool/response_truncated_ratio"] = sum(call["truncated"] for call in calls) / len(calls)
        ran = [call["latency_s"] for call in calls if call["error"] not in REFUSED_KINDS]
        if ran:
            metrics["tool/latency_s/mean"], metrics["tool/latency_s/max"] = sum(ran) / len(ran), max(ran)
    return metrics


def rollout_probs_diff_sums(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`rollout_probs_diff_from_sums` needs of some response tokens, as sums that add over micro-batches
    and ranks: (float64 ``[n, sum d, sum d^2, sum x, sum y, sum x^2, sum y^2, sum xy]``, the largest ``d``) over the
    tokens of ``response_mask``, with ``x`` = p_old and ``y`` = p_rollout of each sampled token, ``d = |x - y|``."""
    mask = response_mask.bool()
    x, y = old_log_probs.double().exp()[mask], rollout_log_probs.double().exp()[mask]
    d = (x - y).abs()
    n = d.new_tensor(float(d.numel()))
    sums = torch.stack([n, d.sum(), (d * d).sum(), x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum()])
    return sums, d.max() if d.numel() else d.new_tensor(0.0)


def rollout_probs_diff_from_sums(sums: torch.Tensor, max_diff: float) -> dict[str, float]:
    """verl's check that the samples come from the policy that is trained, from :func:`rollout_probs_diff_sums`:
    ``training/rollout_probs_diff_{max,mean,std}`` of ``d`` (std unbiased), the Pearson correlation of p_old and
    p_rollout, and ``..._valid`` (0, the others NaN, when there is no response token)."""
    n, sum_d, sum_dd, sum_x, sum_y, sum_xx, sum_yy, sum_xy = sums.double().unbind()
    if n == 0:
        nan = float("nan")
        return {
            "training/rollout_probs_diff_valid": 0.0,
            "training/rollout_probs_diff_max": nan,
            "training/rollout_probs_diff_mean": nan,
            "training/rollout_probs_diff_std": nan,
            "training/rollout_actor_probs_pearson_corr": nan,
        }
    mean = sum_d / n
    variance = (sum_dd - n * mean * mean) / (n - 1) if n > 1 else torch.zeros((), dtype=torch.float64)
    covariance = n * sum_xy - sum_x * sum_y
    spread = torch.sqrt((n * sum_xx - sum_x * sum_x).clamp(min=0) * (n * sum_yy - sum_y * sum_y).clamp(min=0))
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": float(max_diff),
        "training/rollout_probs_diff_mean": mean.item(),
        "training/rollout_probs_diff_std": variance.clamp(min=0).sqrt().item(),
        "training/rollout_actor_probs_pearson_corr": (covariance / spread).item() if n > 1 else float("nan"),
    }


def rollout_probs_diff_metrics(
    rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """:func:`rollout_probs_diff_from_sums` of one batch's response tokens."""
    return rollout_probs_diff_from_sums(*rollout_probs_diff_sums(rollout_log_probs, old_log_probs, response_mask))


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
