"""Per-step data metrics with verl's names (``critic/score/mean``, ``response_length/mean``, ...)."""

from __future__ import annotations

import torch

from rl_core.batch import Batch


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(), f"{prefix}/min": values.min().item()}


def compute_data_metrics(batch: Batch) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of a finished step's batch."""
    mask = batch.tensors["response_mask"].bool()
    metrics: dict[str, float] = {}
    if "token_level_scores" in batch:
        metrics |= _stats("critic/score", batch.tensors["token_level_scores"].sum(-1))
    if "token_level_rewards" in batch:
        metrics |= _stats("critic/rewards", batch.tensors["token_level_rewards"].sum(-1))
    for key, name in (("advantages", "critic/advantages"), ("returns", "critic/returns"), ("values", "critic/values")):
        if key in batch:
            metrics |= _stats(name, batch.tensors[key][mask])
    lengths = batch.tensors["response_mask"].sum(-1).float()
    metrics |= _stats("response_length", lengths)
    metrics["response_length/clip_ratio"] = (lengths >= batch.tensors["response_mask"].shape[-1]).float().mean().item()
    metrics |= _stats("prompt_length", batch.tensors["attention_mask"].sum(-1) - lengths)
    return metrics
