"""Supervised fine-tuning on (prompt, response) pairs with the loss on the model's own tokens only.

Used to warm-start the tiny demo policy so that it sometimes succeeds before RL (RL needs a non-zero reward
signal), and usable on any causal LM: ``run_sft(model, tokenizer, examples, ...)``.

loss = mean over response tokens of -log p(token | prompt, previous response tokens); the prompt is rendered
with the chat template and generation prompt exactly as the RL dataset renders it, and the response ends with
the tokenizer's EOS so that the model learns to stop. A multi-turn response (assistant and tool messages) is encoded
exactly as a multi-turn rollout builds it (:mod:`rl_core.agent.observations`): each assistant message + EOS is
trained, the tool answers and the template's glue are not. An example with images (a vision-language model's) renders
its prompt with the processor, as the RL dataset does (:mod:`rl_core.data.images`), and its forward takes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rl_core.agent.observations import ObservationEncoder
from rl_core.data.images import encode_with_images, prompt_text
from rl_core.models.logprob import token_log_probs
from rl_core.models.multimodal import vision_model_inputs


@dataclass
class SFTExample:
    prompt: str | list[dict]  # chat messages or raw text
    response: str | list[dict]  # the answer, or the messages after the prompt (assistant / tool)
    images: tuple = ()  # decoded images, one per <image> placeholder of the prompt (a processor is needed)


def encode_turns(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of the messages that follow a prompt: each assistant message's ids + EOS (mask 1, or 0 when the
    message has OpenAI's ``"weight": 0``: context, not a target), each run of tool messages as the template's delta
    (mask 0)."""
    encoder = ObservationEncoder(tokenizer, [tokenizer.eos_token_id], 10**9, 10**9, "middle")
    ids: list[int] = []
    mask: list[int] = []
    answers: list[str] = []
    for message in messages:
        if message["role"] == "tool":
            answers.append(message["content"])
            continue
        if answers:
            delta = encoder.encode(answers)
            ids, mask, answers = ids + delta, mask + [0] * len(delta), []
        turn = tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, mask = ids + turn, mask + [int(message.get("weight", 1))] * len(turn)
    return ids, mask


def encode_prompt(tokenizer, example: SFTExample, processor=None) -> tuple[list[int], dict | None]:
    """The prompt's ids as the RL dataset renders it and, for an example with images, their model inputs (else
    None)."""
    if example.images:
        if processor is None:
            raise ValueError("an SFT example with images needs the model's processor (run_sft(..., processor=...))")
        text = prompt_text(processor, example.prompt, len(example.images), "an SFT example")
        return encode_with_images(processor, text, list(example.images))
    if isinstance(example.prompt, str) or tokenizer.chat_template is None:
        prompt = example.prompt
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    else:
        text = tokenizer.apply_chat_template(list(example.prompt), add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"], None


def encode_example(
    tokenizer, example: SFTExample, processor=None, prompt_ids: list[int] | None = None
) -> tuple[list[int], list[int]]:
    """(input ids, loss mask) of prompt + response + EOS; the mask is 1 on response tokens and EOS (on the assistant
    messages' tokens and EOS of a multi-turn response). ``prompt_ids``: the prompt already encoded
    (:func:`encode_prompt`)."""
    if prompt_ids is None:
        prompt_ids = encode_prompt(tokenizer, example, processor)[0]
    if isinstance(example.response, list):
        response_ids, response_mask = encode_turns(tokenizer, example.response)
        return prompt_ids + response_ids, [0] * len(prompt_ids) + response_mask
    response_ids = tokenizer(example.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def collate(encoded: Sequence[tuple[list[int], list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids, attention_mask, position_ids and loss_mask."""
    length = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), length), dtype=torch.long)
    loss_mask = torch.zeros((len(encoded), length), dtype=torch.float32)
    for row, (ids, mask) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        loss_mask[row, : len(ids)] = torch.tensor(mask, dtype=torch.float32)
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=-1) - 1, min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
    }


def sft_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], vision: dict | None = None) -> torch.Tensor:
    """Token-mean negative log-likelihood of the loss-mask tokens; ``vision``: the rows' image inputs
    (:func:`rl_core.models.multimodal.vision_model_inputs`; the model then computes its positions)."""
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=None if vision else batch["position_ids"],
        use_cache=False,
        **(vision or {}),
    ).logits
    log_probs = token_log_probs(logits[:, :-1], batch["input_ids"][:, 1:])
    mask = batch["loss_mask"][:, 1:]
    return -(log_probs * mask).sum() / mask.sum().clamp(min=1)


def run_sft(
    model: torch.nn.Module,
    tokenizer,
    examples: Sequence[SFTExample],
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    processor=None,
) -> list[float]:
    """``steps`` AdamW steps on random batches of ``examples``; returns the loss of each step. ``processor``: a
    vision-language model's, for examples with images."""
    prompts = [encode_prompt(tokenizer, example, processor) for example in examples]  # the processor runs once each
    encoded = [encode_example(tokenizer, example, prompt_ids=ids) for example, (ids, _) in zip(examples, prompts)]
    images = [inputs for _, inputs in prompts]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        picked = torch.randint(0, len(encoded), (batch_size,), generator=generator).tolist()
        batch = collate([encoded[i] for i in picked], tokenizer.pad_token_id)
        vision = vision_model_inputs([images[i] for i in picked], batch["input_ids"], batch["attention_mask"])
        loss = sft_loss(model, batch, vision)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses
