"""Entropy of the policy's token distribution, computed from logits in chunks to bound memory."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from rl_core.algos.aggregate import agg_loss


def _chunk_entropy(chunk: torch.Tensor) -> torch.Tensor:
    chunk = chunk.float()
    return torch.logsumexp(chunk, dim=-1) - (torch.softmax(chunk, dim=-1) * chunk).sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = 2048) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) z over the last dim, for every leading position.

    The float32 softmax is materialised for at most ``chunk_size`` positions at a time, so peak extra memory is
    chunk_size x vocab instead of the whole (batch x length x vocab). When a gradient will flow (an entropy bonus), each
    chunk is recomputed in the backward pass instead of keeping its softmax: the saving holds under autograd too.
    ``None`` = one chunk.
    """
    leading_shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    step = max(flat.shape[0] if chunk_size is None else chunk_size, 1)
    recompute = flat.requires_grad and torch.is_grad_enabled()
    pieces = [
        torch.utils.checkpoint.checkpoint(_chunk_entropy, chunk, use_reentrant=False)
        if recompute
        else _chunk_entropy(chunk)
        for chunk in flat.split(step)
    ]
    entropy = torch.cat(pieces) if pieces else flat.new_zeros(0, dtype=torch.float32)
    return entropy.reshape(leading_shape)


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Aggregated token entropy of ``logits`` (batch, response_length, vocab) over ``response_mask``."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)
