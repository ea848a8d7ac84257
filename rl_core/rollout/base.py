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

import contextlib
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
    ROLLOUT_LOG_PROBS,
    ROLLOUT_VERSION,
    VAL_KWARGS,
    VALIDATE,
)


class RolloutEngine(Protocol):
    def generate_sequences(self, prompts: Batch) -> Batch: ...


@dataclass
class TokenSample:
    """One continuation drawn by :meth:`TokenEngine.generate_tokens`: the sampled ids exactly as drawn, up to and
    including the first stop token or the row's budget; their log-probs (with ``rollout.calculate_log_probs``);
    ``finish_reason`` ``stop`` (ended on a stop token) or ``length`` (ran out of budget); with partial rollout
    (:mod:`rl_core.rollout.partial`) the version of the weights that sampled each token."""

    token_ids: list[int]
    log_probs: list[float] | None
    finish_reason: str
    versions: list[int] | None = None


class TokenEngine(RolloutEngine, Protocol):
    """An engine that also continues token contexts (the multi-turn primitive, :mod:`rl_core.agent.runner`).

    ``rollout(meta_info)`` is a context manager around one rollout's calls (the engine ready to sample, its memory
    released after); ``generate_tokens`` gives one continuation per context, at most ``max_new_tokens[i]`` tokens,
    sampled with ``params`` from the random stream ``seed`` (a :func:`sampling_seed`)."""

    def rollout(self, meta_info: dict[str, Any]) -> contextlib.AbstractContextManager: ...

    def generate_tokens(
        self, contexts: list[list[int]], max_new_tokens: list[int], params: SamplingParams, seed: int
    ) -> list[TokenSample]: ...


def with_images(vision: list[dict | None]) -> dict[str, Any]:
    """``generate_tokens``'s keyword for the contexts' image inputs (each context's prompt's ``multi_modal_inputs``, or
    None): given only when some context has images, so that an engine without image support is never passed any."""
    return {"vision": vision} if any(vision) else {}


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
    return _hash63(f"{int(rollout_config.seed)}/{int(meta_info.get(GLOBAL_STEP) or 0)}/{rank}/{part}")


def row_seed(seed: int, row: int) -> int:
    """The seed of row ``row`` of a chunk drawn from the random stream ``seed``, for an engine that seeds each request
    (vLLM): distinct across rows and chunks, the same whenever the chunk is drawn again."""
    return _hash63(f"{int(seed)}/{int(row)}")


def continuation_seed(seed: int, segment: int) -> int:
    """The seed of the ``segment``-th continuation (>= 1) of rows drawn from the random stream ``seed`` whose
    generation stopped early for newer weights (partial rollout); segment 0 is ``seed`` itself."""
    return seed if segment == 0 else _hash63(f"{int(seed)}/continued/{int(segment)}")


def _hash63(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def prompt_contexts(prompts: Batch) -> list[list[int]]:
    """Each prompt row's token ids without its left padding."""
    ids, mask = prompts.tensors[INPUT_IDS], prompts.tensors[ATTENTION_MASK].bool()
    return [ids[row][mask[row]].tolist() for row in range(len(prompts))]


def cut_at_stop(token_ids: list[int], stop_ids: list[int], budget: int) -> TokenSample:
    """``token_ids`` (one generated row) up to and including its first stop token, at most ``budget`` tokens long."""
    stops = set(stop_ids)
    for index, token in enumerate(token_ids[:budget]):
        if token in stops:
            return TokenSample(token_ids[: index + 1], None, "stop")
    return TokenSample(token_ids[:budget], None, "length")


def assemble_sequences(
    prompts: Batch,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    pad_token_id: int,
    response_attention_mask: torch.Tensor | None = None,
) -> Batch:
    """The sequence batch of the module doc from prompts and their sampled responses (one per row).
    ``response_attention_mask`` (default: ``response_mask``) marks the response's real tokens: a multi-turn response
    has real tokens the policy did not sample (tool output, mask 0) that are attended to all the same."""
    prompt_ids = prompts.tensors[INPUT_IDS]
    real = response_mask if response_attention_mask is None else response_attention_mask
    responses = torch.where(real.bool(), responses, torch.full_like(responses, pad_token_id))
    prompt_positions = prompts.tensors[POSITION_IDS]
    step = torch.arange(1, responses.shape[1] + 1, device=responses.device).unsqueeze(0)
    response_positions = prompt_positions[:, -1:] + step
    tensors = {
        PROMPTS: prompt_ids,
        RESPONSES: responses,
        RESPONSE_MASK: response_mask,
        INPUT_IDS: torch.cat([prompt_ids, responses], dim=-1),
        ATTENTION_MASK: torch.cat([prompts.tensors[ATTENTION_MASK], real.to(response_mask.dtype)], dim=-1),
        POSITION_IDS: torch.cat([prompt_positions, response_positions], dim=-1),
    }
    return Batch(tensors, dict(prompts.non_tensors), dict(prompts.meta_info))


def assemble_samples(
    prompts: Batch,
    samples: list[TokenSample],
    response_length: int,
    pad_token_id: int,
    masks: list[list[int]] | None = None,
) -> Batch:
    """The sequence batch of one response per prompt row from token lists (right-padded to ``response_length``):
    ``masks`` (default: all 1) marks which response tokens the policy sampled, the rest of each token list being real
    tokens it did not sample (tool output); ``rollout_log_probs`` when the samples carry log-probs, 0 where the mask
    is 0; ``rollout_version`` (rows, response_length) when they carry versions (partial rollout)."""
    rows = len(samples)
    responses = torch.full((rows, response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, response_length), dtype=torch.long)
    attention = torch.zeros((rows, response_length), dtype=torch.long)
    log_probs = torch.zeros((rows, response_length), dtype=torch.float32)
    for row, sample in enumerate(samples):
        length = len(sample.token_ids)
        responses[row, :length] = torch.tensor(sample.token_ids, dtype=torch.long)
        attention[row, :length] = 1
        response_mask[row, :length] = torch.tensor(masks[row], dtype=torch.long) if masks is not None else 1
        if sample.log_probs is not None:
            log_probs[row, :length] = torch.tensor(sample.log_probs, dtype=torch.float32)
    device = prompts.tensors[INPUT_IDS].device
    out = assemble_sequences(
        prompts, responses.to(device), response_mask.to(device), pad_token_id, attention.to(device)
    )
    if samples and samples[0].log_probs is not None:
        out.tensors[ROLLOUT_LOG_PROBS] = (log_probs.to(device) * response_mask.to(device)).float()
    if samples and samples[0].versions is not None:
        versions = torch.zeros((rows, response_length), dtype=torch.long)
        for row, sample in enumerate(samples):
            versions[row, : len(sample.versions)] = torch.tensor(sample.versions, dtype=torch.long)
        out.tensors[ROLLOUT_VERSION] = versions.to(device)
    return out
