"""Where a worker computes: its device (``cpu`` | ``cuda``), the dtype of its compute, and its CUDA memory figures.

* :func:`resolve_device` turns ``trainer.device`` (``auto`` | ``cpu`` | ``cuda``) into the device the workers use,
  from the GPUs the cluster has; ``cuda`` without one is a :class:`DeviceError` raised before any worker starts.
* Weights are stored in ``model.dtype`` (verl's ``model_dtype``: float32 master weights by default) and the forward
  and backward passes run in ``fsdp_config.dtype`` (``auto``: bfloat16 on CUDA, float32 on CPU) under
  :func:`autocast` — the usual mixed precision: bf16 matmuls, fp32 weights, gradients and optimizer state.
  Generation runs in ``rollout.dtype`` (:func:`rollout_dtype`; ``auto``: bf16 where it is the faster).
* :func:`on_worker_device` moves a stage's Batch to the worker's device on the way in and the result back to the
  CPU on the way out (what crosses Ray, checkpoints and the controller is always on the CPU).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from rl_core.batch import Batch
from rl_core.config import COMPUTE_DTYPE_NAMES, DEVICES

# HF generate of 64 rows x 16 tokens on an AMX CPU, float32 against bf16 autocast: hidden 128 (2 layers) 66 vs 74 ms,
# 256 (4 layers) 206 vs 153 ms, 512 (6 layers) 758 vs 459 ms (bench/README.md, "The rollout in bf16")
CPU_BF16_MIN_HIDDEN = 256
COMPUTE_DTYPES = {name: getattr(torch, dtype) if dtype else None for name, dtype in COMPUTE_DTYPE_NAMES.items()}


class DeviceError(RuntimeError):
    """The configured device does not exist where the workers run."""


def resolve_device(requested: str, gpus: float) -> str:
    """``cpu`` or ``cuda`` for ``trainer.device=requested`` on a cluster with ``gpus`` GPUs in all."""
    if requested not in DEVICES:
        raise DeviceError(f"trainer.device={requested!r}: choose one of {', '.join(DEVICES)}")
    if requested == "auto":
        return "cuda" if gpus > 0 else "cpu"
    if requested == "cuda" and gpus <= 0:
        raise DeviceError(
            "trainer.device=cuda but the cluster has no GPU (torch sees none, or the Ray nodes report GPU: 0); run on "
            "a GPU machine, or set trainer.device=cpu (or auto)"
        )
    return requested


def cuda_device_index(local_rank: int, visible_devices: int) -> int:
    """The index, among the GPUs this process sees, of the one a worker of ``local_rank`` on its node uses. Ray gives an
    actor with ``num_gpus=1`` only its own GPU (``CUDA_VISIBLE_DEVICES``): it is device 0 whatever its local rank. A
    process that sees every GPU of its node (torchrun) uses the one at its local rank."""
    if visible_devices == 1:
        return 0
    if 0 <= local_rank < visible_devices:
        return local_rank
    raise DeviceError(
        f"local rank {local_rank}, but this process sees {visible_devices} GPU(s) "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give each worker one GPU, or all "
        "of its node's"
    )


def compute_dtype(name: str, device: str) -> torch.dtype:
    """The dtype of forward/backward compute for ``fsdp_config.dtype=name`` on ``device`` (auto: bf16 on CUDA)."""
    return _named_dtype("fsdp_config.dtype", name, auto=torch.bfloat16 if device == "cuda" else torch.float32)


def rollout_dtype(name: str, device: str, hidden_size: int) -> torch.dtype:
    """The dtype generation computes in for ``rollout.dtype=name`` on ``device`` for a model ``hidden_size`` wide.
    auto: bf16 on CUDA; on a CPU, bf16 where it is the faster: the CPU has bf16 instructions (others emulate it) and
    the model is at least :data:`CPU_BF16_MIN_HIDDEN` wide (narrower, autocast's per-op cost outweighs the smaller
    matmuls)."""
    native_bf16 = device == "cuda" or (cpu_computes_bf16() and hidden_size >= CPU_BF16_MIN_HIDDEN)
    return _named_dtype("rollout.dtype", name, auto=torch.bfloat16 if native_bf16 else torch.float32)


def cpu_computes_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AMX tiles or AVX512_BF16), which torch's CPU kernels use."""
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def _named_dtype(key: str, name: str, auto: torch.dtype) -> torch.dtype:
    if name not in COMPUTE_DTYPES:
        raise DeviceError(f"{key}={name!r}: choose one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[name] or auto


def autocast(device: str, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Mixed-precision compute in ``dtype`` (a no-op for float32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=dtype)


def on_worker_device(method: Callable) -> Callable:
    """Decorate a worker stage: Batch arguments go to ``self.device``, the Batch result comes back on the CPU."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        args = tuple(a.to(self.device) if isinstance(a, Batch) else a for a in args)
        kwargs = {k: v.to(self.device) if isinstance(v, Batch) else v for k, v in kwargs.items()}
        result = method(self, *args, **kwargs)
        return result.to("cpu") if isinstance(result, Batch) else result

    return wrapper


def memory_metrics(device: str) -> dict[str, float]:
    """The worker process's peak CUDA memory since the last call (``perf/max_memory_allocated_gb``,
    ``perf/max_memory_reserved_gb``); the peaks are reset, so each step reports its own (the actor's update reports
    them: its peak covers every role fused in the process). On the CPU the process's peak resident memory since it
    started (``perf/max_rss_gb``: the kernel's high-water mark, not reset)."""
    if device != "cuda":
        import resource

        return {"perf/max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    metrics = {
        "perf/max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
        "perf/max_memory_reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
    }
    torch.cuda.reset_peak_memory_stats()
    return metrics


def synchronize(device: str) -> None:
    """Wait for the device's queued work (timings of CUDA work need it)."""
    if device == "cuda":
        torch.cuda.synchronize()
