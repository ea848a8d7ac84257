"""The critic's value loss with PPO-style value clipping."""

from __future__ import annotations

import torch

from rl_core.algos.aggregate import agg_loss
from rl_core.algos.masked import masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vf_loss = 1/2 agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)); vf_clipfrac = share where the clip
    wins.

    V = ``vpreds`` (current critic), V_old = ``values`` (at rollout time), R = ``returns``, c = ``cliprange_value``.
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses_unclipped = (vpreds - returns) ** 2
    vf_losses_clipped = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.max(vf_losses_unclipped, vf_losses_clipped),
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = masked_mean(torch.gt(vf_losses_clipped, vf_losses_unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac
