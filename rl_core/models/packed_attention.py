"""Attention over a packed sequence, row by row: PyTorch's SDPA on each packed row's own block.

The padding-free forward (:mod:`rl_core.models.logprob`) packs a micro-batch's rows into one sequence whose position
ids restart at each row. transformers' SDPA attention gives that sequence one block-diagonal mask, so attention costs
(sum of the rows' lengths)^2 instead of the sum of each row's length^2: with 32 rows of ~80 tokens, ~30x the work
(flash-attention's variable-length kernels, on CUDA, do only the rows' own blocks). :func:`packed_sdpa_attention`
cuts the sequence where its position ids restart (transformers' own test for packed rows: a step other than +1) and
runs SDPA on each row with the diagonal block of the mask that transformers built. The entries outside the blocks are
masked, so the result is the masked whole's, with the work of each row alone. Anything else (a batch of rows, a KV
cache, no position ids reaching the attention) goes to SDPA unchanged.

It is registered with transformers under :data:`PACKED_SDPA`, with SDPA's masks, and chosen where SDPA would be
(:func:`rl_core.models.loading.attention_implementation`). The name is never written into a saved checkpoint's config.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "ppoflow_packed_sdpa"


def packed_row_bounds(position_ids: torch.Tensor) -> list[int]:
    """The start of each packed row in a (1, N) ``position_ids`` and N: where the position does not step by +1."""
    steps = position_ids[0, 1:] - position_ids[0, :-1]
    starts = (steps != 1).nonzero().flatten() + 1
    return [0, *starts.tolist(), position_ids.shape[1]]


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (B, H, Lq, D), key/value (B, Hkv, Lk, D), an optional 4D mask;
    returns (B, Lq, H, D). A packed sequence (B = 1, no cache: Lq = Lk, position ids with restarts) is attended row by
    row, each row with its own block of ``attention_mask`` (causal when there is none)."""
    position_ids = kwargs.get("position_ids")
    packed = (
        position_ids is not None
        and query.shape[0] == 1
        and query.shape[2] == key.shape[2] == position_ids.shape[-1]
        and not kwargs.get("output_attentions", False)
    )
    bounds = packed_row_bounds(position_ids.reshape(1, -1)) if packed else []
    if len(bounds) <= 2:  # one row, or not a packed sequence
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    kwargs.pop("is_causal", None)
    rows = []
    for start, end in zip(bounds, bounds[1:]):
        block = None if attention_mask is None else attention_mask[..., start:end, start:end]
        output, _ = sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            block,
            dropout,
            scaling,
            is_causal=block is None,
            **kwargs,
        )
        rows.append(output)
    return torch.cat(rows, dim=1), None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
