"""What a worker needs to know about data parallelism: its world size, global sums and maxima across ranks.

Without an initialised ``torch.distributed`` process group everything is local (world size 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def collective_device() -> str:
    """Where the process group's collectives take their tensors: ``cuda`` for nccl, ``cpu`` for gloo (or no group)."""
    return "cuda" if world_size() > 1 and dist.get_backend() == "nccl" else "cpu"


def global_sum(value: torch.Tensor | float) -> torch.Tensor:
    """The sum of ``value`` over all data-parallel ranks (a float64 scalar tensor)."""
    total = torch.as_tensor(value, dtype=torch.float64).detach().clone()
    if world_size() > 1:
        total = total.to(collective_device())
        dist.all_reduce(total)
    return total.cpu()


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any data-parallel rank. Every rank must call it: ranks that must stop together
    (a non-finite loss on one of them) agree here instead of leaving the others waiting in a collective."""
    return bool(global_sum(float(flag)) > 0) if world_size() > 1 else flag


def global_max(value: float) -> float:
    """The largest ``value`` over all data-parallel ranks, of its type (every rank must call it)."""
    if world_size() == 1:
        return value
    largest = torch.tensor(value, dtype=torch.float64, device=collective_device())
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return type(value)(largest.item())
