"""The ``vllm`` rollout engine: vLLM in the actor's process on the actor's GPU (verl's hybrid engine).

Per rollout::

    wake_up(weights) -> load the actor's current weights -> wake_up(kv_cache)
    -> generate one sample per prompt row from the token ids -> sleep(level 2: weights and KV cache freed)

so that between rollouts the whole GPU belongs to training (with ``free_cache_engine=false`` the engine stays awake
and keeps ``gpu_memory_utilization`` of the GPU). The weights are the actor module's own, renamed and LoRA-merged
by :func:`rl_core.rollout.vllm.weights.inference_weights`. A level-2 sleep discards them, so a sleeping engine loads
them at every rollout; an engine that stays awake reloads them only when ``meta_info["global_step"]`` changes (the
actor's weights change only in ``update_actor``, once per global step), and then drops its prefix cache: cached KV
blocks were computed with the older weights.

The controller repeats each prompt ``n`` times, so every row is one request (``n=1``) with a seed of its own; vLLM's
prefix cache shares the repeated prompts' KV. Output: the layout of :mod:`rl_core.rollout.base` (responses
right-padded, response_mask up to and including the first stop token), ``rollout_log_probs`` from vLLM's sampled-token
log-probs when ``calculate_log_probs``.

NEVER RUN: vLLM needs a CUDA GPU and its wheel pins its own torch, so it cannot be installed on this project's
development or CI machines. This module is written against vLLM's documented Python API (``LLM``, ``SamplingParams``,
``TokensPrompt``, ``sleep`` / ``wake_up(tags)``, ``collective_rpc`` with ``worker_extension_cls``, ``logprobs_mode``)
for ``vllm>=0.11``; what is tested without vLLM is the config translation (:mod:`.settings`), the weight-name mapping
(:mod:`.weights`) and the tensor-parallel slicing.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rl_core.batch import Batch
from rl_core.batch_fields import ATTENTION_MASK, INPUT_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS, TEMPERATURE
from rl_core.rollout.base import (
    assemble_sequences,
    data_parallel_rank,
    response_mask_until_stop,
    sampling_params,
    sampling_seed,
    stop_token_ids,
)
from rl_core.rollout.vllm.settings import engine_arguments, sampling_arguments, tensor_parallel_slice
from rl_core.rollout.vllm.weights import inference_weights


class VLLMNotAvailableError(ImportError):
    """rollout.name=vllm where vLLM is not installed (or there is no GPU)."""


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as error:
        raise VLLMNotAvailableError(
            f"actor_rollout_ref.rollout.name=vllm needs vLLM in the workers' environment ({error}); on a GPU machine "
            "run `pip install 'ppoflow[gpu]'`, or use actor_rollout_ref.rollout.name=hf"
        ) from error
    return vllm


def require_cuda(model: torch.nn.Module) -> None:
    if not torch.cuda.is_available() or next(model.parameters()).device.type != "cuda":
        raise VLLMNotAvailableError(
            "actor_rollout_ref.rollout.name=vllm runs on CUDA GPUs only (the actor is on the CPU); use "
            "actor_rollout_ref.rollout.name=hf, or trainer.device=cuda on a GPU cluster"
        )


class VLLMRolloutEngine:
    """vLLM in the actor's process (see the module doc); the factory (:mod:`rl_core.rollout.vllm`) checks for a GPU
    first."""

    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, rollout_config: Any, model_config: Any, compute_dtype: torch.dtype
    ):
        # the engine core in this process: weights by reference
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = import_vllm()
        self.vllm = vllm
        self.model = model
        self.config = rollout_config
        self.compute_dtype = compute_dtype
        self.response_length = int(rollout_config.response_length)
        self.stop_token_ids = stop_token_ids(tokenizer, rollout_config)
        self.pad_token_id = tokenizer.pad_token_id
        self.tp_size = int(rollout_config.tensor_model_parallel_size)
        self.sleeps = bool(rollout_config.free_cache_engine)
        self.llm = vllm.LLM(**engine_arguments(rollout_config, model_config, compute_dtype))
        self.loaded_step: int | None = None
        self._load_weights()
        if self.sleeps:
            self.llm.sleep(level=2)

    # ------------------------------------------------------------------ weights and memory
    def _load_weights(self) -> None:
        self.llm.collective_rpc("load_actor_weights", args=(inference_weights(self.model, self.compute_dtype),))

    def _wake_with_weights_of(self, step: int | None) -> None:
        if self.sleeps:
            self.llm.wake_up(tags=["weights"])
        # after a level-2 sleep the weights must be reloaded
        if step is None or step != self.loaded_step or self.sleeps:
            self._load_weights()
            self.loaded_step = step
            if not self.sleeps:  # an awake engine's prefix cache holds KV of the older weights
                self.llm.reset_prefix_cache()
        if self.sleeps:
            self.llm.wake_up(tags=["kv_cache"])

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_sequences(self, prompts: Batch) -> Batch:
        settings = sampling_params(self.config, prompts.meta_info)
        step = prompts.meta_info.get("global_step")
        group, counts = self._tensor_parallel_prompts(prompts)
        rank = data_parallel_rank()
        group_rank = rank - rank % self.tp_size  # the TP group's ranks send the same requests
        requests, params = [], []
        for i in range(len(group)):
            ids = group.tensors[INPUT_IDS][i][group.tensors[ATTENTION_MASK][i].bool()].tolist()  # left padding dropped
            requests.append({"prompt_token_ids": ids})
            seed = sampling_seed(self.config, prompts.meta_info, group_rank, i)
            params.append(
                self.vllm.SamplingParams(
                    **sampling_arguments(
                        settings, self.response_length, self.stop_token_ids, bool(self.config.calculate_log_probs), seed
                    )
                )
            )
        self._wake_with_weights_of(step)
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        finally:
            if self.sleeps:
                self.llm.sleep(level=2)
        if counts is not None:  # keep this TP rank's own prompts' samples
            rows = tensor_parallel_slice(counts, rank % self.tp_size)
            outputs, group = outputs[rows], prompts
        return self._to_batch(group, outputs, settings.temperature)

    def _to_batch(self, prompts: Batch, outputs: list[Any], temperature: float) -> Batch:
        """verl's layout from vLLM's outputs (one completion per prompt row)."""
        device = prompts.tensors[INPUT_IDS].device
        responses = torch.full((len(prompts), self.response_length), self.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros((len(prompts), self.response_length), dtype=torch.float32)
        for row, output in enumerate(outputs):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)[: self.response_length]
            responses[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            if completion.logprobs is not None:
                log_probs[row, : len(tokens)] = torch.tensor(
                    [step[token].logprob for token, step in zip(tokens, completion.logprobs)]
                )
        responses, log_probs = responses.to(device), log_probs.to(device)
        out = assemble_sequences(
            prompts, responses, response_mask_until_stop(responses, self.stop_token_ids), self.pad_token_id
        )
        if self.config.calculate_log_probs:
            out.tensors[ROLLOUT_LOG_PROBS] = log_probs * out.tensors[RESPONSE_MASK]
        out.meta_info[TEMPERATURE] = temperature
        return out

    def _tensor_parallel_prompts(self, prompts: Batch) -> tuple[Batch, list[int] | None]:
        """With TP > 1: the union of the prompts of this rank's TP group (every TP rank submits the same requests)
        and each rank's count; else the prompts themselves and None."""
        if self.tp_size <= 1:
            return prompts, None
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        first = rank - rank % self.tp_size
        gathered: list[Any] = [None] * world
        torch.distributed.all_gather_object(gathered, prompts.to("cpu"))
        group = gathered[first : first + self.tp_size]
        return Batch.concat(group).to(prompts.tensors[INPUT_IDS].device), [len(b) for b in group]
