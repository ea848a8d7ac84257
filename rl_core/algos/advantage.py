"""Advantage estimators: token-level rewards (+ values, group ids, baselines) -> (advantages, returns).

Each estimator is a pure function registered by name with :func:`register_adv_est`, taking verl's keyword
arguments (``token_level_rewards``, ``response_mask``, ``index``, ``values``, ``gamma``, ``lam``,
``reward_baselines``, ``epsilon``, ``norm_adv_by_std_in_grpo``, ``config``) and returning verl's tuple
``(advantages, returns)``, both shaped (batch, response_length). Outcome estimators return zeros outside
``response_mask``; GAE's values there are meaningless (as in verl) and every consumer masks them.
``index`` holds one group id per sample (the prompt's uid: the n responses to one prompt form a group).

Outcome estimators use the sequence score s_i = sum_t token_level_rewards[i, t]. Group statistics are
computed for all groups at once (scatter/bincount) rather than verl's per-sample Python loop; the numbers are
the same (tests compare against a plain loop).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from rl_core.algos.masked import masked_whiten
from rl_core.batch import response_turns
from rl_core.config_access import config_get

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_adv_est(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register an advantage estimator under ``name`` (``algorithm.adv_estimator=<name>`` selects it)."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS[name] is not fn:
            raise ValueError(
                f"advantage estimator {name!r} is already registered ({ADVANTAGE_ESTIMATORS[name].__qualname__})"
            )
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name: str) -> AdvantageFn:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"algorithm.adv_estimator={name!r} is not registered; choose one of {sorted(ADVANTAGE_ESTIMATORS)} or "
            "register yours with @register_adv_est"
        )
    return ADVANTAGE_ESTIMATORS[name]


# ---------------------------------------------------------------------------------------------- group statistics
class GroupStats(NamedTuple):
    """Per-sample view of its group's statistics (each tensor has one entry per sample)."""

    group: torch.Tensor  # group number of each sample, 0..num_groups-1
    num_groups: int
    count: torch.Tensor  # size of the sample's group
    mean: torch.Tensor  # mean score of the group
    std: torch.Tensor  # unbiased std of the group's scores (0 for a single sample)


def group_numbers(index: Any, device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group ids (uid strings, ints) to 0..G-1 in order of first appearance."""
    keys = index.tolist() if isinstance(index, (np.ndarray, torch.Tensor)) else list(index)
    numbers: dict[Any, int] = {}
    group = [numbers.setdefault(key, len(numbers)) for key in keys]
    return torch.tensor(group, dtype=torch.long, device=device), len(numbers)


def group_stats(scores: torch.Tensor, index: Any) -> GroupStats:
    """Mean, unbiased std and size of each sample's group of ``scores``."""
    group, num_groups = group_numbers(index, scores.device)
    if group.numel() != scores.numel():
        raise ValueError(f"index has {group.numel()} group ids for {scores.numel()} samples")
    count = torch.bincount(group, minlength=num_groups).to(scores.dtype)
    mean = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, group, scores) / count
    squares = torch.zeros_like(mean).index_add_(0, group, (scores - mean[group]) ** 2)
    std = torch.sqrt(squares / (count - 1).clamp(min=1))
    return GroupStats(group, num_groups, count[group], mean[group], std[group])


# ---------------------------------------------------------------------------------------------- estimators
@register_adv_est("gae")
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float | None = None,
    lam: float | None = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}; returns = A + V; A whitened.

    Masked positions are skipped: the recursion carries V and A across them unchanged (verl/TRL semantics).
    ``gamma``/``lam`` default to ``config.gamma``/``config.lam`` (1.0 when absent).
    """
    gamma = config_get(config, "gamma", 1.0) if gamma is None else gamma
    lam = config_get(config, "lam", 1.0) if lam is None else lam
    with torch.no_grad():
        response_mask = response_mask.to(values.dtype)
        next_value = torch.zeros_like(values[:, 0])
        next_advantage = torch.zeros_like(values[:, 0])
        advantages = torch.zeros_like(values)
        for t in reversed(range(token_level_rewards.shape[-1])):
            mask_t = response_mask[:, t]
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            advantage_t = delta + gamma * lam * next_advantage
            next_value = values[:, t] * mask_t + (1 - mask_t) * next_value
            next_advantage = advantage_t * mask_t + (1 - mask_t) * next_advantage
            advantages[:, t] = next_advantage
        returns = advantages + values
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@register_adv_est("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: A_i = (s_i - mean_g) / (std_g + epsilon); without ``norm_adv_by_std_in_grpo``, A_i = s_i - mean_g
    (Dr.GRPO).

    A single-sample group uses mean 0 and std 1 (verl's convention). A_i is broadcast over the response.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        stats = group_stats(scores, index)
        single = stats.count == 1
        mean = torch.where(single, torch.zeros_like(stats.mean), stats.mean)
        std = torch.where(single, torch.ones_like(stats.std), stats.std)
        advantage = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
        advantages = advantage.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("grpo_passk")
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k (arXiv:2503.19595): only the best response of a group gets A = s_max - s_second_max (/ (std_g + eps)).

    Groups need at least two samples. ``config.norm_adv_by_std_in_grpo``, when set, wins over the keyword (verl
    reads it from the config only).
    """
    norm_adv_by_std_in_grpo = config_get(config, "norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        stats = group_stats(scores, index)
        if bool((stats.count < 2).any()):
            bad = stats.group[stats.count < 2][0].item()
            raise ValueError(
                f"grpo_passk needs at least 2 samples per group; group #{bad} has 1 (set actor_rollout_ref.rollout.n "
                ">= 2)"
            )
        num_samples, num_groups = scores.shape[0], stats.num_groups
        lowest = torch.full((num_groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
        group_max = lowest.scatter_reduce(0, stats.group, scores, reduce="amax")
        positions = torch.arange(num_samples, device=scores.device)
        is_max = scores == group_max[stats.group]
        best = torch.full((num_groups,), num_samples, device=scores.device).scatter_reduce(
            0, stats.group, torch.where(is_max, positions, num_samples), reduce="amin"
        )
        others = scores.clone()
        others[best] = -torch.inf
        second_max = lowest.scatter_reduce(0, stats.group, others, reduce="amax")
        group_advantage = group_max - second_max
        if norm_adv_by_std_in_grpo:
            group_std = torch.zeros_like(group_max).scatter_(0, stats.group, stats.std)
            group_advantage = group_advantage / (group_std + epsilon)
        advantage = torch.zeros_like(scores)
        advantage[best] = group_advantage
        advantages = advantage.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("rloo")
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (arXiv:2402.14740): A_i = s_i - mean_{j != i} s_j = n/(n-1) (s_i - mean_g); a single sample keeps A_i =
    s_i."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        stats = group_stats(scores, index)
        n = stats.count
        leave_one_out = scores * n / (n - 1).clamp(min=1) - stats.mean * n / (n - 1).clamp(min=1)
        advantage = torch.where(n > 1, leave_one_out, scores)
        advantages = advantage.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("turn_rloo")
def compute_turn_rloo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-level RLOO: each policy turn gets its own advantage (a multi-turn response's turns are the runs of
    ``response_mask``: :func:`rl_core.batch.response_turns`; a single turn makes this RLOO exactly).

    With r_{i,k} the rewards of sample i's turn k (its token rewards summed: a tool's or an interaction's reward at the
    turn's end, the outcome score at the response's last token) and T_i its number of turns, the return-to-go from
    turn t is G_{i,t} = sum_{k=t}^{T_i - 1} r_{i,k}, and every token of turn t gets

        A_{i,t} = G_{i,t} - b_{i,t},   b_{i,t} = mean over the other samples j != i of i's group with T_j > t of
                                         G_{j,t} (0 when no other sample reached turn t).

    Unbiased when the policy decides when to stop: b_{i,t} depends on turn t (sample i's state) and on the other
    samples, drawn independently of sample i given the prompt, never on sample i's own actions at turns >= t, so
    E[grad log pi(a_{i,t} | s_{i,t}) b_{i,t}] = 0; G_{i,t} leaves out the rewards before turn t, which turn t's
    actions cannot change. Normalising per turn index and summing the per-turn normalised rewards from t to T_i - 1
    (MT-GRPO's construction, verl RFC #7244) subtracts sum_{k=t}^{T_i - 1} mean_k instead: a baseline whose number of
    terms is sample i's own stopping turn, which biases the gradient (tests/rl_core/test_turn_advantage.py shows both
    by exact enumeration)."""
    with torch.no_grad():
        turns = response_turns(response_mask)
        rows, length = turns.shape
        count = int(turns.max()) + 1 if turns.numel() else 0
        count = max(count, 1)
        slots = (turns + 1).clamp(min=0)  # slot 0 collects the tokens off the policy's turns
        per_turn = torch.zeros(rows, count + 1, dtype=token_level_rewards.dtype, device=token_level_rewards.device)
        per_turn.scatter_add_(1, slots, token_level_rewards * (turns >= 0))
        rewards = per_turn[:, 1:]
        returns = rewards.flip(-1).cumsum(-1).flip(-1)  # G_{i,t}
        reached = torch.arange(count, device=turns.device) <= turns.max(dim=-1, keepdim=True).values  # T_i > t
        group, groups = group_numbers(index, token_level_rewards.device)
        if group.numel() != rows:
            raise ValueError(f"index has {group.numel()} group ids for {rows} samples")
        kept = returns * reached
        total = torch.zeros(groups, count, dtype=returns.dtype, device=returns.device).index_add_(0, group, kept)
        reached_float = reached.to(returns.dtype)
        number = torch.zeros_like(total).index_add_(0, group, reached_float)
        others = (number[group] - reached_float).clamp(min=0)
        baseline = torch.where(others > 0, (total[group] - kept) / others.clamp(min=1), torch.zeros_like(kept))
        advantage = (returns - baseline) * reached
        per_token = torch.gather(advantage, 1, turns.clamp(min=0)) * (turns >= 0)
        per_token = per_token * response_mask
    return per_token, per_token


@register_adv_est("opo")
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (arXiv:2505.23585): A_i = s_i - b_g with the length-weighted baseline b_g = sum_j l_j s_j / sum_j l_j.

    l_j is the response length (valid tokens); a single-sample group uses b = 0.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        lengths = response_mask.sum(dim=-1).to(scores.dtype)
        group, num_groups = group_numbers(index, scores.device)
        weighted = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
            0, group, lengths * scores
        )
        total_length = torch.zeros_like(weighted).index_add_(0, group, lengths)
        count = torch.bincount(group, minlength=num_groups)
        baseline = torch.where(count > 1, weighted / total_length, torch.zeros_like(weighted))
        advantages = (scores - baseline[group]).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    gamma: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv:2501.03262): G_t = r_t + gamma G_{t+1} over valid tokens; A = whiten(G) over the batch.

    ``gamma`` comes from ``config.gamma`` (verl) or the keyword, default 1.0.
    """
    gamma = config_get(config, "gamma", 1.0) if gamma is None else gamma
    with torch.no_grad():
        returns = torch.zeros_like(token_level_rewards)
        running_return = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            mask_t = response_mask[:, t]
            new_running_return = token_level_rewards[:, t] + gamma * running_return
            returns[:, t] = new_running_return * mask_t
            running_return = new_running_return * mask_t + running_return * (1 - mask_t)
        advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@register_adv_est("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: A = whiten over the batch's tokens of (s_i - mean_g) (mean 0 for a single sample)."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        stats = group_stats(scores, index)
        mean = torch.where(stats.count == 1, torch.zeros_like(stats.mean), stats.mean)
        centred = (scores - mean).unsqueeze(-1).expand_as(token_level_rewards) * response_mask
        advantages = masked_whiten(centred, response_mask) * response_mask
    return advantages, advantages


@register_adv_est("remax")
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (arXiv:2310.10505): G_t = sum_{t' >= t} r_t' (valid tokens); A_t = G_t - b, b = greedy response's
    reward."""
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


@register_adv_est("gpg")
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (arXiv:2504.02546): A_i = alpha (s_i - mean_g) / f_norm with alpha = B / #{i: s_i != 0}.

    As in verl the ``alpha`` keyword is overridden by that batch ratio; a single sample uses mean 0.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        stats = group_stats(scores, index)
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
        mean = torch.where(stats.count == 1, torch.zeros_like(stats.mean), stats.mean)
        advantages = (alpha * (scores - mean) / f_norm).unsqueeze(-1) * response_mask
    return advantages, advantages


# ---------------------------------------------------------------------------------------------- calling by config
def call_adv_estimator(name: str, **available: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Call the estimator ``name`` with the subset of ``available`` keyword arguments it accepts.

    The trainer offers everything it has (values, index, reward_baselines, gamma, lam, ...); an estimator with
    ``**kwargs`` gets all of it, a user's function with a narrower verl signature only what it names.
    """
    fn = get_adv_estimator_fn(name)
    parameters = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        available = {k: v for k, v in available.items() if k in parameters}
    missing = [
        p.name
        for p in parameters.values()
        if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in available
    ]
    if missing:
        raise ValueError(
            f"advantage estimator {name!r} needs {missing}, which this batch does not have (e.g. 'values' needs a "
            "critic, 'reward_baselines' needs the ReMax greedy rollout)"
        )
    return fn(**available)
