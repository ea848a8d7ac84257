"""The critic: a language model body with a scalar value per token.

Preferred: ``AutoModelForTokenClassification`` with ``num_labels=1`` (what verl does), which most decoder
architectures provide. For an architecture without a token-classification class, the causal LM's body
(``AutoModel``) gets a linear value head; the head is saved beside the body as ``value_head.safetensors``.
Either way ``critic(...).logits[..., 0]`` is the (batch, length) value estimate.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForTokenClassification, PreTrainedTokenizerBase

from rl_core.models.checkpointing import apply_gradient_checkpointing
from rl_core.models.loading import (
    NO_HUB_KERNELS,
    attention_implementation,
    check_model_vocabulary,
    import_external_lib,
    load_hf_config,
    load_tokenizer,
    local_model_path,
    torch_dtype,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueHeadModel(torch.nn.Module):
    """A transformer body + ``Linear(hidden, 1)``, for architectures with no token-classification class."""

    def __init__(self, body: PreTrainedModel):
        super().__init__()
        self.body = body
        self.config = body.config
        self.value_head = torch.nn.Linear(body.config.hidden_size, 1, dtype=body.dtype)
        torch.nn.init.zeros_(self.value_head.bias)
        torch.nn.init.normal_(self.value_head.weight, std=1.0 / (body.config.hidden_size + 1))

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.body.get_input_embeddings()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs: Any) -> SimpleNamespace:
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        ).last_hidden_state
        return SimpleNamespace(logits=self.value_head(hidden))

    def save_pretrained(
        self, folder: str | Path, state_dict: dict[str, torch.Tensor] | None = None, **kwargs: Any
    ) -> None:
        """The body as a HF checkpoint and the head as value_head.safetensors (from ``state_dict`` when given)."""
        state = state_dict if state_dict is not None else self.state_dict()
        body = {k[len("body.") :]: v for k, v in state.items() if k.startswith("body.")}
        self.body.save_pretrained(folder, state_dict=body, **kwargs)
        head = {
            k[len("value_head.") :]: v.detach().cpu().contiguous()
            for k, v in state.items()
            if k.startswith("value_head.")
        }
        save_file(head, str(Path(folder) / VALUE_HEAD_FILE))


def load_critic_model(
    model_config: Any, device: str = "cpu", compute_dtype: torch.dtype = torch.float32, train_tokens: int | None = None
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The critic described by a ``critic.model`` config node (token classification, else body + value head); on the
    CPU, with attention kernels for the ``device`` and ``compute_dtype`` it will run in. ``train_tokens``: its
    micro-batch token budget (gradient checkpointing's null setting weighs it)."""
    path = model_config.path
    trust_remote_code = bool(model_config.trust_remote_code)
    import_external_lib(model_config.external_lib)
    tokenizer = load_tokenizer((model_config.tokenizer_path or path), trust_remote_code)
    hf_config = load_hf_config(path, model_config.override_config, trust_remote_code)
    hf_config.num_labels = 1
    if "classifier_dropout" not in dict(model_config.override_config or {}):
        # a token-classification head falls back to dropout 0.1 when the config names none (as verl, 0): with it, the
        # critic's update would see other values than compute_values did, and two equal updates would differ
        hf_config.classifier_dropout = 0.0
    dtype = torch_dtype(model_config.dtype)
    folder = local_model_path(path, "critic.model.path")
    token_classification = (
        type(hf_config) in AutoModelForTokenClassification._model_mapping and not (folder / VALUE_HEAD_FILE).exists()
    )
    auto_class = AutoModelForTokenClassification if token_classification else AutoModel
    mapping = auto_class._model_mapping  # lazy: .get() would skip the loading its [] does
    known_class = mapping[type(hf_config)] if type(hf_config) in mapping else None  # noqa: SIM401 (None: remote code)
    attention = attention_implementation(known_class, device, compute_dtype, model_config.override_config)
    body = auto_class.from_pretrained(
        folder,
        config=hf_config,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        attn_implementation=attention,
        **NO_HUB_KERNELS,
    )
    if token_classification:
        model: torch.nn.Module = body
    else:
        model = ValueHeadModel(body)
        if (folder / VALUE_HEAD_FILE).exists():
            model.value_head.load_state_dict(load_file(str(folder / VALUE_HEAD_FILE)))
    check_model_vocabulary(model, tokenizer, "critic.model.path")
    apply_gradient_checkpointing(body, model_config.enable_gradient_checkpointing, train_tokens, device, compute_dtype)
    return model, tokenizer
