"""LoRA adapters with peft: a new adapter (``lora_rank`` > 0) or an existing one (``lora_adapter_path``).

With LoRA the reference policy needs no second copy of the weights: it is the same module with the adapter
disabled (:func:`adapter_disabled`). peft is imported where it is used: the controller imports the workers'
modules without loading models.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rl_core.models.loading import ModelLoadError
from rl_core.models.multimodal import VISION_LORA_EXCLUDE, is_vision_language

CRITIC_HEADS = ("score", "classifier", "value_head")  # the module that turns a critic's hidden states into values


def uses_lora(model_config: Any) -> bool:
    return int(model_config.lora_rank) > 0 or bool(model_config.lora_adapter_path)


def apply_lora(model: torch.nn.Module, model_config: Any, task_type: str = "CAUSAL_LM") -> torch.nn.Module:
    """Wrap ``model`` with a trainable LoRA adapter as ``model_config`` asks; unchanged when LoRA is off (peft not
    imported then: ~230 modules, which a standby worker would import too)."""
    if not uses_lora(model_config):
        return model
    from peft import LoraConfig, PeftModel, get_peft_model

    adapter_path = model_config.lora_adapter_path
    if adapter_path:
        if not (Path(adapter_path).expanduser() / "adapter_config.json").is_file():
            raise ModelLoadError(
                f"model.lora_adapter_path={adapter_path!r}: no adapter_config.json there; point it at a saved LoRA "
                "adapter folder (a checkpoint's actor/ folder of a LoRA run)"
            )
        return PeftModel.from_pretrained(model, str(Path(adapter_path).expanduser()), is_trainable=True)
    target_modules = model_config.target_modules
    if not isinstance(target_modules, str):
        target_modules = list(target_modules)
    # a critic's head is new: it trains whole, and gets no adapter ("all-linear" would give it one too). peft's
    # token-classification task trains `score` / `classifier` whole; the value head ppoflow adds to bodies without a
    # token-classification class is named here.
    heads = [name for name in CRITIC_HEADS if isinstance(getattr(model, name, None), torch.nn.Module)]
    # a vision-language model: the adapter goes on the language part (model.exclude_modules chooses otherwise)
    exclude = heads or getattr(model_config, "exclude_modules", None)
    if not exclude and is_vision_language(model):
        exclude = VISION_LORA_EXCLUDE
    lora_config = LoraConfig(
        r=int(model_config.lora_rank),
        lora_alpha=int(model_config.lora_alpha),
        target_modules=target_modules,
        lora_dropout=0.0,
        bias="none",
        task_type=task_type,
        modules_to_save=heads or None,
        exclude_modules=exclude if isinstance(exclude, str) or exclude is None else list(exclude),
    )
    return get_peft_model(model, lora_config)


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block the model computes with its base weights (LoRA off); a no-op for a model without LoRA."""
    peft = sys.modules.get("peft")  # not imported: the model cannot be a PeftModel
    if peft is not None and isinstance(model, peft.PeftModel):
        with model.disable_adapter():
            yield
    else:
        yield
