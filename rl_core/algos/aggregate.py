"""Loss aggregation: how a (batch, response_length) matrix of per-token losses becomes one scalar.

Modes (verl's names), with L the loss matrix, M the mask, T = M.shape[-1]:
  token-mean              sum(L*M) / sum(M)                       (every token weighs the same)
  token-sum               sum(L*M)
  seq-mean-token-sum      mean over sequences of sum_t(L*M)
  seq-mean-token-mean     mean over sequences of sum_t(L*M) / sum_t(M)
  seq-mean-token-sum-norm mean over sequences of sum_t(L*M), divided by T (Dr.GRPO's constant normaliser)
Fully masked sequences do not count in the sequence means. Under data parallelism the denominators are the
global token / sequence counts (``batch_num_tokens``, ``global_batch_size``) and the loss is scaled by
``dp_size`` so that the all-reduced mean of the gradients equals the single-process gradient.
"""

from __future__ import annotations

import torch

from rl_core.algo_names import LOSS_AGG_MODES
from rl_core.algos.masked import masked_sum


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` over the valid tokens of ``loss_mask`` according to ``loss_agg_mode`` (see module doc)."""
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("agg_loss: token-mean with dp_size > 1 needs the global batch_num_tokens")
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        tokens_per_seq = loss_mask.sum(dim=-1)
        seq_losses = (loss_mat * loss_mask).sum(dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (tokens_per_seq + 1e-8)
        seq_mask = (tokens_per_seq > 0).to(loss_mat.dtype)
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError(f"agg_loss: {loss_agg_mode} with dp_size > 1 needs the global_batch_size")
            global_batch_size = seq_mask.sum()
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])
        return loss
    raise ValueError(f"Unknown loss_agg_mode {loss_agg_mode!r}; choose one of {list(LOSS_AGG_MODES)}")
