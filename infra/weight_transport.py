"""Weights between Ray worker processes through Ray's object store, in buckets (rl_core.weight_sync's transport for a
rollout on workers of its own).

The actor's process puts the tensors (as numpy arrays: their buffers go to the store without pickling) in buckets of
at most ``bucket_bytes`` (one object each: a small model is one put, a large one streams) and sends the list of
references; the rollout's process fetches them one bucket at a time, so neither holds a second copy of a large model.
The references are owned by the actor's process, which keeps them until the next export replaces them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


class ObjectStoreTransport:
    def __init__(self, bucket_bytes: int = 512 * 2**20) -> None:
        self.bucket_bytes = bucket_bytes
        self.sent: list[Any] = []  # the last export's references, alive until the next one

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> list[Any]:
        import ray

        self.sent, bucket, size = [], {}, 0
        for name, tensor in tensors:
            array = _as_array(tensor)
            if bucket and size + array.nbytes > self.bucket_bytes:
                self.sent.append(ray.put(bucket))
                bucket, size = {}, 0
            bucket[name], size = array, size + array.nbytes
        if bucket:
            self.sent.append(ray.put(bucket))
        return self.sent

    def receive(self, handle: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
        import ray

        for reference in handle:
            for name, array in ray.get(reference).items():  # read-only views of the store for large arrays
                yield name, torch.from_numpy(array if array.flags.writeable else array.copy())

    def __getstate__(self) -> dict:  # a transport travels to its worker empty
        return {"bucket_bytes": self.bucket_bytes, "sent": []}


def _as_array(tensor: torch.Tensor) -> Any:
    """The tensor on the CPU as numpy holds it (bfloat16, which numpy lacks, as float32: exact; the receiver casts it
    to its parameter's dtype)."""
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
