"""Policy losses: (old_log_prob, log_prob, advantages, response_mask) -> (loss, metrics).

Each loss is a pure function registered by name with :func:`register_policy_loss`
(``actor_rollout_ref.actor.policy_loss.loss_mode=<name>``), with verl's signature
``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None)``
and verl's return value ``(loss, {"actor/pg_clipfrac": ..., "actor/ppo_kl": ..., ...})``.
All tensors are (batch, response_length); r = exp(log_prob - old_log_prob) is the importance ratio.

``config`` is the actor config (any object with attribute access): ``clip_ratio``, ``clip_ratio_low``,
``clip_ratio_high``, ``clip_ratio_c``, ``tau_pos``/``tau_neg`` (SAPO), ``policy_loss.*`` (clip_cov / kl_cov),
and optionally ``global_batch_info`` (dp_size, batch_num_tokens, global_batch_size) for :func:`agg_loss`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rl_core.algos.aggregate import agg_loss
from rl_core.algos.masked import masked_mean
from rl_core.config_access import config_get

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss under ``name``."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES and POLICY_LOSSES[name] is not fn:
            raise ValueError(f"policy loss {name!r} is already registered ({POLICY_LOSSES[name].__qualname__})")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    if name not in POLICY_LOSSES:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={name!r} is not registered; choose one of "
            f"{sorted(POLICY_LOSSES)} or register yours with @register_policy_loss"
        )
    return POLICY_LOSSES[name]


# ---------------------------------------------------------------------------------------------- shared pieces
def clip_ratios(config: Any) -> tuple[float, float]:
    """(epsilon_low, epsilon_high): ``clip_ratio_low/high`` falling back to ``clip_ratio`` (default 0.2)."""
    clip_ratio = config_get(config, "clip_ratio", 0.2)
    return config_get(config, "clip_ratio_low", clip_ratio), config_get(config, "clip_ratio_high", clip_ratio)


def _aggregate(loss_mat: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, config: Any) -> torch.Tensor:
    return agg_loss(loss_mat, response_mask, loss_agg_mode, **dict(config_get(config, "global_batch_info", {})))


def _weighted(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


def _scalar(value: torch.Tensor | float) -> float:
    return value.detach().item() if isinstance(value, torch.Tensor) else float(value)


def _metrics(
    pg_clipfrac: torch.Tensor | float, ppo_kl: torch.Tensor, pg_clipfrac_lower: torch.Tensor | float = 0.0
) -> dict[str, float]:
    return {
        "actor/pg_clipfrac": _scalar(pg_clipfrac),
        "actor/ppo_kl": _scalar(ppo_kl),
        "actor/pg_clipfrac_lower": _scalar(pg_clipfrac_lower),
    }


# ---------------------------------------------------------------------------------------------- losses
@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clip: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)); for A < 0 also capped at -A c (dual-clip, c =
    clip_ratio_c).

    log r is clamped to [-20, 20]. pg_clipfrac: share of tokens where the clipped term wins; pg_clipfrac_lower:
    share where the dual-clip cap applies; ppo_kl = mean(old_log_prob - log_prob).
    """
    clip_low, clip_high = clip_ratios(config)
    clip_ratio_c = config_get(config, "clip_ratio_c", 3.0)
    if clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c={clip_ratio_c}: the dual-clip bound must be greater than 1.0")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped_max = torch.maximum(unclipped, clipped)
    pg_clipfrac = masked_mean(torch.gt(clipped, unclipped).float(), response_mask)
    dual_cap = -advantages * clip_ratio_c
    pg_clipfrac_lower = masked_mean((torch.gt(clipped_max, dual_cap) & (advantages < 0)).float(), response_mask)
    pg_losses = torch.where(advantages < 0, torch.minimum(dual_cap, clipped_max), clipped_max)
    pg_loss = _aggregate(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (arXiv:2507.18071): PPO clip with the sequence ratio s_i = exp(mean_t log r_{i,t}) per token.

    Token form: log s_{i,t} = sg(mean_t log r_{i,t}) + log_prob_t - sg(log_prob_t), clamped at 10, so the
    value is the sequence ratio and the gradient flows per token. Always aggregated with seq-mean-token-mean, the
    paper's objective, whatever ``loss_agg_mode`` says (verl 0.9.1 applies ``loss_agg_mode``, default token-mean,
    which weighs long responses more; SAPO below forces the sequence mean in both).
    """
    clip_low, clip_high = clip_ratios(config)
    log_ratio = log_prob - old_log_prob
    seq_lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = (log_ratio * response_mask).sum(dim=-1) / seq_lengths
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))
    unclipped = -advantages * seq_ratio
    clipped = -advantages * torch.clamp(seq_ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(unclipped, clipped)
    pg_loss = _aggregate(_weighted(pg_losses, rollout_is_weights), response_mask, "seq-mean-token-mean", config)
    pg_clipfrac = masked_mean(torch.gt(clipped, unclipped).float(), response_mask)
    return pg_loss, _metrics(pg_clipfrac, masked_mean(-log_ratio, response_mask))


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO (arXiv:2511.20347): loss = -g(r) A with the soft gate g(r) = sigmoid(tau (r - 1)) 4 / tau.

    tau = ``tau_pos`` where A > 0 else ``tau_neg`` (defaults 1.0 and 1.05). Like verl, it always aggregates
    with seq-mean-token-mean (the paper's choice), whatever ``loss_agg_mode`` says.
    """
    tau_pos = torch.as_tensor(config_get(config, "tau_pos", 1.0), dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(config_get(config, "tau_neg", 1.05), dtype=advantages.dtype, device=advantages.device)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = -gates * advantages
    pg_loss = _aggregate(_weighted(pg_losses, rollout_is_weights), response_mask, "seq-mean-token-mean", config)
    return pg_loss, _metrics(0.0, masked_mean(-log_ratio, response_mask))


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG (arXiv:2504.02546): plain policy gradient, loss = -log_prob A (no ratio, no clipping, no metrics)."""
    pg_losses = -log_prob * advantages
    return _aggregate(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config), {}


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (arXiv:2505.22617): PPO clip, and the gradient of a random ``clip_cov_ratio`` share of the tokens
    whose covariance cov = (A - mean A)(log_prob - mean log_prob) lies in (clip_cov_lb, clip_cov_ub) is cut.

    Tokens already clipped by PPO are not candidates. Draws from torch's global RNG (seed it for repeatability).
    pg_clipfrac is the share of cut tokens.
    """
    policy_loss_config = config_get(config, "policy_loss")
    clip_cov_ratio = config_get(policy_loss_config, "clip_cov_ratio", 0.0002)
    clip_cov_ub = config_get(policy_loss_config, "clip_cov_ub", 5.0)
    clip_cov_lb = config_get(policy_loss_config, "clip_cov_lb", 1.0)
    if clip_cov_ratio <= 0:
        raise ValueError(f"policy_loss.clip_cov_ratio={clip_cov_ratio} must be > 0")
    clip_low, clip_high = clip_ratios(config)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped_by_ppo = (clipped > unclipped) & (response_mask > 0)
    covariance = (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob.detach(), response_mask)
    )
    covariance = covariance.masked_fill((response_mask == 0) | clipped_by_ppo, -torch.inf)
    num_to_cut = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    candidates = torch.nonzero((covariance < clip_cov_ub) & (covariance > clip_cov_lb) & (response_mask > 0))
    chosen = candidates[torch.randperm(len(candidates))[:num_to_cut]] if len(candidates) else candidates
    keep = torch.ones_like(advantages)
    keep[chosen[:, 0], chosen[:, 1]] = 0
    pg_clipfrac = masked_mean((keep == 0).float(), response_mask)
    pg_losses = torch.maximum(unclipped, clipped) * keep
    pg_loss = _aggregate(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    return pg_loss, {"actor/pg_clipfrac": _scalar(pg_clipfrac), "actor/ppo_kl": _scalar(ppo_kl)}


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (arXiv:2505.22617): loss = -A r, plus ``ppo_kl_coef`` |log r| on the top ``kl_cov_ratio`` share of
    valid tokens by covariance (A - mean A)(log_prob - mean log_prob). ppo_kl reports mean |log r|."""
    policy_loss_config = config_get(config, "policy_loss")
    kl_cov_ratio = config_get(policy_loss_config, "kl_cov_ratio", 0.0002)
    ppo_kl_coef = config_get(policy_loss_config, "ppo_kl_coef", 0.1)  # verl ActorConfig default
    if kl_cov_ratio <= 0:
        raise ValueError(f"policy_loss.kl_cov_ratio={kl_cov_ratio} must be > 0")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    valid = response_mask > 0
    if valid.any():
        valid_adv = advantages[valid].detach()
        valid_logp = log_prob[valid].detach()
        covariance = (valid_adv - valid_adv.mean()) * (valid_logp - valid_logp.mean())
        num_penalised = max(1, int(covariance.numel() * kl_cov_ratio))
        top = torch.topk(covariance, num_penalised, largest=True).indices
        penalised = torch.zeros(covariance.numel(), dtype=torch.bool, device=covariance.device)
        penalised[top] = True
        penalty_mask = torch.zeros_like(valid)
        penalty_mask[valid] = penalised
        pg_losses = torch.where(penalty_mask, pg_losses + ppo_kl_coef * log_ratio.abs(), pg_losses)
    pg_loss = _aggregate(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    return pg_loss, {"actor/ppo_kl": _scalar(masked_mean(log_ratio.abs(), response_mask))}


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO (arXiv:2507.20673): per sequence, loss_i = -Abar_i exp(mean_t sgn(A) min(sgn(A) log r, sgn(A) clip(log r))).

    log r is clipped to [-eps_low, eps_high] in log space; Abar_i is the mean advantage over valid tokens; the
    loss is the mean over the (non-empty) sequences of the whole mini-batch, ``global_batch_size`` of them on all
    ranks (``loss_agg_mode`` does not apply, as in verl; verl's plain mean over a micro-batch grows with the number
    of micro-batches a mini-batch is cut into).
    """
    clip_low, clip_high = clip_ratios(config)
    log_ratio = log_prob - old_log_prob
    ppo_kl = masked_mean(-log_ratio, response_mask)
    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -clip_low, clip_high)
    log_ratio_min = sign * torch.min(sign * log_ratio, sign * log_ratio_clamped)
    lengths = response_mask.sum(dim=-1)
    seq_ratio = torch.exp((log_ratio_min * response_mask).sum(dim=-1) / (lengths + 1e-8))
    seq_advantage = (advantages * response_mask).sum(dim=-1) / (lengths + 1e-8)
    pg_losses = -seq_advantage * seq_ratio
    if rollout_is_weights is not None:
        pg_losses = pg_losses * torch.exp(
            (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / (lengths + 1e-8)
        )
    clipped = torch.ne(log_ratio, log_ratio_clamped)
    pg_clipfrac = masked_mean((clipped & (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = masked_mean((clipped & (advantages < 0)).float(), response_mask)
    non_empty = (lengths > 0).to(pg_losses.dtype)
    # one "token" per sequence
    pg_loss = _aggregate(pg_losses.unsqueeze(-1), non_empty.unsqueeze(-1), "seq-mean-token-sum", config)
    return pg_loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): loss = -sg(clip(r, 1-eps_low, 1+eps_high)) A log_prob.

    The clipped ratio is only a weight, so every token keeps its gradient. pg_clipfrac: share where r was clipped.
    """
    clip_low, clip_high = clip_ratios(config)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
    pg_loss = _aggregate(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    return pg_loss, _metrics(pg_clipfrac, masked_mean(-log_ratio, response_mask))


def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE with importance weights (rollout correction's bypass mode, ``loss_type=reinforce``; not a
    ``loss_mode``): loss = -A w log_prob, w the detached weights pi_theta / pi_rollout (1 without them), no clipping.
    actor/ppo_kl = mean(log pi_rollout - log pi_theta)."""
    pg_losses = -advantages * log_prob
    pg_loss = _aggregate(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    return pg_loss, {"actor/ppo_kl": _scalar(masked_mean(rollout_log_prob - log_prob, response_mask))}
