"""Entropy of the policy's token distribution, computed from logits in chunks to bound memory."""

from __future__ import annotations

import torch

from rl_core.algos.aggregate import agg_loss


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = 2048) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) z over the last dim, for every leading position.

    The softmax is materialised for at most ``chunk_size`` positions at a time (in float32), so peak extra
    memory is chunk_size x vocab instead of the whole (batch x length x vocab). ``None`` = one chunk.
    """
    leading_shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    step = flat.shape[0] if chunk_size is None else chunk_size
    pieces = []
    for start in range(0, flat.shape[0], max(step, 1)):
        chunk = flat[start : start + step].float()
        probs = torch.softmax(chunk, dim=-1)
        pieces.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(dim=-1))
    entropy = torch.cat(pieces) if pieces else flat.new_zeros(0, dtype=torch.float32)
    return entropy.reshape(leading_shape)


def compute_entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """Aggregated token entropy of ``logits`` (batch, response_length, vocab) over ``response_mask``."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)
