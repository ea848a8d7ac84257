"""``RewardModelWorker``: scores responses with a sequence-classification reward model (``compute_rm_score``).

The score of a sequence is the reward model's output at the last valid token; it is placed on the last
response token of ``rm_scores`` (B, R). When the reward model has its own tokenizer
(``reward_model.model.input_tokenizer`` names the policy's), each prompt + response is decoded and re-encoded
with the reward model's chat template; otherwise the policy's token ids are scored directly.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForSequenceClassification

from rl_core.batch import Batch, response_ends
from rl_core.batch_fields import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    RAW_PROMPT,
    RESPONSE_MASK,
    RESPONSES,
    RM_SCORES,
)
from rl_core.device import on_worker_device
from rl_core.models.loading import (
    NO_HUB_KERNELS,
    load_hf_config,
    load_tokenizer,
    local_model_path,
    seeded_init,
    torch_dtype,
)
from rl_core.workers.dispatch import DP_COMPUTE, ONE_TO_ALL, dispatch


class RewardModelWorker:
    def __init__(self, config: Any, device: str = "cpu"):
        self.config = config
        self.device = device  # the model computes in its own reward_model.model.dtype
        self.model_config = config.model

    @dispatch(ONE_TO_ALL)
    @seeded_init
    def init_model(self) -> None:
        path = self.model_config.path
        trust_remote_code = bool(self.model_config.trust_remote_code)
        hf_config = load_hf_config(path, {}, trust_remote_code)
        hf_config.num_labels = 1
        self.module = (
            AutoModelForSequenceClassification.from_pretrained(
                local_model_path(path, "reward_model.model.path"),
                config=hf_config,
                dtype=torch_dtype(self.model_config.dtype),
                trust_remote_code=trust_remote_code,
                **NO_HUB_KERNELS,
            )
            .eval()
            .to(self.device)
        )
        self.tokenizer = load_tokenizer(path, trust_remote_code)
        self.tokenizer.padding_side = "right"
        input_tokenizer = self.model_config.input_tokenizer
        self.policy_tokenizer = load_tokenizer(input_tokenizer, trust_remote_code) if input_tokenizer else None

    def _sequence_scores(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """The scalar head applied to the hidden state of each row's last valid token."""
        hidden = self.module.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        last = (attention_mask * torch.arange(attention_mask.shape[1], device=attention_mask.device)).argmax(dim=-1)
        head = getattr(self.module, "score", None) or self.module.classifier
        return head(hidden[torch.arange(hidden.shape[0]), last]).squeeze(-1).float()

    def _retokenize(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = response_ends(batch.tensors[RESPONSE_MASK])
        texts = []
        for i in range(len(batch)):
            response = self.policy_tokenizer.decode(batch.tensors[RESPONSES][i, : lengths[i]], skip_special_tokens=True)
            prompt = batch.non_tensors[RAW_PROMPT][i]
            messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)) + [
                {"role": "assistant", "content": response}
            ]
            texts.append(
                self.tokenizer.apply_chat_template(messages, tokenize=False)
                if self.tokenizer.chat_template
                else "\n".join(m["content"] for m in messages)
            )
        encoded = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return encoded["input_ids"].to(self.device), encoded["attention_mask"].to(self.device)

    @dispatch(DP_COMPUTE)
    @on_worker_device
    @torch.no_grad()
    def compute_rm_score(self, batch: Batch) -> Batch:
        micro_batch_size = int(self.config.micro_batch_size_per_gpu)
        scores = []
        for micro in batch.split(micro_batch_size):
            if self.policy_tokenizer is not None:
                input_ids, attention_mask = self._retokenize(micro)
                scores.append(self._sequence_scores(input_ids, attention_mask, None))
            else:
                scores.append(
                    self._sequence_scores(
                        micro.tensors[INPUT_IDS], micro.tensors[ATTENTION_MASK], micro.tensors[POSITION_IDS]
                    )
                )
        response_mask = batch.tensors[RESPONSE_MASK]
        last = (response_ends(response_mask) - 1).clamp(min=0)
        rm_scores = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
        rm_scores[torch.arange(len(batch), device=last.device), last] = torch.cat(scores)
        return Batch({RM_SCORES: rm_scores})
