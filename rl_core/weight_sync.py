"""Weights from the trainer's actor to a rollout on workers of its own (separate resource pools), one tensor at a time.

The actor exports the tensors it trains (all of them; with LoRA only the adapter, the frozen base being the same on
both sides) with their version, its number of updates done; the rollout copies them into its model and takes the
version. :func:`sync_rollout_weights` moves them only when the rollout's version is behind the actor's. A transport
moves named tensors one by one, so neither side holds a second copy of the whole model:

* :class:`InProcessTransport`: the tensors themselves (both roles in one process: the tests);
* ``infra.weight_transport.ObjectStoreTransport``: each tensor put in Ray's object store by the actor's process and
  fetched by the rollout's (what runs on separate Ray workers use, CPU or GPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class WeightTransport(Protocol):
    def send(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Any:
        """Ship the named tensors; returns the handle the receiving side reads them from."""

    def receive(self, handle: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """The named tensors of ``handle``, one at a time."""


class InProcessTransport:
    def send(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
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
    with torch.no_grad():
        for name, tensor in tensors:
            if name not in parameters or parameters[name].shape != tensor.shape:
                raise ValueError(
                    f"weight sync: the rollout's model has no parameter {name!r} of shape {tuple(tensor.shape)}: the "
                    "rollout and the actor must load the same model (actor_rollout_ref.model)"
                )
            parameters[name].copy_(tensor.to(parameters[name].device, parameters[name].dtype))
            count += 1
    return count


def sync_rollout_weights(actor: Any, rollout: Any) -> bool:
    """The actor's weights to ``rollout`` when its version is behind the actor's; whether they moved."""
    if rollout.weights_version() >= actor.weights_version():
        return False
    rollout.receive_weights(actor.export_weights())
    return True
