"""The padding-free passes' context: a model's forward over one packed sequence (rows side by side, position ids
restarting at each row, no padding mask), which lets the packed attention skip transformers' (N, N) mask
(:mod:`rl_core.models.packed_attention`).

A module of its own because the passes (:mod:`rl_core.models.logprob`) are imported by the controller too (the input
checks, the session's imports), and the attention module imports transformers' modeling code (~1.5-2.5 s here), which
only the workers need.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_PACKED_LENGTH: ContextVar[int | None] = ContextVar("ppoflow_packed_length", default=None)  # in packed_forward


@contextmanager
def packed_forward(position_ids: torch.Tensor) -> Iterator[None]:
    """A model's forward over one packed sequence whose (1, N) ``position_ids`` restart at each row, with no padding
    mask: a mask that would only be causal within the rows is not built
    (:func:`rl_core.models.packed_attention.packed_sdpa_mask`). The attention reads the rows from the position ids the
    model passes it, in the forward and in a gradient checkpoint's recomputation (after this block); a model that
    passes none gets plain causal attention over the whole sequence, which the padding-free self-check at load finds
    (:func:`rl_core.models.logprob.padding_free_mismatch`: padded batches)."""
    token = _PACKED_LENGTH.set(position_ids.shape[-1])
    try:
        yield
    finally:
        _PACKED_LENGTH.reset(token)


def packed_length() -> int | None:
    """The length of the packed sequence whose forward runs in this context (:func:`packed_forward`), else None."""
    return _PACKED_LENGTH.get()
