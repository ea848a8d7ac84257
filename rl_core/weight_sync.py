"""Weights from the trainer's actor to a rollout on workers of its own (separate resource pools), one tensor at a time.

The actor exports the tensors it trains (all of them; with LoRA only the adapter, the frozen base being the same on
both sides) with their version, its number of updates done; the rollout copies them into its model and takes the
version. :func:`sync_rollout_weights` moves them only when the rollout's version is behind the actor's. A transport
moves named tensors in buckets, so neither side holds a second copy of the whole model:

* :class:`InProcessTransport`: the tensors themselves (both roles in one process: the tests);
* ``infra.weight_transport.ObjectStoreTransport`` (``checkpoint_engine.backend=naive``): put in Ray's object store by
  the actor's process, fetched by a rollout worker's whenever it next generates;
* ``infra.weight_transport.CollectiveTransport`` (``gloo`` / ``nccl``): broadcast by the actor's rank 0 to one rollout
  worker while that worker receives (a *rendezvous* transport: both calls in flight together).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class WeightTransport(Protocol):
    # whether the receiver must be receiving while the sender sends (the send waits for it), rather than reading a
    # handle later
    rendezvous: bool

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]], to: int | None = None, version: int = 0) -> Any:
        """Ship the named tensors, the weights of ``version`` (to rollout worker ``to``, where the transport addresses
        one and announces the version to it); returns the handle the receiving side reads them from."""

    def receive(self, handle: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """The named tensors of ``handle``, one at a time."""


class InProcessTransport:
    rendezvous = False

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]], to: int | None = None, version: int = 0) -> list:
        return [(name, tensor.detach().clone()) for name, tensor in tensors]

    def receive(self, handle: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        yield from handle


@dataclass
class WeightsUpdate:
    """What the actor exports: its version (updates done) and the transport's handle to the tensors."""

    version: int
    handle: Any


def trained_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters an update changes (``requires_grad``), by name."""
    for name, parameter in module.named_parameters():
        if parameter.requires_grad:
            yield name, parameter.detach()


def load_tensors(module: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each named tensor into the module's parameter of that name; returns how many. A name the module does not
    have, or a shape it does not have, is an error (the two sides were built from different configs)."""
    parameters = dict(module.named_parameters())
    count = 0
    tensors = iter(tensors)
    try:
        with torch.no_grad():
            for name, tensor in tensors:
                if name not in parameters or parameters[name].shape != tensor.shape:
                    raise ValueError(
                        f"weight sync: the rollout's model has no parameter {name!r} of shape {tuple(tensor.shape)}: "
                        "the rollout and the actor must load the same model (actor_rollout_ref.model)"
                    )
                parameters[name].copy_(tensor.to(parameters[name].device, parameters[name].dtype))
                count += 1
    finally:  # a transport's generator left early takes what is still coming (its sender is not left waiting)
        getattr(tensors, "close", lambda: None)()
    return count


def sync_rollout_weights(actor: Any, rollout: Any) -> bool:
    """The actor's weights to ``rollout`` when its version is behind the actor's; whether they moved."""
    if rollout.weights_version() >= actor.weights_version():
        return False
    rollout.receive_weights(actor.export_weights())
    return True
