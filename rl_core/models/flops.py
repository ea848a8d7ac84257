"""Model FLOPs of a training pass and the model-FLOPs utilisation (MFU) they give on a GPU.

A dense transformer's training pass (forward + backward) over sequences of lengths L_i costs

    6 * N * sum_i L_i  +  12 * layers * (heads * head_dim) * sum_i L_i^2

with N the weights of every matrix multiply (each ``nn.Linear``, the output layer included even when tied to the
embedding; the embedding lookup itself is free): 2 FLOPs per weight and token forward, 4 backward. The second term
is attention's two matmuls (QK^T and AV, 2 * L^2 * heads * head_dim each forward), x3 for the backward, without
discounting the causal mask (the convention of verl's FLOPs counter and of the PaLM paper). A LoRA update is counted
as full fine-tuning.

MFU = FLOPs / (seconds * the GPU's dense peak for the compute dtype); only for half-precision compute on a GPU of
:data:`PEAK_TFLOPS` (elsewhere there is no meaningful peak and no MFU is reported).
"""

from __future__ import annotations

import time

import torch

from rl_core.device import synchronize

# dense (no sparsity) bf16/fp16 tensor-core peaks, TFLOP/s, by a substring of torch.cuda.get_device_name()
PEAK_TFLOPS = {
    "B200": 2250.0,
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A10": 125.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,
}


def matmul_weights(module: torch.nn.Module) -> int:
    """N: the weights of every ``nn.Linear`` of ``module`` (a tied output layer counts: its matmul runs)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def attention_width(module: torch.nn.Module) -> tuple[int, int]:
    """(layers, heads * head_dim) from the Hugging Face config of ``module`` (or of the model a wrapper holds)."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        inner = [
            m for m in module.modules() if m is not module and hasattr(getattr(m, "config", None), "num_hidden_layers")
        ]
        config = inner[0].config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(config.num_hidden_layers), int(config.num_attention_heads * head_dim)


def training_flops(module: torch.nn.Module, sequence_lengths: torch.Tensor) -> float:
    """The FLOPs of one forward + backward pass of ``module`` over sequences of the given lengths (module doc)."""
    lengths = sequence_lengths.double()
    layers, width = attention_width(module)
    return float(6 * matmul_weights(module) * lengths.sum() + 12 * layers * width * (lengths**2).sum())


def peak_flops(device: str, dtype: torch.dtype) -> float | None:
    """The dense peak FLOP/s of this process's GPU in ``dtype``; None on the CPU, in float32, or for an unknown GPU."""
    if device != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name()
    for key, tflops in sorted(PEAK_TFLOPS.items(), key=lambda item: -len(item[0])):  # "L40S" before "L40" before "L4"
        if key in name:
            return tflops * 1e12
    return None


def mfu(name: str, flops: float, seconds: float, device: str, dtype: torch.dtype) -> dict[str, float]:
    """``{"perf/mfu/<name>": flops / seconds / peak}`` where a peak is known (see :func:`peak_flops`); else empty."""
    peak = peak_flops(device, dtype)
    if peak is None or seconds <= 0:
        return {}
    return {f"perf/mfu/{name}": flops / seconds / peak}


def update_mfu(
    name: str,
    module: torch.nn.Module,
    attention_mask: torch.Tensor,
    epochs: int,
    started: float,
    device: str,
    dtype: torch.dtype,
) -> dict[str, float]:
    """:func:`mfu` of an update of ``module`` over the batch of ``attention_mask`` for ``epochs`` epochs, begun at
    ``time.perf_counter()`` = ``started`` (waits for the GPU's queued work first)."""
    synchronize(device)
    flops = training_flops(module, attention_mask.sum(-1)) * epochs
    return mfu(name, flops, time.perf_counter() - started, device, dtype)
