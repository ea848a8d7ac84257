"""Rollout correction (verl's ``algorithm.rollout_correction``): importance weights and rejection for samples that
another policy produced than the one being trained.

The sampler's policy pi_rollout (vLLM's numerics, or older weights in an asynchronous run) differs from the trained
one. With log_ratio = log pi_train - log pi_rollout per response token:

* **Importance sampling (IS)**, ``rollout_is``: ``token`` weights w_t = exp(log_ratio_t) (biased, low variance) or
  ``sequence`` weights w = exp(sum_t log_ratio_t) on every token of a response (unbiased, high variance), truncated
  at ``rollout_is_threshold`` (TIS: min(w, upper)) or, given as ``"lower_upper"``, zeroed outside [lower, upper]
  (IcePop). Optionally divided by their batch mean. The policy loss multiplies its per-token terms by them.
* **Rejection sampling (RS)**, ``rollout_rs``: comma-separated filters on a divergence between the two policies,
  each ``<level>_<estimator>``: per token (``token``) or per response (``seq_sum``, ``seq_mean``, ``seq_max``) of
  k1 = -log_ratio, k2 = log_ratio^2 / 2 or k3 = exp(log_ratio) - 1 - log_ratio. k1 filters keep
  log(lower) <= k1 <= log(upper) (``"lower_upper"``, or one ``upper`` meaning [1/upper, upper]); k2/k3 filters keep
  values <= ``upper``. Rejected tokens leave the response mask (every filter must pass).
* **Metrics**: verl's, under ``rollout_corr/``: the weights' statistics (mean, max, min, std, effective sample size,
  fractions beyond the bounds, per-response summaries), each filter's, and the divergence between the policies
  (KL, k3-KL, perplexities, chi^2 per token and per response).

Log-ratios are clamped to +-20 before exponentiating. Every function here is pure (tensors in, tensors and floats
out); ``rl_core.ppo_step`` applies them in the decoupled mode (pi_train = the recomputed old log-probs, before the
advantage) and the actor's update in the bypass mode (pi_train = the policy being trained, per micro-batch, with the
rollout's log-probs as the old ones).
"""

from __future__ import annotations

import math

import torch

from rl_core.algos.masked import masked_mean, masked_sum
from rl_core.correction_settings import RolloutCorrection

SAFETY_BOUND = 20.0
Metrics = dict[str, float]


# ---------------------------------------------------------------------------------------------- statistics helpers
def _masked_max(values: torch.Tensor, mask: torch.Tensor) -> float:
    return values.masked_fill(~mask.bool(), float("-inf")).max().item()


def _masked_min(values: torch.Tensor, mask: torch.Tensor) -> float:
    return values.masked_fill(~mask.bool(), float("inf")).min().item()


def _clamped_std(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> float:
    """sqrt(E[x^2] - E[x]^2) of the values clamped to [low, high] over the mask; 0 with fewer than 2 entries."""
    if mask.sum() <= 1:
        return 0.0
    clamped = values.clamp(min=low, max=high)
    variance = masked_mean(clamped.square(), mask) - masked_mean(clamped, mask).square()
    return torch.sqrt(variance.clamp(min=0.0)).item()


def _fraction(condition: torch.Tensor) -> float:
    return condition.float().mean().item()


# ---------------------------------------------------------------------------------------------- importance weights
def importance_weights(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, settings: RolloutCorrection
) -> tuple[torch.Tensor, Metrics]:
    """(B, R) detached IS weights (0 on padding) and their metrics, as the module docstring states."""
    upper, lower = settings.is_upper, settings.is_lower
    if settings.rollout_is == "token":
        log_weights = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        log_weights = masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        raw = torch.exp(log_weights.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * response_mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _weight_metrics(weights, raw, log_weights, response_mask, settings)
    weights = weights.detach()
    if settings.is_batch_normalize:
        if settings.rollout_is == "token":
            mean = masked_mean(weights, response_mask)
        else:
            has_tokens = (response_mask.sum(-1) > 0).to(weights.dtype)
            mean = (masked_mean(weights, response_mask, axis=-1) * has_tokens).sum() / has_tokens.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _weight_metrics(
    weights: torch.Tensor,
    raw: torch.Tensor,
    log_weights: torch.Tensor,
    mask: torch.Tensor,
    settings: RolloutCorrection,
) -> Metrics:
    upper = settings.is_upper
    lower = 1.0 / upper if settings.is_lower is None else settings.is_lower
    metrics: Metrics = {"rollout_is_mean": masked_mean(weights, mask).item()}
    if settings.rollout_is == "sequence":  # from the log-weights: the raw product can overflow
        metrics["rollout_is_max"] = math.exp(min(log_weights.max().item(), SAFETY_BOUND))
        metrics["rollout_is_min"] = math.exp(log_weights.min().item())
        metrics["rollout_is_ratio_fraction_high"] = _fraction(log_weights > math.log(upper))
        metrics["rollout_is_ratio_fraction_low"] = _fraction(log_weights < math.log(lower))
    else:
        metrics["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), mask).item()
        metrics["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).float(), mask).item()
        metrics["rollout_is_max"] = _masked_max(weights, mask)
        metrics["rollout_is_min"] = _masked_min(weights, mask)
    metrics["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)
    bounded = weights.clamp(min=0.0, max=upper)
    normalised = bounded / (masked_mean(bounded, mask) + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalised.square(), mask).item()
    per_response = masked_mean(weights, mask, axis=-1)
    raw_per_response = masked_mean(raw, mask, axis=-1)
    metrics |= {
        "rollout_is_seq_mean": per_response.mean().item(),
        "rollout_is_seq_std": per_response.std().item() if per_response.numel() > 1 else 0.0,
        "rollout_is_seq_max": per_response.max().item(),
        "rollout_is_seq_min": per_response.min().item(),
        "rollout_is_seq_max_deviation": (per_response - 1.0).abs().max().item(),
        "rollout_is_seq_fraction_high": _fraction(raw_per_response > upper),
        "rollout_is_seq_fraction_low": _fraction(raw_per_response < lower),
    }
    if settings.is_lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), mask).item()
    return metrics


# ---------------------------------------------------------------------------------------------- rejection
def _divergence(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if estimator == "k1":
        return -safe
    if estimator == "k2":
        return 0.5 * safe.square()
    return torch.exp(safe) - 1.0 - safe


def _per_response(values: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    if level == "seq_sum":
        return masked_sum(values, mask, axis=-1)
    if level == "seq_mean":
        return masked_mean(values, mask, axis=-1)
    peak = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(peak == float("-inf"), torch.zeros_like(peak), peak)


def rejection_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, settings: RolloutCorrection
) -> tuple[torch.Tensor, Metrics]:
    """The response mask without the tokens (or whole responses) that a filter rejects, and each filter's
    metrics (``rollout_rs_<option>_*``) and the overall rejected fractions."""
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    valid = response_mask.bool()
    has_tokens = response_mask.sum(dim=-1) > 0
    keep = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics: Metrics = {}
    for option, lower, upper in settings.rejections:
        level, estimator = option.rsplit("_", 1)
        per_token = _divergence(log_ratio, estimator)
        per_response = None if level == "token" else _per_response(per_token, response_mask, level)
        statistic = per_token if per_response is None else per_response
        if estimator == "k1":
            low, high = math.log(lower), math.log(upper)
            passes = (statistic >= low) & (statistic <= high)
        else:
            low, high = 0.0, upper
            passes = statistic <= high
        if per_response is not None:
            passes = passes.unsqueeze(-1).expand_as(valid)
            per_token = per_response.unsqueeze(-1).expand_as(response_mask)
        metrics |= _filter_metrics(option, per_token, per_response, response_mask, has_tokens, low, high)
        kept = passes.to(log_ratio.dtype)
        keep = keep * kept
        response_kept = (~(~passes & valid)).all(dim=-1)
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1 - kept, response_mask).item()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            (((~response_kept) & has_tokens).float().sum() / has_tokens.float().sum()).item()
            if has_tokens.any()
            else 0.0
        )
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - keep, response_mask).item()
    metrics["rollout_rs_seq_masked_fraction"] = _fraction((~((keep > 0.5) & valid) & valid).any(dim=-1))
    return (response_mask * keep).to(response_mask.dtype), metrics


def _filter_metrics(
    option: str,
    per_token: torch.Tensor,
    per_response: torch.Tensor | None,
    mask: torch.Tensor,
    has_tokens: torch.Tensor,
    low: float,
    high: float,
) -> Metrics:
    """One filter's statistics: over tokens for a token filter, over responses for a response filter (whose
    per-token view is its response's value on every token)."""
    if not mask.any():
        raise ValueError("rollout correction needs at least one response token")
    prefix, two_sided = f"rollout_rs_{option}", option.endswith("k1")
    responses = (per_response if per_response is not None else masked_mean(per_token, mask, axis=-1))[has_tokens]
    by_response = per_response is not None and responses.numel() > 0
    metrics: Metrics = {f"{prefix}_mean": masked_mean(per_token, mask).item()}
    if by_response:
        metrics[f"{prefix}_max"], metrics[f"{prefix}_min"] = responses.max().item(), responses.min().item()
        metrics[f"{prefix}_fraction_high"] = _fraction(responses > high)
        metrics[f"{prefix}_fraction_low"] = _fraction(responses < low) if two_sided else 0.0
    else:
        metrics[f"{prefix}_max"], metrics[f"{prefix}_min"] = _masked_max(per_token, mask), _masked_min(per_token, mask)
        metrics[f"{prefix}_fraction_high"] = masked_mean((per_token > high).float(), mask).item()
        metrics[f"{prefix}_fraction_low"] = masked_mean((per_token < low).float(), mask).item() if two_sided else 0.0
    metrics[f"{prefix}_std"] = _clamped_std(per_token, mask, low, high)
    if responses.numel() == 0:
        return metrics | {
            f"{prefix}_seq_{name}": 0.0
            for name in ("mean", "std", "max", "min", "max_deviation", "fraction_high", "fraction_low")
        }
    metrics |= {
        f"{prefix}_seq_mean": responses.mean().item(),
        f"{prefix}_seq_std": responses.std().item() if responses.numel() > 1 else 0.0,
        f"{prefix}_seq_max": responses.max().item(),
        f"{prefix}_seq_min": responses.min().item(),
        f"{prefix}_seq_max_deviation": responses.abs().max().item(),
        f"{prefix}_seq_fraction_high": _fraction(responses > high),
    }
    if two_sided:
        metrics[f"{prefix}_seq_fraction_low"] = _fraction(responses < low)
    return metrics


# ---------------------------------------------------------------------------------------------- divergence metrics
def policy_divergence_metrics(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> Metrics:
    """How far the trained policy is from the sampler: KL(pi_rollout || pi_train) = E[log pi_rollout - log pi_train]
    and its k3 estimate E[r - 1 - log r] (r = pi_train / pi_rollout), the mean per-response perplexities of both and
    their log-difference, and chi^2 = E[r^2] - 1 per token and E[(prod_t r_t)^2] - 1 per response."""
    train_mean = masked_mean(log_prob, response_mask, axis=-1)
    rollout_mean = masked_mean(rollout_log_prob, response_mask, axis=-1)
    log_ratio = log_prob - rollout_log_prob
    log_ppl_diff = rollout_mean - train_mean
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_response = masked_sum(log_ratio, response_mask, axis=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": torch.exp(-train_mean).mean().item(),
        "training_log_ppl": (-train_mean).mean().item(),
        "kl": masked_mean(rollout_log_prob - log_prob, response_mask).item(),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item(),
        "rollout_ppl": torch.exp(-rollout_mean).mean().item(),
        "rollout_log_ppl": (-rollout_mean).mean().item(),
        "log_ppl_diff": log_ppl_diff.mean().item(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean().item(),
        "log_ppl_diff_max": log_ppl_diff.max().item(),
        "log_ppl_diff_min": log_ppl_diff.min().item(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean().item(),
        "chi2_token": (masked_mean(torch.exp(safe).square(), response_mask) - 1.0).item(),
        "chi2_seq": (torch.exp(2.0 * per_response).mean() - 1.0).item(),
    }


# ---------------------------------------------------------------------------------------------- all together
def rollout_correction(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, settings: RolloutCorrection
) -> tuple[torch.Tensor | None, torch.Tensor, Metrics]:
    """(IS weights or None, the response mask after rejection, every metric under ``rollout_corr/``) for the
    trained policy's ``log_prob`` against the sampler's ``rollout_log_prob``, all (B, R)."""
    if not response_mask.any():
        raise ValueError("rollout correction needs at least one response token")
    if log_prob.shape != rollout_log_prob.shape or log_prob.shape != response_mask.shape:
        raise ValueError(
            f"rollout correction: log_prob {tuple(log_prob.shape)}, rollout_log_prob "
            f"{tuple(rollout_log_prob.shape)} and response_mask {tuple(response_mask.shape)} must have one shape"
        )
    with torch.no_grad():
        log_ratio = log_prob - rollout_log_prob
        metrics: Metrics = {}
        weights = None
        if settings.rollout_is is not None:
            weights, is_metrics = importance_weights(log_ratio, response_mask, settings)
            metrics |= is_metrics
        mask = response_mask.clone()
        if settings.rejections:
            mask, rs_metrics = rejection_mask(log_ratio, response_mask, settings)
            metrics |= rs_metrics
        metrics |= policy_divergence_metrics(log_prob, rollout_log_prob, response_mask)
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
