"""A vision-language model's keyword arguments for a batch of rows, from each row's ``multi_modal_inputs`` (the
processor's tensors of its prompt, :meth:`rl_core.data.dataset.RLDataset.vision_inputs`).

Two kinds of tensors, told apart by their shape:

* per image (2-D or more: ``pixel_values``, ``image_grid_thw``, ``image_sizes``): the rows' tensors concatenated in
  row order, as the processor batches them;
* per prompt token (1-D: ``mm_token_type_ids``): laid over the batch's ``input_ids`` at each row's first real tokens
  (the prompt's, whatever padding comes before, responses and turns after), 0 elsewhere.

Such a model computes its positions itself (Qwen2-VL's 3-D rotary positions from the image grid and the attention
mask), so batches with images run padded, without ``position_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def vision_model_inputs(
    rows: Sequence[dict[str, torch.Tensor] | None] | None, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The model's multimodal keyword arguments for ``input_ids`` / ``attention_mask`` (B, T) whose row i's prompt
    has ``rows[i]`` (None: no images); empty when no row has images."""
    if rows is None or all(not inputs for inputs in rows):
        return {}
    device = input_ids.device
    per_token: dict[str, torch.Tensor] = {}
    per_image: dict[str, list[torch.Tensor]] = {}
    for row, inputs in enumerate(rows):
        if not inputs:
            continue
        real = attention_mask[row].nonzero().squeeze(-1)
        for key, value in inputs.items():
            if value.dim() == 1:
                full = per_token.setdefault(key, torch.zeros(input_ids.shape, dtype=value.dtype, device=device))
                full[row, real[: len(value)]] = value.to(device)
            else:
                per_image.setdefault(key, []).append(value)
    return {**per_token, **{key: torch.cat(values).to(device) for key, values in per_image.items()}}


def is_vision_language(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the model a LoRA wrapper holds) takes images: its config has a vision tower's."""
    config = getattr(model, "config", None)
    return getattr(config, "vision_config", None) is not None


# the parts of a vision-language model that see the images: Qwen2-VL's `visual` (with its merger), LLaVA's
# `vision_tower` and `multi_modal_projector`, others' `vision_model`
VISION_MODULES = ("visual", "vision_tower", "vision_model", "multi_modal_projector")
# peft's exclude_modules for LoRA on the language part only (a regex over module names)
VISION_LORA_EXCLUDE = r".*\b(" + "|".join(VISION_MODULES) + r")\b.*"


def vision_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that see the images (outermost ones only)."""
    found: list[str] = []
    for name, _ in model.named_modules():
        if name.split(".")[-1] in VISION_MODULES and not any(name.startswith(f"{outer}.") for outer in found):
            found.append(name)
    return [model.get_submodule(name) for name in found]


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Stop training the image side of ``model`` (verl's ``actor.freeze_vision_tower``); returns how many parameters
    were frozen."""
    frozen = 0
    for module in vision_modules(model):
        for parameter in module.parameters():
            frozen += parameter.numel() if parameter.requires_grad else 0
            parameter.requires_grad_(False)
    return frozen


def placeholder_token_ids(model: torch.nn.Module) -> list[int]:
    """The ids that stand for image (and video) features in a vision-language model's input (Qwen's
    ``<|image_pad|>``, LLaVA's ``<image>``): never sampled (a response holding one would not match the images' features
    in the forward pass), so their probability is 0 in the rollout and in the log-probs alike; empty for a text-only
    model."""
    if not is_vision_language(model):
        return []
    config = model.config
    names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
    return sorted({int(value) for name in names if isinstance(value := getattr(config, name, None), int)})


# a placeholder's logit: finite, so that its probability underflows to exactly 0 and the entropy's p log p stays 0
SUPPRESSED_LOGIT = -1.0e4


def without_placeholders(logits: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """``logits`` (..., vocabulary) with the ``token_ids`` columns set to SUPPRESSED_LOGIT (out of place)."""
    if not token_ids:
        return logits
    ids = torch.tensor(token_ids, device=logits.device)
    return logits.index_fill(-1, ids, SUPPRESSED_LOGIT)
