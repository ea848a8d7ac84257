"""Gradient checkpointing: each block's activations recomputed in the backward pass instead of kept from the forward
pass, which trades a second forward pass for memory. ``model.enable_gradient_checkpointing`` true / false turns it on
or off; null (ppoflow's default; verl's is true) turns it on only where a micro-batch's activations would not fit.

The estimate: a transformer layer keeps ~34 bytes per token and hidden unit for its backward pass in 16-bit
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", without the attention-score
term that SDPA and flash-attention do not keep), twice that in float32. A micro-batch of the section's token budget
(``*_max_token_len_per_gpu``) then keeps ``tokens x layers x hidden x 34 x bytes / 2``; it does not fit when that is
more than half of what the device has free after the gradients and Adam's two moments (3 x the parameters, float32).
"""

from __future__ import annotations

from pathlib import Path

import torch

ACTIVATION_BYTES_16BIT = 34  # per token, layer and hidden unit


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each block's activations in the backward pass (non-reentrant), with transformers' own switch under
    its current name (older transformers: ``gradient_checkpointing_enable``)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def activation_bytes(model: torch.nn.Module, tokens: int, dtype: torch.dtype) -> int:
    """What a micro-batch of ``tokens`` tokens keeps for the backward pass through ``model``'s layers (see the module
    doc)."""
    text = model.config.get_text_config()
    element_bytes = torch.finfo(dtype).bits // 8
    return tokens * text.num_hidden_layers * text.hidden_size * ACTIVATION_BYTES_16BIT * element_bytes // 2


def free_bytes(device: str) -> int:
    """Memory the device has free: CUDA's free memory, or the machine's available memory for the CPU."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    import psutil

    return psutil.virtual_memory().available


def needs_gradient_checkpointing(model: torch.nn.Module, tokens: int, dtype: torch.dtype, free: int) -> bool:
    """Whether a micro-batch of ``tokens`` would keep more activations than half of ``free`` bytes once the gradients
    and Adam's moments (3 x the parameters in float32) have theirs."""
    optimizer_bytes = 3 * 4 * sum(parameter.numel() for parameter in model.parameters())
    return activation_bytes(model, tokens, dtype) > (free - optimizer_bytes) / 2


def apply_gradient_checkpointing(
    model: torch.nn.Module, setting: bool | None, tokens: int | None, device: str, dtype: torch.dtype
) -> bool:
    """Turn gradient checkpointing on for ``model`` where ``setting`` says so; null: where a micro-batch of ``tokens``
    tokens (None: the model is not trained) would not fit on ``device``. Returns whether it is on."""
    if setting is None:
        setting = tokens is not None and needs_gradient_checkpointing(model, tokens, dtype, free_bytes(device))
    if setting:
        enable_gradient_checkpointing(model)
    return bool(setting)
