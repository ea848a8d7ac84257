"""Weights between Ray worker processes through Ray's object store, one tensor at a time (rl_core.weight_sync's
transport for a rollout on workers of its own).

The actor's process puts each tensor (as a numpy array: its buffer goes to the store without pickling) and sends the
list of (name, reference); the rollout's process fetches them one by one, so neither holds a second copy of the whole
model. The references are owned by the actor's process, which keeps them until the next export replaces them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


class ObjectStoreTransport:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []  # the last export's references, alive until the next one

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, Any]]:
        import ray

        self.sent = [(name, ray.put(_as_array(tensor))) for name, tensor in tensors]
        return self.sent

    def receive(self, handle: list[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
        import ray

        for name, reference in handle:
            array = ray.get(reference)  # a read-only view of the store for a large tensor
            yield name, torch.from_numpy(array if array.flags.writeable else array.copy())

    def __getstate__(self) -> dict:  # a transport travels to its worker empty
        return {"sent": []}


def _as_array(tensor: torch.Tensor) -> Any:
    """The tensor on the CPU as numpy holds it (bfloat16, which numpy lacks, as float32: exact; the receiver casts it
    to its parameter's dtype)."""
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
