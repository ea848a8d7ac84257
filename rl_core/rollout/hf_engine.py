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

A model of the families :data:`rl_core.rollout.kv_decode.KV_DECODE_MODEL_TYPES` (Llama, Mistral, Qwen2, Qwen3,
Phi-3, Gemma 1-3, Mixtral, Qwen3-MoE) is sampled by :func:`rl_core.rollout.kv_decode.kv_generate`, a decoding loop
over the model's own layers and a pre-allocated KV cache that computes what ``generate`` would, in 52-64 % of its
time on small models; other models, vision-language ones included, by ``generate``. On CUDA,
``rollout.enforce_eager=false`` leaves every model to ``generate`` with a static KV cache, which transformers
compiles with ``torch.compile`` (one compilation per prompt-length bucket, then CUDA-graph-friendly decode steps).
``rollout.free_cache_engine`` returns the cached CUDA blocks of the KV cache to the allocator after each rollout,
for the update that follows.

A vision-language model's prompts come with their images (the prompt batch's ``multi_modal_inputs``, a context's
``vision``: :mod:`rl_core.models.multimodal`), given to ``generate`` with the padded contexts; its image placeholder
tokens are never sampled.

With partial rollout (``newer_weights`` set: :mod:`rl_core.rollout.partial`) a ``generate_tokens`` call (a chunk
of a single-turn rollout, a batch of multi-turn turns) stops after the token at which the actor offers newer weights;
they are taken and the unfinished rows continue, each segment seeded from the call's seed and its number.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rl_core.batch import Batch
from rl_core.batch_fields import MULTI_MODAL_INPUTS, TEMPERATURE
from rl_core.models.multimodal import placeholder_token_ids, vision_model_inputs, without_placeholders
from rl_core.rollout.base import (
    SamplingParams,
    TokenSample,
    assemble_samples,
    continuation_seed,
    cut_at_stop,
    data_parallel_rank,
    prompt_contexts,
    register_rollout_engine,
    sampling_params,
    sampling_seed,
    stop_token_ids,
)
from rl_core.rollout.kv_decode import kv_decodable, kv_generate
from rl_core.rollout.partial import NewerWeights


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


class SuppressPlaceholders(LogitsProcessor):
    """A vision-language model's image placeholder ids are never sampled (:func:`without_placeholders`)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return without_placeholders(scores, self.token_ids)


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


class StopForNewerWeights(StoppingCriteria):
    """Ends a ``generate`` call (every row) after the token at which newer weights are offered; ``fired`` says
    whether it did."""

    def __init__(self, newer_weights: NewerWeights) -> None:
        self.newer_weights, self.fired = newer_weights, False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        self.fired = self.fired or self.newer_weights.waiting()
        return torch.full((input_ids.shape[0],), self.fired, dtype=torch.bool, device=input_ids.device)


class HFRolloutEngine:
    """``generate_sequences`` on a transformers causal LM (see the module doc and :mod:`rl_core.rollout.base`), built
    on the token primitive ``generate_tokens`` that multi-turn rollouts use too."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, rollout_config: Any):
        self.model = model
        self.tokenizer = tokenizer
        self.config = rollout_config
        self.response_length = int(rollout_config.response_length)
        self.chunk_size = int(rollout_config.generation_batch_size)
        self.stop_token_ids = stop_token_ids(tokenizer, rollout_config)
        self.pad_token_id = tokenizer.pad_token_id
        self.placeholders = placeholder_token_ids(model)  # a vision-language model's: never sampled
        self.newer_weights: NewerWeights | None = None  # partial rollout (set by a rollout worker of its own)

    @contextlib.contextmanager
    def rollout(self, meta_info: dict[str, Any]) -> Iterator[None]:
        """Around one rollout's ``generate_tokens`` calls: the model in eval mode, the CUDA cache freed after
        (``rollout.free_cache_engine``)."""
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)
            if self.config.free_cache_engine and torch.cuda.is_available():
                torch.cuda.empty_cache()

    @torch.no_grad()
    def generate_sequences(self, prompts: Batch) -> Batch:
        params = sampling_params(self.config, prompts.meta_info)
        rank = data_parallel_rank()
        contexts = prompt_contexts(prompts)
        vision = prompts.non_tensors.get(MULTI_MODAL_INPUTS)
        samples: list[TokenSample] = []
        with self.rollout(prompts.meta_info):
            for chunk, start in enumerate(range(0, len(contexts), self.chunk_size)):
                part = contexts[start : start + self.chunk_size]
                seed = sampling_seed(self.config, prompts.meta_info, rank, chunk)
                images = None if vision is None else list(vision[start : start + self.chunk_size])
                samples += self.generate_tokens(part, [self.response_length] * len(part), params, seed, images)
        out = assemble_samples(prompts, samples, self.response_length, self.pad_token_id)
        out.meta_info[TEMPERATURE] = params.temperature
        return out

    def generate_tokens(
        self,
        contexts: list[list[int]],
        max_new_tokens: list[int],
        params: SamplingParams,
        seed: int,
        vision: list[dict | None] | None = None,
    ) -> list[TokenSample]:
        """One continuation per context (see :class:`rl_core.rollout.base.TokenEngine`), at most ``max_new_tokens[i]``
        tokens; with partial rollout taking newer weights on the way (:meth:`_draw_taking_newer_weights`). ``vision``:
        each context's image inputs (its prompt's ``multi_modal_inputs``) for a vision-language model."""
        if self.newer_weights is None:
            return self._draw(contexts, max_new_tokens, params, seed, vision=vision)
        return self._draw_taking_newer_weights(contexts, max_new_tokens, params, seed, vision)

    def _draw_taking_newer_weights(
        self,
        contexts: list[list[int]],
        max_new_tokens: list[int],
        params: SamplingParams,
        seed: int,
        vision: list[dict | None] | None = None,
    ) -> list[TokenSample]:
        """Partial rollout: drawn until newer weights are offered, which are then taken, the unfinished rows going on
        (context + tokens so far) in the next segment; each token tagged with the version that sampled it. Nothing
        offered: the same samples as without partial rollout."""
        samples = [TokenSample([], [] if self.config.calculate_log_probs else None, "length", []) for _ in contexts]
        rows, segment = list(range(len(contexts))), 0
        while rows:
            version, stop = self.newer_weights.held(), StopForNewerWeights(self.newer_weights)
            drawn = self._draw(
                [contexts[row] + samples[row].token_ids for row in rows],
                [max_new_tokens[row] - len(samples[row].token_ids) for row in rows],
                params,
                continuation_seed(seed, segment),
                stopping=stop,
                vision=None if vision is None else [vision[row] for row in rows],
            )
            for row, part in zip(rows, drawn):
                sample = samples[row]
                sample.token_ids += part.token_ids
                sample.versions += [version] * len(part.token_ids)
                sample.finish_reason = part.finish_reason
                if sample.log_probs is not None:
                    sample.log_probs += part.log_probs
            if not stop.fired:
                break
            self.newer_weights.take()
            rows = [
                r for r in rows if samples[r].finish_reason != "stop" and len(samples[r].token_ids) < max_new_tokens[r]
            ]
            segment += 1
        return samples

    @torch.no_grad()
    def _draw(
        self,
        contexts: list[list[int]],
        max_new_tokens: list[int],
        params: SamplingParams,
        seed: int,
        stopping: StoppingCriteria | None = None,
        vision: list[dict | None] | None = None,
    ) -> list[TokenSample]:
        """One continuation per context: the contexts are left-padded to one tensor as wide as the longest (not to
        data.max_prompt_length: the KV cache and attention would cover the padding too, ~25 % of generation's time),
        sampled together for the largest budget (or until ``stopping`` ends the call), and each row is cut at its
        first stop token and its own budget. ``vision``: each context's image inputs."""
        width = max(len(context) for context in contexts)
        device = next(self.model.parameters()).device
        input_ids = torch.full((len(contexts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, context in enumerate(contexts):
            input_ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
            attention_mask[row, width - len(context) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        recorder = SampledTokenLogProbs() if self.config.calculate_log_probs else None
        images = vision_model_inputs(vision, input_ids, attention_mask)
        processors = LogitsProcessorList(
            ([SuppressPlaceholders(self.placeholders)] if self.placeholders else [])
            + sampling_processors(params)
            + ([recorder] if recorder else [])
        )
        stopping_criteria = StoppingCriteriaList([stopping] if stopping else [])
        budget = max(max_new_tokens)
        if self._kv_decodes(images, width + budget, device):
            sequences = kv_generate(
                self.model,
                input_ids,
                attention_mask,
                budget,
                params.do_sample,
                processors,
                stopping_criteria,
                self.stop_token_ids,
                self.pad_token_id,
                generator=torch.Generator(device).manual_seed(seed),
            )
        else:
            sequences = self._generate(
                input_ids, attention_mask, budget, params, processors, stopping_criteria, seed, images
            )
        generated = sequences[:, width:]
        log_probs = recorder.log_probs(generated).tolist() if recorder is not None else None
        samples = []
        for row, tokens in enumerate(generated.tolist()):
            sample = cut_at_stop(tokens, self.stop_token_ids, max_new_tokens[row])
            if log_probs is not None:
                sample.log_probs = log_probs[row][: len(sample.token_ids)]
            samples.append(sample)
        return samples

    def _generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        budget: int,
        params: SamplingParams,
        processors: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        seed: int,
        images: dict[str, Any],
    ) -> torch.Tensor:
        """``generate`` from the padded contexts, seeded with ``seed`` (the global generator forked for the call)."""
        device = input_ids.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            return self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=budget,
                min_new_tokens=0,
                do_sample=params.do_sample,
                # generate's own temperature / top-k / top-p stay neutral (unset, it would take top_k=50 from its
                # global defaults): the processors apply the rollout's, before the recorder
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                eos_token_id=self.stop_token_ids,
                pad_token_id=self.pad_token_id,
                use_cache=True,
                cache_implementation=None if self.config.enforce_eager else "static",
                disable_compile=bool(self.config.enforce_eager),
                logits_processor=processors,
                stopping_criteria=stopping_criteria,
                **images,
            )

    def _kv_decodes(self, images: dict[str, Any], length: int, device: torch.device) -> bool:
        """Whether :func:`kv_generate` draws (the model's family decodes over its own KV cache, no images) rather
        than ``generate``, which compiles a static-cache decode on CUDA when ``rollout.enforce_eager`` is false."""
        eager = bool(self.config.enforce_eager) or device.type != "cuda"
        return eager and not images and kv_decodable(self.model, length)


@register_rollout_engine("hf")
def _build_hf_engine(model: torch.nn.Module, tokenizer: Any, rollout_config: Any, **_: Any) -> HFRolloutEngine:
    """The HF engine generates with the actor's module itself, in the worker's autocast: it needs no model config."""
    return HFRolloutEngine(model, tokenizer, rollout_config)
