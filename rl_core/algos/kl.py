"""KL between the policy and the reference policy: per-token estimators and the KL-coefficient controllers.

Estimators of KL(pi || pi_ref) from the two log-probs of the sampled token, d = log_prob - ref_log_prob
(Schulman, "Approximating KL divergence"):
  kl / k1         d
  abs             |d|
  mse / k2        d^2 / 2
  low_var_kl / k3 exp(-d) + d - 1, with -d clamped to [-20, 20] and the result to [-10, 10]
A ``+`` suffix (``k1+``, ``low_var_kl+``, ...) keeps the named estimator's value but takes the gradient of k2,
which is unbiased for the KL gradient (straight-through: k2 - sg(k2) + sg(value)). verl 0.9 documents the
``+`` forms but rejects them in its config check; here they work.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rl_core.algo_names import KL_PENALTIES
from rl_core.algos.masked import masked_mean
from rl_core.config_access import config_get


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str) -> torch.Tensor:
    """The value of one of :data:`rl_core.algo_names.KL_ESTIMATORS` per token (see module doc)."""
    diff = log_prob - ref_log_prob
    if estimator in ("kl", "k1"):
        return diff
    if estimator == "abs":
        return diff.abs()
    if estimator in ("mse", "k2"):
        return 0.5 * diff.square()
    if estimator in ("low_var_kl", "k3"):
        neg_diff = torch.clamp(-diff, min=-20, max=20)
        return torch.clamp(torch.exp(neg_diff) - neg_diff - 1, min=-10, max=10)
    raise ValueError(f"Unknown KL penalty {estimator!r}; choose one of {list(KL_PENALTIES)}")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL penalty ``kl_penalty`` (one of :data:`KL_PENALTIES`); ``name+`` = value of name, gradient of k2."""
    if not kl_penalty.endswith("+"):
        return kl_estimate(log_prob, ref_log_prob, kl_penalty)
    value = kl_estimate(log_prob, ref_log_prob, kl_penalty[:-1])
    k2 = 0.5 * (log_prob - ref_log_prob).square()
    return k2 - k2.detach() + value.detach()


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_controller: FixedKLController | AdaptiveKLController,
    kl_penalty_name: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward: rewards = scores - beta * kl_t on valid tokens; the controller then sees the batch KL.

    The batch KL is the mean over sequences of each sequence's mean token KL. Returns (token_level_rewards,
    metrics) with verl's ``actor/reward_kl_penalty`` and ``actor/reward_kl_penalty_coeff``.
    """
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_name) * response_mask
    beta = kl_controller.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean().item()
    kl_controller.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return token_level_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


class FixedKLController:
    """beta stays ``kl_coef``."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No change: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019 (arXiv:1909.08593): beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon={horizon} must be > 0 for the adaptive KL controller")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def get_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """Build the controller described by ``algorithm.kl_ctrl`` (type fixed|adaptive, kl_coef, target_kl, horizon)."""
    kind = config_get(kl_ctrl, "type", "fixed")
    kl_coef = config_get(kl_ctrl, "kl_coef", 0.001)
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(
            kl_coef, config_get(kl_ctrl, "target_kl", 0.1), config_get(kl_ctrl, "horizon", 10000)
        )
    raise ValueError(f"algorithm.kl_ctrl.type={kind!r}; choose 'fixed' or 'adaptive'")
