"""How a worker cuts a batch into micro-batches (one forward, or one forward and backward, each): by count
(``*_micro_batch_size_per_gpu`` rows), or by tokens (verl's ``use_dynamic_bsz``: at most ``*_max_token_len_per_gpu``
real tokens, prompt and response, in each).

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
from rl_core.batch_fields import ATTENTION_MASK
from rl_core.workers.data_parallel import global_max


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


def micro_batch_rows(batch: Batch, micro_batch_size: int, max_tokens: int | None = None) -> list[list[int]]:
    """Each micro-batch's rows: runs of ``micro_batch_size`` consecutive rows, or, with ``max_tokens``, the rows
    packed by their real tokens (:func:`pack_by_tokens`), as many groups on every rank."""
    rows = len(batch)
    if max_tokens is None:
        return [list(range(start, min(start + micro_batch_size, rows))) for start in range(0, rows, micro_batch_size)]
    if rows == 0:
        return []
    groups = pack_by_tokens(batch.tensors[ATTENTION_MASK].sum(-1).tolist(), max_tokens)
    return split_into(groups, global_max(len(groups)))


def in_micro_batches(
    batch: Batch, micro_batch_size: int, max_tokens: int | None, forward: Callable[[Batch], tuple]
) -> tuple[torch.Tensor | None, ...]:
    """``forward(micro)`` (a tuple of tensors with a row per sequence, or None) on each micro-batch
    (:func:`micro_batch_rows`), the pieces joined back in the batch's row order."""
    groups = micro_batch_rows(batch, micro_batch_size, max_tokens)
    pieces = [forward(batch[rows]) for rows in groups]
    order = torch.tensor([row for rows in groups for row in rows])
    return tuple(
        None if parts[0] is None else torch.cat(parts)[torch.argsort(order)] for parts in zip(*pieces, strict=True)
    )
