"""The actor's weights as an inference engine loads them: Hugging Face checkpoint names, LoRA merged, full tensors.

vLLM's ``model.load_weights`` takes (name, tensor) pairs named as in the model's Hugging Face checkpoint (it fuses
q/k/v and gate/up itself, and skips a tied ``lm_head``). The actor's module differs from a checkpoint in three ways,
undone here without touching the module:

* a peft wrapper prefixes every name with ``base_model.model.`` and stores a LoRA layer's frozen weight as
  ``<layer>.base_layer.weight`` next to ``lora_A`` / ``lora_B``: the engine gets ``<layer>.weight`` =
  W + scaling * B @ A (the merged weight the policy computes with) and no adapter tensors;
* under FSDP2 the parameters are DTensors (shards): each is gathered whole. The worker calls this inside
  ``full_parameters``, where the module's parameters are the unsharded ones: reading them (``named_parameters``,
  not ``state_dict``, whose FSDP2 hook would gather every tensor again) costs nothing;
* the module's own dtype may be float32 master weights: tensors are cast to the engine's ``dtype``, one at a time as
  the engine takes them (a generator: no second full copy of the model is held).

Buffers are not sent: an LLM's persistent buffers (if any) are not weights vLLM loads.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

PEFT_PREFIX = "base_model.model."


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _lora_deltas(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{<layer name>.base_layer.weight: scaling * B @ A}`` for every LoRA layer with an active adapter."""
    from peft.tuners.lora import LoraLayer

    deltas = {}
    for name, layer in module.named_modules():
        if isinstance(layer, LoraLayer) and not getattr(layer, "merged", False):
            pieces = [layer.get_delta_weight(adapter) for adapter in layer.active_adapters if adapter in layer.lora_A]
            if pieces:
                deltas[f"{name}.base_layer.weight"] = sum(pieces[1:], pieces[0])
    return deltas


def checkpoint_name(name: str) -> str | None:
    """The Hugging Face checkpoint name of a parameter of the (possibly peft-wrapped) actor; None for adapter
    tensors."""
    if ".lora_" in name or ".modules_to_save." in name:
        return None
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def inference_weights(module: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every weight of ``module``, LoRA merged, gathered, cast to ``dtype``."""
    deltas = _lora_deltas(module) if hasattr(module, "peft_config") else {}
    for name, tensor in module.named_parameters():
        target = checkpoint_name(name)
        if target is None:
            continue
        tensor = _full(tensor)
        if name in deltas:
            tensor = tensor + _full(deltas[name]).to(tensor.dtype)
        yield target, tensor.to(dtype) if dtype is not None else tensor
