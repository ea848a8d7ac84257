"""How a worker cuts a batch into micro-batches (one forward, or one forward and backward, each): by count
(``*_micro_batch_size_per_gpu`` rows), or by tokens (verl's ``use_dynamic_bsz``, and whenever no row count is set, the
default: at most ``*_max_token_len_per_gpu`` real tokens, prompt and response, in each; :func:`micro_batch_limits`).
A token budget suits the batch at hand: a few long sequences or many short ones (64 responses of 24 tokens: one
forward pass instead of 16 of 4 rows).

Packing by tokens puts several short sequences where one long one would go, so a batch of very uneven lengths takes
fewer, fuller forward passes than fixed counts sized for the longest. It changes no result: a micro-batch's loss is
weighed by the mini-batch's global counts (rl_core/workers/train_loop.py) and log-probs and values are put back in the
batch's order. Under data parallelism every rank runs the same number of micro-batches (their forwards are
collective): the ranks take the largest count of any of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rl_core.batch import Batch
from rl_core.batch_fields import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, PROMPTS, RESPONSES
from rl_core.workers.data_parallel import global_max

SEQUENCE_FIELDS = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS)  # (B, P + R); every other 2-D tensor but PROMPTS is (B, R)


def micro_batch_limits(rows: int | None, use_dynamic_bsz: bool, max_tokens: int) -> tuple[int | None, int | None]:
    """A section's micro-batch bounds, (rows, tokens): by ``max_tokens`` tokens when ``use_dynamic_bsz`` is on or no
    row count is set (``rows`` null), by ``rows`` rows otherwise."""
    if use_dynamic_bsz or rows is None:
        return None, int(max_tokens)
    return int(rows), None


def pack_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """The rows (indices into ``lengths``) packed into as few groups of at most ``max_tokens`` tokens as first-fit
    decreasing finds: longest first, each into the first group it fits. Each group's rows in batch order."""
    too_long = [length for length in lengths if length > max_tokens]
    if too_long:
        raise ValueError(
            f"a sequence of {max(too_long)} tokens does not fit in a micro-batch of at most {max_tokens} tokens: raise "
            "the *_max_token_len_per_gpu setting to at least max_prompt_length + max_response_length, or turn "
            "use_dynamic_bsz off"
        )
    groups: list[list[int]] = []
    loads: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        for index, load in enumerate(loads):
            if load + lengths[row] <= max_tokens:
                groups[index].append(row)
                loads[index] += lengths[row]
                break
        else:
            groups.append([row])
            loads.append(lengths[row])
    return [sorted(group) for group in groups]


def split_into(groups: list[list[int]], count: int) -> list[list[int]]:
    """``groups`` made ``count`` groups by halving the one with the most rows (as long as one has two)."""
    groups = [list(group) for group in groups]
    while len(groups) < count and max(len(group) for group in groups) > 1:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        group = groups.pop(largest)
        groups += [group[: len(group) // 2], group[len(group) // 2 :]]
    return groups


def micro_batch_rows(batch: Batch, micro_batch_size: int | None, max_tokens: int | None = None) -> list[list[int]]:
    """Each micro-batch's rows: runs of ``micro_batch_size`` consecutive rows, or, with ``max_tokens``, the rows
    packed by their real tokens (:func:`pack_by_tokens`), as many groups on every rank."""
    rows = len(batch)
    if max_tokens is None:
        return [list(range(start, min(start + micro_batch_size, rows))) for start in range(0, rows, micro_batch_size)]
    if rows == 0:
        return []
    groups = pack_by_tokens(batch.tensors[ATTENTION_MASK].sum(-1).tolist(), max_tokens)
    return split_into(groups, global_max(len(groups)))


def trim_response_padding(micro: Batch) -> Batch:
    """``micro`` without the response columns that are padding on all its rows (responses are right-padded), so a
    padded forward pass runs at the width of its longest response, not the batch's. Nothing else changes: the cut
    positions are masked, and causal attention never lets a real token see a later one."""
    width = micro.tensors[RESPONSES].shape[1]
    real = micro.tensors[ATTENTION_MASK][:, -width:].any(dim=0).nonzero()
    keep = int(real.max()) + 1 if len(real) else 1
    if keep == width:
        return micro
    cut = width - keep
    tensors = {}
    for key, tensor in micro.tensors.items():
        if key in SEQUENCE_FIELDS:
            tensor = tensor[:, : tensor.shape[1] - cut]
        elif key != PROMPTS and tensor.dim() >= 2 and tensor.shape[1] == width:
            tensor = tensor[:, :keep]
        tensors[key] = tensor
    return Batch(tensors, micro.non_tensors, micro.meta_info)


def in_micro_batches(
    batch: Batch, micro_batch_size: int | None, max_tokens: int | None, forward: Callable[[Batch], tuple]
) -> tuple[torch.Tensor | None, ...]:
    """``forward(micro)`` (a tuple of (rows, response columns) tensors, or None) on each micro-batch
    (:func:`micro_batch_rows`, :func:`trim_response_padding`), the pieces padded back to the batch's response width
    with zeros and joined in the batch's row order."""
    width = batch.tensors[RESPONSES].shape[1]
    groups = micro_batch_rows(batch, micro_batch_size, max_tokens)
    pieces = [forward(trim_response_padding(batch[rows])) for rows in groups]
    order = torch.argsort(torch.tensor([row for rows in groups for row in rows]))
    return tuple(
        None
        if parts[0] is None
        else torch.cat([torch.nn.functional.pad(part, (0, width - part.shape[1])) for part in parts])[order]
        for parts in zip(*pieces, strict=True)
    )
