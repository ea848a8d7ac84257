"""A trainable model's checkpoint as the workers write and read it: weights (gathered from the FSDP shards) in
Hugging Face's safetensors layout, optimizer, LR scheduler and counters in ``state.safetensors`` (TRAINING_STATE_FILE).

Serialisation itself (safetensors files, no pickle) is :mod:`rl_core.checkpoint`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rl_core.checkpoint import TRAINING_STATE_FILE, load_state, save_model_weights, save_state
from rl_core.models.optim import apply_optim_settings
from rl_core.models.value_head import VALUE_HEAD_FILE, ValueHeadModel
from rl_core.workers.data_parallel import world_size
from rl_core.workers.fsdp import (
    full_model_state_dict,
    full_optimizer_state_dict,
    is_rank_zero,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)


def module_names_of_saved(model: torch.nn.Module) -> dict[str, str]:
    """{name in a saved checkpoint: name in ``model``'s state dict} where they differ: transformers 5 saves some
    architectures under their legacy names (Qwen2-VL's ``model.layers.*`` for the module's
    ``model.language_model.layers.*``, LLaVA's ``language_model.model.*``) and renames them back in
    ``from_pretrained``; here they are read by name. Only renamings are mapped (a conversion that merges or splits
    tensors is not: such weights then fail to fit, naming the keys)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers release without weight conversions saves the module's own names
        return {}
    state = model.state_dict()
    name_of: dict[int, str] = {}
    for name, tensor in state.items():
        name_of.setdefault(id(tensor), name)
    saved = revert_weight_conversion(model, dict(state))
    return {key: name_of[id(tensor)] for key, tensor in saved.items() if name_of.get(id(tensor), key) != key}


def load_model_weights(model: torch.nn.Module, folder: str | Path) -> None:
    """Load weights saved by :func:`save_model_weights` into ``model`` in place (full model or LoRA adapter),
    sharded or not."""
    folder = Path(folder)
    adapter = folder / "adapter_model.safetensors"
    if adapter.exists():
        adapter_state = load_file(str(adapter))
        if world_size() > 1:  # sharded: load by the module's own names, scattered from rank 0
            by_module_name = adapter_module_names(model, adapter_state)
            load_full_model_state_dict(model, by_module_name)
            return
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, adapter_state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"{adapter} does not fit this model: unexpected keys {unexpected[:5]}")
        return
    files = sorted(folder.glob("model*.safetensors"))  # model.safetensors or model-0000i-of-0000n.safetensors shards
    if not files:
        raise FileNotFoundError(f"{folder} holds no model*.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    if not isinstance(model, ValueHeadModel) and not set(state) <= set(model.state_dict()):
        renamed = module_names_of_saved(model)
        state = {renamed.get(name, name): tensor for name, tensor in state.items()}
    if isinstance(model, ValueHeadModel):
        state = {f"body.{k}": v for k, v in state.items()}
        state.update({f"value_head.{k}": v for k, v in load_file(str(folder / VALUE_HEAD_FILE)).items()})
    missing, unexpected = load_full_model_state_dict(model, state)
    if getattr(model.config, "tie_word_embeddings", False):  # the tied output layer is not saved separately
        missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{folder}: weights do not fit the model (missing {missing[:5]}, unexpected {unexpected[:5]})")


def adapter_module_names(model: torch.nn.Module, adapter_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A saved LoRA adapter's tensors under the names the peft model's state dict gives them: peft saves
    ``...q_proj.lora_A.weight`` for the module's ``...q_proj.lora_A.default.weight`` and ``...score.weight`` for a
    trained head's ``...score.modules_to_save.default.weight``. Every saved tensor must find its place."""
    adapter = model.active_adapter
    mapped: dict[str, torch.Tensor] = {}
    unplaced = set(adapter_state)
    for name in model.state_dict():
        if "lora_" in name:
            saved = name.replace(f".{adapter}", "")
        elif f".modules_to_save.{adapter}." in name:
            saved = name.replace(f".modules_to_save.{adapter}", "")
        else:
            continue
        if saved in adapter_state:
            mapped[name] = adapter_state[saved]
            unplaced.discard(saved)
    if unplaced:
        raise ValueError(f"the LoRA adapter does not fit this model: {sorted(unplaced)[:5]} have no place in it")
    return mapped


def save_trainable(
    folder: str | Path,
    module: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    extra: dict[str, Any],
) -> None:
    """A trainable model's checkpoint: weights in ``folder`` + optimizer, LR scheduler and ``extra`` in
    state.safetensors. Every rank must call it (sharded weights are gathered); rank 0 writes."""
    weights = full_model_state_dict(module) if world_size() > 1 else None
    optimizer_state = full_optimizer_state_dict(module, optimizer)
    if is_rank_zero():
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_model_weights(module, tokenizer, folder, weights)
        save_state(
            {"optimizer": optimizer_state, "lr_scheduler": lr_scheduler.state_dict(), "extra": extra},
            folder / TRAINING_STATE_FILE,
        )
    if world_size() > 1:
        torch.distributed.barrier()


def load_trainable(
    folder: str | Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any, optim_config: Any
) -> dict[str, Any]:
    """Restore what :func:`save_trainable` wrote (in place) and return its ``extra``; the optimizer's settings are then
    ``optim_config``'s (:func:`apply_optim_settings`: a resume under a new learning rate uses it). Every rank must
    call it."""
    folder = Path(folder)
    load_model_weights(module, folder)
    state = load_state(folder / TRAINING_STATE_FILE)
    load_full_optimizer_state_dict(module, optimizer, state["optimizer"])
    lr_scheduler.load_state_dict(state["lr_scheduler"])
    apply_optim_settings(optimizer, lr_scheduler, optim_config)
    return state["extra"]
