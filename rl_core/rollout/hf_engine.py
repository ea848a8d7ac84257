"""Rollout with Hugging Face ``generate``: batched sampling from left-padded prompts with a KV cache.

In the hybrid engine the model is the actor's own module, so rollout always samples from the live weights (no
weight sync needed on one device). Each prompt row gets one response (the controller repeats prompts ``n`` times).
Generation runs in chunks of ``generation_batch_size`` rows to bound memory; each chunk is seeded from
(``rollout.seed``, global step, rank, chunk) so that runs repeat and a resumed run draws the same samples.

Sampling uses the rollout settings only: ``generate`` fills every setting it is not given from the model's
``generation_config``, which the loading pipeline resets to plain defaults (a checkpoint's repetition penalty would
otherwise make the samples come from another distribution than the one trained). The sampling processors
(temperature, top-k, top-p, in transformers' order) are given to ``generate`` as its logits processors, followed,
with ``calculate_log_probs``, by one that records the sampled tokens' log-probs step by step from the scores the
sampler draws from, one (rows, vocabulary) tensor at a time.

``rollout.enforce_eager=false`` decodes with a static (pre-allocated) KV cache, which transformers compiles with
``torch.compile`` on CUDA (one compilation per prompt-length bucket, then CUDA-graph-friendly decode steps); on the
CPU it runs uncompiled. ``rollout.free_cache_engine`` returns the cached CUDA blocks of the KV cache to the allocator
after each rollout, for the update that follows.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rl_core.batch import Batch
from rl_core.batch_fields import ATTENTION_MASK, INPUT_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS, TEMPERATURE
from rl_core.rollout.base import (
    SamplingParams,
    assemble_sequences,
    data_parallel_rank,
    register_rollout_engine,
    response_mask_until_stop,
    sampling_params,
    sampling_seed,
    stop_token_ids,
)


def sampling_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """Temperature, top-k and top-p as logits processors (an identity setting adds none)."""
    if not params.do_sample:
        return []
    processors: list[LogitsProcessor] = []
    if params.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    return processors


class SampledTokenLogProbs(LogitsProcessor):
    """Records log p(sampled token) of each decoding step from the processed scores (the distribution sampled from):
    it runs after the sampling processors, and at step t + 1 reads the token chosen at step t."""

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None  # log-softmax of the last step's scores (rows, vocabulary)
        self.picked: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self.picked.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def log_probs(self, responses: torch.Tensor) -> torch.Tensor:
        """(rows, generated tokens): the log-probs of ``responses``, the tokens ``generate`` returned (it may have run
        steps it then undid: those are dropped)."""
        length = responses.shape[1]
        if self.previous is not None and len(self.picked) < length:
            self.picked.append(self.previous.gather(-1, responses[:, -1:]).squeeze(-1))
        return (
            torch.stack(self.picked[:length], dim=1)
            if length
            else responses.new_zeros(responses.shape, dtype=torch.float32)
        )


class HFRolloutEngine:
    """``generate_sequences`` on a transformers causal LM (see the module doc and :mod:`rl_core.rollout.base`)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, rollout_config: Any):
        self.model = model
        self.tokenizer = tokenizer
        self.config = rollout_config
        self.response_length = int(rollout_config.response_length)
        self.chunk_size = int(rollout_config.generation_batch_size)
        self.stop_token_ids = stop_token_ids(tokenizer, rollout_config)
        self.pad_token_id = tokenizer.pad_token_id

    @torch.no_grad()
    def generate_sequences(self, prompts: Batch) -> Batch:
        params = sampling_params(self.config, prompts.meta_info)
        rank = data_parallel_rank()
        was_training = self.model.training
        self.model.eval()
        try:
            pieces = [
                self._generate_chunk(chunk, params, sampling_seed(self.config, prompts.meta_info, rank, i))
                for i, chunk in enumerate(prompts.split(self.chunk_size))
            ]
        finally:
            self.model.train(was_training)
            if self.config.free_cache_engine and torch.cuda.is_available():
                torch.cuda.empty_cache()
        responses = torch.cat([p[0] for p in pieces])
        out = assemble_sequences(
            prompts, responses, response_mask_until_stop(responses, self.stop_token_ids), self.pad_token_id
        )
        if pieces[0][1] is not None:
            log_probs = torch.cat([p[1] for p in pieces])
            out.tensors[ROLLOUT_LOG_PROBS] = torch.where(
                out.tensors[RESPONSE_MASK].bool(), log_probs, torch.zeros_like(log_probs)
            )
        out.meta_info[TEMPERATURE] = params.temperature
        return out

    def _generate_chunk(
        self, chunk: Batch, params: SamplingParams, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_ids = chunk.tensors[INPUT_IDS]
        recorder = SampledTokenLogProbs() if self.config.calculate_log_probs else None
        device = next(self.model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            sequences = self.model.generate(
                input_ids=input_ids,
                attention_mask=chunk.tensors[ATTENTION_MASK],
                max_new_tokens=self.response_length,
                min_new_tokens=0,
                do_sample=params.do_sample,
                # generate's own temperature / top-k / top-p stay neutral (unset, it would take top_k=50 from its
                # global defaults): the processors below apply the rollout's, before the recorder
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                eos_token_id=self.stop_token_ids,
                pad_token_id=self.pad_token_id,
                use_cache=True,
                cache_implementation=None if self.config.enforce_eager else "static",
                disable_compile=bool(self.config.enforce_eager),
                logits_processor=LogitsProcessorList(sampling_processors(params) + ([recorder] if recorder else [])),
            )
        responses = sequences[:, input_ids.shape[1] :]
        pad = self.response_length - responses.shape[1]
        log_probs = None
        if recorder is not None:
            log_probs = torch.nn.functional.pad(recorder.log_probs(responses), (0, pad), value=0.0)
        responses = torch.nn.functional.pad(responses, (0, pad), value=self.pad_token_id)
        return responses, log_probs


@register_rollout_engine("hf")
def _build_hf_engine(model: torch.nn.Module, tokenizer: Any, rollout_config: Any, **_: Any) -> HFRolloutEngine:
    """The HF engine generates with the actor's module itself, in the worker's autocast: it needs no model config."""
    return HFRolloutEngine(model, tokenizer, rollout_config)
