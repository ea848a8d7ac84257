"""The rollout engine interface, its registry, and the response post-processing every engine shares.

An engine turns a prompt batch into a sequence batch (verl's layout)::

    in : input_ids (B, P) left-padded, attention_mask (B, P), position_ids (B, P); per-sample non-tensors
    out: prompts (B', P), responses (B', R) right-padded with pad, input_ids = [prompts | responses],
         attention_mask, position_ids (B', P + R), response_mask (B', R): 1 up to and including the first
         stop token; optional rollout_log_probs (B', R)

with B' = B x n (each prompt's n samples adjacent; non-tensors repeated alongside). ``meta_info`` of the input
may carry ``validate`` (use ``val_kwargs``) and ``global_step`` (seeds sampling, so that a resumed run draws
the same samples).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from rl_core.batch import Batch


class RolloutEngine(Protocol):
    def generate_sequences(self, prompts: Batch) -> Batch: ...


ROLLOUT_ENGINES: dict[str, Callable[..., RolloutEngine]] = {}


def register_rollout_engine(name: str) -> Callable:
    def decorator(factory: Callable[..., RolloutEngine]) -> Callable[..., RolloutEngine]:
        ROLLOUT_ENGINES[name] = factory
        return factory

    return decorator


def build_rollout_engine(name: str, **kwargs: Any) -> RolloutEngine:
    if name not in ROLLOUT_ENGINES:
        raise ValueError(f"actor_rollout_ref.rollout.name={name!r} is not available; available: {sorted(ROLLOUT_ENGINES)}")
    return ROLLOUT_ENGINES[name](**kwargs)


def stop_token_ids(tokenizer: Any, rollout_config: Any) -> list[int]:
    """The tokenizer's EOS id(s) and ``rollout.stop_token_ids``: generation stops at (and keeps) any of them."""
    eos = tokenizer.eos_token_id
    return sorted({*(eos if isinstance(eos, list) else [eos]), *rollout_config.stop_token_ids})


def sampling_seed(rollout_config: Any, meta_info: dict[str, Any], part: int) -> int:
    """The seed of ``part`` (a chunk, a prompt) of a rollout: from ``rollout.seed`` and the global step, so that runs
    repeat and a re-run (resumed) step draws the same samples."""
    return (int(rollout_config.seed) * 1_000_003 + int(meta_info.get("global_step") or 0)) * 7919 + part


def response_mask_until_stop(responses: torch.Tensor, stop_token_ids: list[int]) -> torch.Tensor:
    """1 for each response token up to and including the first stop token, 0 after it."""
    is_stop = torch.isin(responses, torch.tensor(stop_token_ids, device=responses.device))
    stops_before = torch.cumsum(is_stop.long(), dim=-1) - is_stop.long()  # stop tokens strictly before t
    return (stops_before == 0).long()


def assemble_sequences(prompts: Batch, responses: torch.Tensor, response_mask: torch.Tensor, pad_token_id: int) -> Batch:
    """The sequence batch of the module doc from (repeated) prompts and their sampled responses."""
    prompt_ids = prompts.tensors["input_ids"]
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_token_id))
    prompt_positions = prompts.tensors["position_ids"]
    step = torch.arange(1, responses.shape[1] + 1, device=responses.device).unsqueeze(0)
    response_positions = prompt_positions[:, -1:] + step
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=-1),
        "attention_mask": torch.cat([prompts.tensors["attention_mask"], response_mask], dim=-1),
        "position_ids": torch.cat([prompt_positions, response_positions], dim=-1),
    }
    return Batch(tensors, dict(prompts.non_tensors), dict(prompts.meta_info))
