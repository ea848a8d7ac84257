"""FSDP2 for the workers: the process group from the environment, sharding, full-weight views and
full (rank-0) state dicts. With a world size of 1 every function is a no-op or the plain equivalent.

Sharding is ``fully_shard`` on each transformer block and then on the whole model (``param_offload``
moves the sharded parameters to CPU between uses, ``optimizer_offload`` keeps optimizer state on CPU).

FSDP2's modules (``torch.distributed.fsdp``, ``.tensor``, ``.checkpoint``: ~0.7 s to import) are imported where a
sharded model or a checkpoint needs them: the controller, which imports the workers' classes, never does.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rl_core.device import cuda_device_index
from rl_core.workers.data_parallel import collective_device, world_size


def init_distributed_from_env(backend: str = "gloo") -> None:
    """Join the process group described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (``gloo`` for workers on the
    CPU, ``nccl`` for workers on GPUs). On GPUs the process takes its own device
    (:func:`rl_core.device.cuda_device_index`)
    and LOCAL_RANK becomes that device's index: vLLM's external launcher places its engine on ``cuda:<LOCAL_RANK>``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        return
    if backend == "nccl":
        index = cuda_device_index(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count())
        torch.cuda.set_device(index)
        os.environ["LOCAL_RANK"] = str(index)
    dist.init_process_group(backend=backend, rank=int(os.environ["RANK"]), world_size=world)


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` that also works for FSDP2 shards offloaded to the CPU (``param_offload``) on
    an nccl group: the sum over ranks of the local shards' norms is taken on the group's device (an nccl collective
    cannot take a CPU tensor; verl's ``fsdp2_clip_grad_norm_`` does the same). Returns the total norm; a non-finite
    one scales nothing."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(total, "full_tensor"):  # a DTensor, this rank's part of the norm: reduce it where collectives run
        total = total.to(collective_device()).full_tensor()
    total_norm = float(total)
    scale = max_norm / (total_norm + 1e-6)
    if math.isfinite(total_norm) and scale < 1.0:
        for grad in grads:
            grad.mul_(scale)
    return total_norm


def is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks (HF's ``_no_split_modules`` classes), the natural FSDP units."""
    names = set()
    for sub in module.modules():
        names |= set(getattr(sub, "_no_split_modules", None) or [])
    return [sub for sub in module.modules() if type(sub).__name__ in names]


def shard_module(
    module: torch.nn.Module, fsdp_config: Any = None, compute_dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """``fully_shard`` the blocks and the root when the world size is > 1 (on a device mesh of the module's device
    type; parameters gathered in ``compute_dtype``, gradients reduced in float32); the module itself otherwise."""
    if world_size() <= 1:
        return module
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    # the transformers model is the root, also under a peft wrapper: generate() and the LoRA paths call it directly,
    # and FSDP2 needs its root's forward to run first
    root = module.get_base_model() if hasattr(module, "get_base_model") else module
    device_type = next(module.parameters()).device.type
    kwargs: dict[str, Any] = {
        "mesh": init_device_mesh(device_type, (world_size(),)),
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32),
    }
    if fsdp_config.param_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in _blocks(root):
        fully_shard(block, **kwargs)
    fully_shard(root, **kwargs)
    return module


@contextlib.contextmanager
def full_parameters(module: torch.nn.Module) -> Iterator[None]:
    """All parameters gathered on every rank for the block, so that ranks can run different numbers of forward
    passes without collectives (generation: each rank stops at its own EOS)."""
    if world_size() <= 1:  # nothing is sharded
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.unshard()
        m.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for m in sharded:
            m.set_reshard_after_forward(True)
            m.reshard()


def full_model_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0 (CPU); an empty dict on the other ranks. All ranks must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_model_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load full weights (read on rank 0, broadcast) into a possibly sharded module; returns (missing, unexpected)."""
    if world_size() <= 1:
        return module.load_state_dict(state, strict=False)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    result = set_model_state_dict(
        module, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    )
    return list(result.missing_keys), list(result.unexpected_keys)


def full_optimizer_state_dict(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    if world_size() <= 1:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state_dict(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    if world_size() <= 1:
        optimizer.load_state_dict(state)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(
            module, optimizer, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        )


@contextlib.contextmanager
def optimizer_state_on_device(optimizer: torch.optim.Optimizer, offload: bool) -> Iterator[None]:
    """With ``offload`` (``optimizer_offload``), keep the optimizer state on CPU outside the update: it is moved
    to the parameters' device for the block and back to CPU after it."""
    if not offload:
        yield
        return
    device = next(p.device for group in optimizer.param_groups for p in group["params"])
    _move_optimizer_state(optimizer, device)
    try:
        yield
    finally:
        _move_optimizer_state(optimizer, torch.device("cpu"))


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
