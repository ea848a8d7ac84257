"""LoRA adapters with peft: a new adapter (``lora_rank`` > 0) or an existing one (``lora_adapter_path``).

With LoRA the reference policy needs no second copy of the weights: it is the same module with the adapter
disabled (:func:`adapter_disabled`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from rl_core.algos.config_access import config_get


def uses_lora(model_config: Any) -> bool:
    return int(config_get(model_config, "lora_rank", 0)) > 0 or bool(config_get(model_config, "lora_adapter_path"))


def apply_lora(model: torch.nn.Module, model_config: Any, task_type: str = "CAUSAL_LM") -> torch.nn.Module:
    """Wrap ``model`` with a trainable LoRA adapter as ``model_config`` asks; unchanged when LoRA is off."""
    adapter_path = config_get(model_config, "lora_adapter_path")
    if adapter_path:
        return PeftModel.from_pretrained(model, adapter_path, is_trainable=True)
    rank = int(config_get(model_config, "lora_rank", 0))
    if rank <= 0:
        return model
    target_modules = config_get(model_config, "target_modules", "all-linear")
    if not isinstance(target_modules, str):
        target_modules = list(target_modules)
    lora_config = LoraConfig(r=rank, lora_alpha=int(config_get(model_config, "lora_alpha", 16)), target_modules=target_modules,
                             lora_dropout=0.0, bias="none", task_type=task_type)
    return get_peft_model(model, lora_config)


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block the model computes with its base weights (LoRA off); a no-op for a model without LoRA."""
    if isinstance(model, PeftModel):
        with model.disable_adapter():
            yield
    else:
        yield
