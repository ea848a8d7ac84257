"""Loading a Hugging Face checkpoint the way verl does, from a local folder only.

    tokenizer -> AutoConfig (+ override_config) -> model class detection -> from_pretrained (dtype)
    -> optional padding-free path -> optional gradient checkpointing -> optional LoRA (peft)

Model class detection: a config with ``auto_map`` names remote code, used only with ``trust_remote_code``;
otherwise the Hugging Face auto-class mappings are searched in order CausalLM, Vision2Seq, ImageTextToText.
``external_lib`` is imported first so that a user module can register its own classes with the auto classes.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from rl_core.models.folder import ModelLoadError, local_model_path

if TYPE_CHECKING:  # the modeling code imports in seconds: only the workers need it, when they load a model
    from transformers import PreTrainedModel


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
# (auto_map key, transformers auto class name) in the order they are tried; classes missing from this
# transformers release (AutoModelForVision2Seq was folded into ImageTextToText in v5) are skipped.
GENERATIVE_AUTO_CLASSES = (
    ("AutoModelForCausalLM", "AutoModelForCausalLM"),
    ("AutoModelForVision2Seq", "AutoModelForVision2Seq"),
    ("AutoModelForImageTextToText", "AutoModelForImageTextToText"),
)


def import_external_lib(module_name: str | None) -> None:
    """Import ``model.external_lib`` so that its custom model classes register themselves."""
    if not module_name:
        return
    try:
        importlib.import_module(module_name)
    except ImportError as error:
        raise ModelLoadError(f"model.external_lib={module_name!r} could not be imported ({error}); install it or fix the module name") from error


def load_tokenizer(path: str, trust_remote_code: bool = False, custom_chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, left-padded (prompts are left-padded for generation), with a pad token."""
    folder = local_model_path(path, "model.tokenizer_path")
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if custom_chat_template:
        tokenizer.chat_template = custom_chat_template
    return tokenizer


def load_hf_config(path: str, override_config: dict | None = None, trust_remote_code: bool = False) -> PretrainedConfig:
    """AutoConfig of the checkpoint with ``override_config`` applied (unknown keys are an error)."""
    folder = local_model_path(path)
    _check_remote_code(folder, trust_remote_code)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    for key, value in dict(override_config or {}).items():
        if not hasattr(config, key):
            raise ModelLoadError(f"model.override_config.{key}: {type(config).__name__} has no attribute {key!r}")
        setattr(config, key, value)
    return config


def _check_remote_code(folder: Path, trust_remote_code: bool) -> None:
    import json

    auto_map = json.loads((folder / "config.json").read_text()).get("auto_map")
    if auto_map and not trust_remote_code:
        raise ModelLoadError(
            f"{folder} ships its own model code (config.json auto_map: {sorted(auto_map)}); running it needs "
            f"model.trust_remote_code=true — only set that for checkpoints whose code you trust"
        )


def resolve_model_class(config: PretrainedConfig, trust_remote_code: bool = False) -> type[PreTrainedModel]:
    """The generative model class for ``config``: remote code from ``auto_map``, else the HF auto-class mappings."""
    auto_map = getattr(config, "auto_map", None) or {}
    for auto_map_key, auto_class_name in GENERATIVE_AUTO_CLASSES:
        if auto_map_key in auto_map:
            if not trust_remote_code:
                raise ModelLoadError(f"the model's {auto_map_key} is remote code ({auto_map[auto_map_key]}); set model.trust_remote_code=true to run it")
            return transformers.dynamic_module_utils.get_class_from_dynamic_module(auto_map[auto_map_key], config.name_or_path)
        auto_class = getattr(transformers, auto_class_name, None)
        if auto_class is not None and type(config) in auto_class._model_mapping:
            return auto_class._model_mapping[type(config)]
    raise ModelLoadError(
        f"architecture {type(config).__name__} (model_type={config.model_type!r}) is not a causal LM, Vision2Seq or "
        f"image-text-to-text model in transformers {transformers.__version__}; set model.external_lib to a module that "
        f"registers it, or model.trust_remote_code=true if the checkpoint ships its code"
    )


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ModelLoadError(f"model.dtype={name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_policy_tokenizer(model_config: Any) -> PreTrainedTokenizerBase:
    """The policy's tokenizer (``tokenizer_path``, else ``path``) with ``custom_chat_template`` applied: the dataset's
    prompts and the rollout use the same template."""
    return load_tokenizer(model_config.tokenizer_path or model_config.path, bool(model_config.trust_remote_code),
                          model_config.custom_chat_template)


def attention_implementation(device: str = "cpu", compute_dtype: torch.dtype = torch.float32) -> str:
    """``flash_attention_2`` (variable-length kernels: the padding-free forward skips padding entirely) on CUDA with
    half-precision compute when the ``flash_attn`` package is installed; PyTorch's SDPA otherwise."""
    if device == "cuda" and compute_dtype in (torch.bfloat16, torch.float16) and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_policy_model(model_config: Any, device: str = "cpu", compute_dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The actor/ref model and tokenizer described by an ``actor_rollout_ref.model`` config node (on the CPU; the
    attention kernels are chosen for the ``device`` and ``compute_dtype`` it will run in)."""
    path = model_config.path
    trust_remote_code = bool(model_config.trust_remote_code)
    import_external_lib(model_config.external_lib)
    tokenizer = load_policy_tokenizer(model_config)
    hf_config = load_hf_config(path, model_config.override_config, trust_remote_code)
    model_class = resolve_model_class(hf_config, trust_remote_code)
    model = model_class.from_pretrained(
        local_model_path(path), config=hf_config, dtype=torch_dtype(model_config.dtype),
        trust_remote_code=trust_remote_code, attn_implementation=attention_implementation(device, compute_dtype),
    )
    if model_config.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer
