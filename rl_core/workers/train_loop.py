"""The update loop shared by the actor and the critic: epochs x mini-batches x micro-batches.

One optimizer step per mini-batch; micro-batches accumulate gradients. Under data parallelism each rank cuts
its own shard into mini-batches of ``global mini-batch / world size`` rows (as verl does). Each micro-batch's loss is
computed with the *mini-batch's* global token and sequence counts (``global_batch_info``), so the accumulated gradient
equals the gradient of the whole mini-batch's loss, whatever the micro-batch size or the number of ranks.

A non-finite loss stops the update on every rank before any collective (the run fails and resumes from its last
checkpoint); a non-finite gradient norm (an overflow) skips that mini-batch's optimizer step, as verl does, and is
counted in ``<name>/skipped_steps``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from rl_core.batch import Batch
from rl_core.batch_fields import RESPONSE_MASK
from rl_core.workers.data_parallel import any_rank, global_sum, world_size
from rl_core.workers.fsdp import clip_grad_norm
from rl_core.workers.micro_batches import micro_batch_rows, trim_response_padding


class NonFiniteError(FloatingPointError):
    """A loss became NaN/Inf; the update stopped before that mini-batch's optimizer step."""


def mini_batches(
    batch: Batch, mini_batch_size: int, epochs: int, shuffle: bool, seed: int
) -> Iterator[tuple[int, Batch]]:
    """(epoch, mini-batch) pairs; with ``shuffle`` each epoch visits the rows in a seeded random order."""
    for epoch in range(epochs):
        if shuffle:
            order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
            batch = batch[order]
        for mini in batch.split(mini_batch_size):
            yield epoch, mini


def local_mini_batch_size(global_mini_batch_size: int) -> int:
    """This rank's share of a mini-batch (in responses), rounded up: a batch that does not divide over the ranks is
    padded by the dispatcher with rows of zero weight (``response_mask`` 0), which change no gradient and no count."""
    return -(-global_mini_batch_size // world_size())


def global_batch_info(mini: Batch) -> dict[str, float]:
    """dp_size and the mini-batch's valid-token and non-empty-sequence counts summed over all ranks."""
    response_mask = mini.tensors[RESPONSE_MASK]
    return {
        "dp_size": world_size(),
        "batch_num_tokens": float(global_sum(response_mask.sum())),
        "global_batch_size": float(global_sum((response_mask.sum(-1) > 0).sum())),
    }


# micro_loss(micro-batch, the batch's totals, the micro-batch's share of the mini-batch) -> (loss, metrics)
MicroLoss = Callable[[Batch, dict[str, float], float], tuple[torch.Tensor, dict[str, float]]]


def run_updates(
    name: str,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    mini_batch_size: int,
    micro_batch_limits: tuple[int | None, int | None],
    epochs: int,
    shuffle: bool,
    seed: int,
    grad_clip: float,
    micro_loss: MicroLoss,
) -> dict[str, float]:
    """Run the loop; ``micro_loss(micro, batch_info, share)`` returns the micro-batch's part of the mini-batch's loss
    and its metrics (``share``: the micro-batch's rows / the rank's mini-batch rows, for a loss that is a micro-batch
    mean). ``micro_batch_limits``: a micro-batch's (rows, tokens), one of them set
    (:func:`rl_core.workers.micro_batches.micro_batch_limits`).

    Returns metrics averaged over mini-batches (``<name>/grad_norm`` and per-micro metrics averaged over micros;
    the loss metrics that ``micro_loss`` reports as ``*_loss`` are summed over micros = the mini-batch loss).
    """
    module.train()
    per_mini: dict[str, list[float]] = defaultdict(list)
    steps, skipped = 0, 0
    for epoch, mini in mini_batches(batch, mini_batch_size, epochs, shuffle, seed):
        info = global_batch_info(mini)
        optimizer.zero_grad(set_to_none=True)
        micro_metrics: dict[str, list[float]] = defaultdict(list)
        for rows in micro_batch_rows(mini, *micro_batch_limits):
            micro = trim_response_padding(mini[rows])
            loss, metrics = micro_loss(micro, info, len(micro) / len(mini))
            if any_rank(not bool(torch.isfinite(loss))):  # all ranks stop together, before backward's collectives
                optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(
                    f"{name} update: the loss is {loss.item()} on this rank (epoch {epoch}, after {steps} optimizer "
                    "step(s) of this update; non-finite on at least one rank): the update stops here and the run "
                    "fails; resuming restarts from the last checkpoint. Check the rewards and advantages for NaN/Inf, "
                    "or lower the learning rate"
                )
            loss.backward()
            for key, value in metrics.items():
                micro_metrics[key].append(value)
        # the parameters are collected here, not once before the loop: FSDP2 replaces them at its first forward
        grad_norm = clip_grad_norm([p for p in module.parameters() if p.requires_grad], grad_clip)
        if not math.isfinite(grad_norm):  # the norm is the group's: every rank skips this step together
            optimizer.zero_grad(set_to_none=True)
            skipped += 1
            continue
        optimizer.step()
        steps += 1
        per_mini[f"{name}/grad_norm"].append(grad_norm)
        for key, values in micro_metrics.items():
            per_mini[key].append(sum(values) if key.endswith("_loss") else sum(values) / len(values))
    metrics = {key: sum(values) / len(values) for key, values in per_mini.items()}
    metrics[f"{name}/lr"] = optimizer.param_groups[0]["lr"]
    if skipped:
        metrics[f"{name}/skipped_steps"] = float(skipped)
    return metrics
