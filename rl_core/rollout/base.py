"""The rollout engine interface, its registry, and what every engine shares: sampling settings, seeds, stop tokens
and the response layout.

An engine turns a prompt batch into a sequence batch (verl's layout), **one response per prompt row** (the controller
repeats each prompt ``rollout.n`` times before dispatch, as verl does, so data-parallel padding stays 1:1)::

    in : input_ids (B, P) left-padded, attention_mask (B, P), position_ids (B, P); per-sample non-tensors
    out: prompts (B, P), responses (B, R) right-padded with pad, input_ids = [prompts | responses],
         attention_mask, position_ids (B, P + R), response_mask (B, R): 1 up to and including the first
         stop token; rollout_log_probs (B, R) with ``rollout.calculate_log_probs``

``meta_info`` of the input may carry ``validate`` (sample with ``val_kwargs``), ``greedy`` (ReMax's baseline) and
``global_step`` (seeds sampling, so that a resumed run draws the same samples). Engines sample with the rollout
settings only: a checkpoint's own generation defaults (a repetition penalty, ...) never apply, so the samples come
from the distribution whose log-probs are trained.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rl_core.batch import Batch
from rl_core.batch_fields import (
    ATTENTION_MASK,
    GLOBAL_STEP,
    GREEDY,
    INPUT_IDS,
    POSITION_IDS,
    PROMPTS,
    RESPONSE_MASK,
    RESPONSES,
    VAL_KWARGS,
    VALIDATE,
)


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
        raise ValueError(
            f"actor_rollout_ref.rollout.name={name!r} is not available; available: {sorted(ROLLOUT_ENGINES)}"
        )
    return ROLLOUT_ENGINES[name](**kwargs)


def stop_token_ids(tokenizer: Any, rollout_config: Any) -> list[int]:
    """The tokenizer's EOS id(s) and ``rollout.stop_token_ids``: generation stops at (and keeps) any of them."""
    eos = tokenizer.eos_token_id
    return sorted({*(eos if isinstance(eos, list) else [eos]), *rollout_config.stop_token_ids})


@dataclass(frozen=True)
class SamplingParams:
    """How one response is drawn: ``do_sample`` False is greedy (argmax, temperature 1 for the log-probs)."""

    do_sample: bool
    temperature: float
    top_p: float
    top_k: int  # <= 0: no top-k


GREEDY_SAMPLING = SamplingParams(do_sample=False, temperature=1.0, top_p=1.0, top_k=-1)


def sampling_params(rollout_config: Any, meta_info: dict[str, Any]) -> SamplingParams:
    """The settings of a rollout: greedy for ``meta_info['greedy']`` (ReMax's baseline); with ``meta_info['validate']``
    the ``meta_info['val_kwargs']`` the controller sends (an evaluation samples with its own) or else the config's
    ``val_kwargs``; else the rollout's own. A temperature of 0 is greedy."""
    if meta_info.get(GREEDY, False):
        return GREEDY_SAMPLING
    source = rollout_config
    if meta_info.get(VALIDATE, False):
        source = meta_info.get(VAL_KWARGS) or rollout_config.val_kwargs
    get = source.__getitem__ if isinstance(source, Mapping) else source.__getattribute__
    temperature = float(get("temperature"))
    if not (bool(get("do_sample")) and temperature > 0):
        return GREEDY_SAMPLING
    return SamplingParams(do_sample=True, temperature=temperature, top_p=float(get("top_p")), top_k=int(get("top_k")))


def data_parallel_rank() -> int:
    """This worker's rank in its group (0 without a process group)."""
    return (
        torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
    )


def sampling_seed(rollout_config: Any, meta_info: dict[str, Any], rank: int, part: int) -> int:
    """The seed of ``part`` (a chunk of rows, or one row) of data-parallel ``rank``'s share of a rollout: a 63-bit hash
    of (``rollout.seed``, the global step, rank, part), so that seeds never repeat across ranks, parts or steps, runs
    repeat, and a re-run (resumed) step draws the same samples."""
    key = f"{int(rollout_config.seed)}/{int(meta_info.get(GLOBAL_STEP) or 0)}/{rank}/{part}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def response_mask_until_stop(responses: torch.Tensor, stop_token_ids: list[int]) -> torch.Tensor:
    """1 for each response token up to and including the first stop token, 0 after it."""
    is_stop = torch.isin(responses, torch.tensor(stop_token_ids, device=responses.device))
    stops_before = torch.cumsum(is_stop.long(), dim=-1) - is_stop.long()  # stop tokens strictly before t
    return (stops_before == 0).long()


def assemble_sequences(
    prompts: Batch, responses: torch.Tensor, response_mask: torch.Tensor, pad_token_id: int
) -> Batch:
    """The sequence batch of the module doc from prompts and their sampled responses (one per row)."""
    prompt_ids = prompts.tensors[INPUT_IDS]
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_token_id))
    prompt_positions = prompts.tensors[POSITION_IDS]
    step = torch.arange(1, responses.shape[1] + 1, device=responses.device).unsqueeze(0)
    response_positions = prompt_positions[:, -1:] + step
    tensors = {
        PROMPTS: prompt_ids,
        RESPONSES: responses,
        RESPONSE_MASK: response_mask,
        INPUT_IDS: torch.cat([prompt_ids, responses], dim=-1),
        ATTENTION_MASK: torch.cat([prompts.tensors[ATTENTION_MASK], response_mask], dim=-1),
        POSITION_IDS: torch.cat([prompt_positions, response_positions], dim=-1),
    }
    return Batch(tensors, dict(prompts.non_tensors), dict(prompts.meta_info))
