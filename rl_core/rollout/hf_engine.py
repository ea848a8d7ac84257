"""Rollout with Hugging Face ``generate``: batched sampling from left-padded prompts with a KV cache.

In the hybrid engine the model is the actor's own module, so rollout always samples from the live weights
(no weight sync needed on one device). Generation runs in chunks of ``generation_batch_size`` sequences to
bound memory; sampling is seeded from (``rollout.seed``, global step, chunk) so that runs are repeatable and a
resumed run draws the same samples. Everything stays on the model's device.

``rollout.enforce_eager=false`` decodes with a static (pre-allocated) KV cache, which transformers compiles with
``torch.compile`` on CUDA (one compilation per prompt-length bucket, then CUDA-graph-friendly decode steps); on the
CPU it runs uncompiled. ``rollout.free_cache_engine`` returns the cached CUDA blocks of the KV cache to the allocator
after each rollout, for the update that follows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rl_core.batch import Batch
from rl_core.models.logprob import token_log_probs
from rl_core.rollout.base import assemble_sequences, register_rollout_engine, response_mask_until_stop, sampling_seed, stop_token_ids


def sampling_settings(rollout_config: Any, meta_info: dict[str, Any]) -> dict[str, Any]:
    """n, do_sample, temperature, top_p, top_k: when ``meta_info['validate']``, the ``meta_info['val_kwargs']`` the
    controller sends (an evaluation samples with its own) or else the config's ``val_kwargs``; one greedy response per
    prompt when ``meta_info['greedy']`` (ReMax's baseline); else the rollout's own settings."""
    if meta_info.get("greedy", False):
        return {"n": 1, "do_sample": False, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    source = rollout_config
    if meta_info.get("validate", False):
        source = meta_info.get("val_kwargs") or rollout_config.val_kwargs
    get = source.__getitem__ if isinstance(source, Mapping) else source.__getattribute__
    temperature = float(get("temperature"))
    do_sample = bool(get("do_sample")) and temperature > 0
    return {
        "n": int(get("n")),
        "do_sample": do_sample,
        "temperature": temperature if do_sample else 1.0,
        "top_p": float(get("top_p")),
        "top_k": int(get("top_k")),
    }


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
        settings = sampling_settings(self.config, prompts.meta_info)
        repeated = prompts.repeat_interleave(settings["n"]) if settings["n"] > 1 else prompts
        was_training = self.model.training
        self.model.eval()
        try:
            pieces = [self._generate_chunk(chunk, settings, sampling_seed(self.config, prompts.meta_info, i))
                      for i, chunk in enumerate(repeated.split(self.chunk_size))]
        finally:
            self.model.train(was_training)
            if self.config.free_cache_engine and torch.cuda.is_available():
                torch.cuda.empty_cache()
        responses = torch.cat([p[0] for p in pieces])
        out = assemble_sequences(repeated, responses, response_mask_until_stop(responses, self.stop_token_ids), self.pad_token_id)
        if pieces[0][1] is not None:
            out.tensors["rollout_log_probs"] = torch.cat([p[1] for p in pieces]) * out.tensors["response_mask"]
        out.meta_info["temperature"] = settings["temperature"]
        return out

    def _generate_chunk(self, chunk: Batch, settings: dict[str, Any], seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_ids = chunk.tensors["input_ids"]
        want_log_probs = bool(self.config.calculate_log_probs)
        device = next(self.model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            output = self.model.generate(
                input_ids=input_ids,
                attention_mask=chunk.tensors["attention_mask"],
                max_new_tokens=self.response_length,
                min_new_tokens=0,
                do_sample=settings["do_sample"],
                temperature=settings["temperature"] if settings["do_sample"] else None,
                top_p=settings["top_p"] if settings["do_sample"] else None,
                top_k=(settings["top_k"] if settings["top_k"] > 0 else 0) if settings["do_sample"] else None,
                eos_token_id=self.stop_token_ids,
                pad_token_id=self.pad_token_id,
                use_cache=True,
                cache_implementation=None if self.config.enforce_eager else "static",
                disable_compile=bool(self.config.enforce_eager),
                return_dict_in_generate=True,
                output_scores=want_log_probs,
            )
        responses = output.sequences[:, input_ids.shape[1]:]
        pad = self.response_length - responses.shape[1]
        log_probs = None
        if want_log_probs:
            scores = torch.stack(output.scores, dim=1)  # processed (temperature, top-k/p) logits per new token
            log_probs = token_log_probs(scores, responses)
            log_probs = torch.nn.functional.pad(log_probs, (0, pad), value=0.0)
        responses = torch.nn.functional.pad(responses, (0, pad), value=self.pad_token_id)
        return responses, log_probs


@register_rollout_engine("hf")
def _build_hf_engine(model: torch.nn.Module, tokenizer: Any, rollout_config: Any, **_: Any) -> HFRolloutEngine:
    """The HF engine generates with the actor's module itself, in the worker's autocast: it needs no model config."""
    return HFRolloutEngine(model, tokenizer, rollout_config)
