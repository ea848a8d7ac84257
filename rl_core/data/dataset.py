"""verl-format RL datasets: parquet or jsonl rows -> tokenized, left-padded prompt batches.

A row::

    data_source   str                          picks the rule scorer (or is passed to a custom one)
    prompt        list of {"role", "content"}  chat messages (or a plain string: tokenized as raw text)
    ability       str                          optional
    reward_model  {"ground_truth": ..., ...}   what the scorer compares against
    agent_name    str                          optional: single_turn_agent or tool_agent (verl's agent loops)
    extra_info    dict                         optional, passed to the scorer; a multi-turn row's
                                               ``tools_kwargs`` ({tool: {create_kwargs, execute_kwargs,
                                               calc_reward_kwargs, release_kwargs}}) go to its tool instances

A row of a vision-language run also has images (``data.image_key``, verl's ``images`` column, one ``<image>``
placeholder per image in the prompt: :mod:`rl_core.data.images`): its prompt goes through the checkpoint's processor
(chat template, each placeholder expanded to the image's tokens), and its prompt batch carries the processor's
tensors for the model (``pixel_values``, the image grid, ...) per row in ``multi_modal_inputs`` and the decoded images
in ``multi_modal_data`` (verl's columns).

Prompts go through the tokenizer's chat template with the generation prompt appended; a plain-string prompt,
``data.use_chat_template=false``, or a tokenizer without a chat template (common for base models) tokenizes
the raw text. Prompts longer than ``max_prompt_length`` are dropped (``filter_overlong_prompts``), or cut
(``truncation`` left|right), or are an error (``truncation=error``). A malformed row is an error naming the
file, the row and the column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rl_core.batch import Batch
from rl_core.batch_fields import (
    AGENT_NAME,
    ATTENTION_MASK,
    DATA_SOURCE,
    EXTRA_INFO,
    INPUT_IDS,
    MULTI_MODAL_DATA,
    MULTI_MODAL_INPUTS,
    POSITION_IDS,
    RAW_PROMPT,
    REWARD_MODEL,
    UID,
)
from rl_core.data.images import encode_with_images, prompt_text, row_images
from rl_core.data.rows import DatasetError, read_rows, validate_row


class RLDataset:
    """Prompt rows of one or more files, tokenized once; ``collate(indices)`` makes a prompt :class:`Batch`."""

    def __init__(
        self,
        files: str | list[str],
        tokenizer: Any,
        data_config: Any,
        max_samples: int = -1,
        tools: list[dict] | None = None,
        processor: Any | None = None,
    ):
        """``tools``: the OpenAI function schemas of a multi-turn run's tools, which the chat template shows the policy
        (and which count towards ``max_prompt_length``); ``processor``: a vision-language checkpoint's
        (:mod:`rl_core.models.processor`), for rows with images."""
        self.tokenizer = tokenizer
        self.processor = processor
        self.image_key = data_config.image_key
        self.tools = tools or None
        self.prompt_key = data_config.prompt_key
        self.max_prompt_length = int(data_config.max_prompt_length)
        self.truncation = data_config.truncation
        if self.truncation not in ("error", "left", "right"):
            raise DatasetError(f"data.truncation={self.truncation!r}; choose error, left or right")
        self.use_chat_template = bool(data_config.use_chat_template) and tokenizer.chat_template is not None
        filter_overlong = bool(data_config.filter_overlong_prompts)
        self.rows: list[dict] = []
        self.prompt_ids: list[list[int]] = []
        self.images: dict[int, tuple[str, list]] = {}  # row -> (templated prompt, decoded images): rows with images
        self.num_filtered = 0
        for path in [files] if isinstance(files, (str, Path)) else list(files):
            for number, row in enumerate(read_rows(path)):
                where = f"{path}: row {number}"
                validate_row(row, where, self.prompt_key)
                images = row_images(row, self.image_key, where, Path(path).parent)
                if images:
                    text, ids = self.tokenize_with_images(row[self.prompt_key], images, where)
                else:
                    ids = self.tokenize_prompt(row[self.prompt_key])
                if len(ids) > self.max_prompt_length:
                    if filter_overlong:
                        self.num_filtered += 1
                        continue
                    if self.truncation == "error" or images:
                        raise DatasetError(
                            f"{where}: the prompt has {len(ids)} tokens > "
                            f"data.max_prompt_length={self.max_prompt_length}; raise max_prompt_length, set "
                            "data.filter_overlong_prompts=true"
                            + (" (a prompt with images is never cut)" if images else " or data.truncation=left|right")
                        )
                    ids = ids[-self.max_prompt_length :] if self.truncation == "left" else ids[: self.max_prompt_length]
                if images:
                    self.images[len(self.rows)] = (text, images)
                self.rows.append(row)
                self.prompt_ids.append(ids)
        if max_samples is not None and max_samples > 0:
            self.rows, self.prompt_ids = self.rows[:max_samples], self.prompt_ids[:max_samples]
            self.images = {row: found for row, found in self.images.items() if row < max_samples}
        if not self.rows:
            raise DatasetError(
                f"{files}: no usable rows ({self.num_filtered} filtered as longer than {self.max_prompt_length} tokens)"
            )

    def __len__(self) -> int:
        return len(self.rows)

    def tokenize_prompt(self, prompt: str | list[dict]) -> list[int]:
        if isinstance(prompt, str) or not self.use_chat_template:
            text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        else:
            text = self.tokenizer.apply_chat_template(
                list(prompt), tools=self.tools, add_generation_prompt=True, tokenize=False
            )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def tokenize_with_images(self, prompt: str | list[dict], images: list, where: str) -> tuple[str, list[int]]:
        """(templated text, token ids) of a prompt with images: the processor's chat template, each ``<image>``
        placeholder expanded to its image's tokens."""
        if self.processor is None:
            raise DatasetError(
                f"{where} has images ({self.image_key}) but the policy's checkpoint is a text-only model (no image "
                "processor in its folder); use a vision-language checkpoint, or rows without images"
            )
        text = prompt_text(self.processor, prompt, len(images), where, self.tools)
        return text, encode_with_images(self.processor, text, images)[0]

    def vision_inputs(self, index: int) -> dict[str, torch.Tensor] | None:
        """Row ``index``'s multimodal model inputs (:func:`rl_core.data.images.encode_with_images`), or None for a row
        without images."""
        if index not in self.images:
            return None
        return encode_with_images(self.processor, *self.images[index])[1]

    def collate(self, indices: list[int], uid_prefix: str = "") -> Batch:
        """Left-pad the prompts of ``indices`` to ``max_prompt_length``; uid = ``uid_prefix`` + row number."""
        pad_id = self.tokenizer.pad_token_id
        tensors = left_padded([self.prompt_ids[i] for i in indices], self.max_prompt_length, pad_id)
        rows = [self.rows[i] for i in indices]
        non_tensors = {
            DATA_SOURCE: [r["data_source"] for r in rows],
            REWARD_MODEL: [r["reward_model"] for r in rows],
            EXTRA_INFO: [r.get("extra_info") or {} for r in rows],
            "ability": [r.get("ability", "") for r in rows],
            RAW_PROMPT: [r[self.prompt_key] for r in rows],
            UID: [f"{uid_prefix}{i}" for i in indices],
            AGENT_NAME: [r.get("agent_name") or "" for r in rows],
        }
        if self.images:  # every batch of a dataset with images has the columns (None: a row without), so they concat
            non_tensors[MULTI_MODAL_INPUTS] = [self.vision_inputs(i) for i in indices]
            images = [self.images[i][1] if i in self.images else None for i in indices]
            non_tensors[MULTI_MODAL_DATA] = [{"image": found} if found else None for found in images]
        return Batch(tensors, non_tensors)


def left_padded(prompts: list[list[int]], width: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Prompt token lists as a prompt batch's tensors: ``input_ids`` left-padded to ``width`` with ``pad_id``, their
    ``attention_mask`` and ``position_ids`` (0 at the first real token)."""
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)
    return {INPUT_IDS: input_ids, ATTENTION_MASK: attention_mask, POSITION_IDS: position_ids}
