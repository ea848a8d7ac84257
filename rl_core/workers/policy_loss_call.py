"""The actor's policy loss on a micro-batch, called as verl calls a registered loss (``@register_policy_loss``): the
actor config with this mini-batch's ``global_batch_info`` layered on, a loss written for verl's legacy path detected,
rollout correction's importance weights and bypass mode applied."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rl_core.algos.policy_loss import compute_policy_loss_reinforce
from rl_core.algos.rollout_correction import rollout_correction
from rl_core.batch import Batch
from rl_core.batch_fields import ADVANTAGES, OLD_LOG_PROBS, RESPONSE_MASK, ROLLOUT_IS_WEIGHTS, ROLLOUT_LOG_PROBS
from rl_core.config_access import config_get
from rl_core.metrics import rollout_probs_diff_from_sums, rollout_probs_diff_sums
from rl_core.workers.data_parallel import global_max, global_sum


class LossConfig:
    """The actor config as the policy loss sees it: every field of ``actor``, plus this mini-batch's
    ``global_batch_info`` (an OmegaConf node cannot take a new key, so it is layered on top). It notes whether the loss
    read ``global_batch_info``: one that did not (written for verl's legacy path) returns a micro-batch mean."""

    def __init__(self, actor_config: Any, global_batch_info: dict[str, float]):
        self._actor_config = actor_config
        self._global_batch_info = global_batch_info
        self.read_global_batch_info = False

    @property
    def global_batch_info(self) -> dict[str, float]:
        self.read_global_batch_info = True
        return self._global_batch_info

    def __getattr__(self, name: str) -> Any:
        return getattr(self._actor_config, name)

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)


def reads_global_batch_info(loss_fn: Callable, actor_config: Any) -> bool:
    """Whether the policy loss ``loss_fn`` reads ``config.global_batch_info``, tried on a dummy batch (a loss that fails
    there is given the benefit of the doubt)."""
    config = LossConfig(actor_config, {"dp_size": 1, "batch_num_tokens": 6.0, "global_batch_size": 2.0})
    zeros = torch.zeros(2, 3)
    try:
        loss_fn(
            old_log_prob=zeros,
            log_prob=zeros - 0.1,
            advantages=torch.ones(2, 3),
            response_mask=torch.ones(2, 3),
            loss_agg_mode=config_get(actor_config, "loss_agg_mode", "token-mean"),
            config=config,
        )
    except Exception:
        return True
    return config.read_global_batch_info


def micro_policy_loss(
    micro: Batch, log_prob: torch.Tensor, loss_fn: Callable, config: Any, loss_agg_mode: str, bypass: Any
) -> tuple[torch.Tensor, dict[str, float]]:
    """A micro-batch's policy loss and metrics. Against its old log-probs (recomputed; or ``log_prob`` detached when
    the step skipped that pass: one epoch, one mini-batch), weighed by rollout correction's importance weights when
    the batch has them (decoupled mode). In the bypass mode (``bypass``: the RolloutCorrection settings) against the
    rollout's log-probs, the weights and the rejection computed here from pi_theta (the rejection drops tokens from
    this loss only, as verl): ``ppo_clip``, the configured loss without weights (its ratio pi_theta / pi_rollout is
    the correction), or ``reinforce``, REINFORCE weighted."""
    mask, advantages = micro.tensors[RESPONSE_MASK], micro.tensors[ADVANTAGES]
    if bypass is None:
        old_log_prob = micro.tensors[OLD_LOG_PROBS] if OLD_LOG_PROBS in micro.tensors else log_prob.detach()
        weights, correction_metrics = micro.tensors.get(ROLLOUT_IS_WEIGHTS), {}
    else:
        old_log_prob = micro.tensors[ROLLOUT_LOG_PROBS]
        weights, mask, correction_metrics = rollout_correction(log_prob.detach(), old_log_prob, mask, bypass)
        if bypass.loss_type == "reinforce":
            pg_loss, metrics = compute_policy_loss_reinforce(
                old_log_prob, log_prob, advantages, mask, loss_agg_mode, config, weights
            )
            return pg_loss, metrics | correction_metrics
        weights = None  # ppo_clip: its ratio pi_theta / pi_rollout is the correction
    pg_loss, metrics = loss_fn(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=weights,
    )
    return pg_loss, metrics | correction_metrics


class OldPassMetrics:
    """The metrics of the old-log-prob pass (``actor/entropy``; with the rollout's log-probs verl's
    ``training/rollout_probs_diff_*``) from the update's own forward pass, for a step that skipped that pass (one
    epoch, one mini-batch: the update's log-probs before its first optimizer step are the old ones). :meth:`add` each
    micro-batch; :meth:`metrics` reduces over the ranks (every rank must call it)."""

    def __init__(self) -> None:
        self.entropy = torch.zeros(2, dtype=torch.float64)  # (sum of entropy over valid tokens, valid tokens)
        self.diff = torch.zeros(8, dtype=torch.float64)  # rl_core.metrics.rollout_probs_diff_sums
        self.diff_max, self.with_rollout = 0.0, False

    def add(self, micro: Batch, log_prob: torch.Tensor, entropy: torch.Tensor, bypass: Any) -> None:
        mask = micro.tensors[RESPONSE_MASK]
        self.entropy.add_(torch.stack([(entropy.detach() * mask).sum(), mask.sum()]).double().cpu())
        if ROLLOUT_LOG_PROBS in micro.tensors and bypass is None:
            sums, largest = rollout_probs_diff_sums(micro.tensors[ROLLOUT_LOG_PROBS], log_prob.detach(), mask)
            self.diff.add_(sums.cpu())
            self.diff_max, self.with_rollout = max(self.diff_max, float(largest)), True

    def metrics(self) -> dict[str, float]:
        entropy_sum, tokens = global_sum(self.entropy[0]), global_sum(self.entropy[1])
        metrics = {"actor/entropy": float(entropy_sum / tokens.clamp(min=1))}
        if self.with_rollout:
            metrics |= rollout_probs_diff_from_sums(global_sum(self.diff), global_max(self.diff_max))
        return metrics
