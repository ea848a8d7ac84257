"""ppoflow's config translated into vLLM's engine arguments and sampling parameters: plain dicts, so that the
translation is tested without vLLM installed (the engine passes them to ``vllm.LLM`` / ``vllm.SamplingParams``)."""

from __future__ import annotations

from typing import Any

import torch

from rl_core.rollout.base import SamplingParams

VLLM_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
WORKER_EXTENSION = "rl_core.rollout.vllm.worker_extension.ActorWeightLoader"


def engine_arguments(
    rollout_config: Any, model_config: Any, compute_dtype: torch.dtype, on_cpu: bool = False
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for the hybrid engine.

    The engine starts with dummy weights (``load_format="dummy"``): the actor pushes its own right after (they may
    differ from the checkpoint: override_config, a LoRA adapter, a resumed run). It computes in the actor's compute
    dtype; sleep mode is on with ``free_cache_engine`` so that its memory goes back to training between rollouts
    (not ``on_cpu``: vLLM's CPU build refuses it).
    With ``tensor_model_parallel_size`` > 1 the engine joins the worker group's torch.distributed ranks
    (``external_launcher``: one TP rank per worker process) instead of starting processes of its own.
    """
    tp = int(rollout_config.tensor_model_parallel_size)
    max_model_len = rollout_config.max_model_len or int(rollout_config.prompt_length) + int(
        rollout_config.response_length
    )
    arguments: dict[str, Any] = {
        "model": str(model_config.path),
        "tokenizer": str(model_config.tokenizer_path or model_config.path),
        "trust_remote_code": bool(model_config.trust_remote_code),
        "dtype": VLLM_DTYPES[compute_dtype],
        "load_format": "dummy",
        "seed": int(rollout_config.seed),
        "tensor_parallel_size": tp,
        "distributed_executor_backend": "external_launcher" if tp > 1 else "uni",
        "gpu_memory_utilization": float(rollout_config.gpu_memory_utilization),
        "enforce_eager": bool(rollout_config.enforce_eager),
        "enable_sleep_mode": bool(rollout_config.free_cache_engine) and not on_cpu,
        "max_model_len": int(max_model_len),
        "max_num_seqs": int(rollout_config.max_num_seqs),
        "worker_extension_cls": WORKER_EXTENSION,
        # log-probs of the distribution that was sampled (after temperature / top-k / top-p), as the HF engine reports
        "logprobs_mode": "processed_logprobs",
        # sampling defaults are vLLM's own, never the checkpoint's generation_config.json (a repetition penalty there
        # would make the samples come from another distribution than the one trained)
        "generation_config": "vllm",
    }
    if model_config.override_config:
        arguments["hf_overrides"] = dict(model_config.override_config)
    return arguments


def sampling_arguments(
    params: SamplingParams, response_length: int, stop_token_ids: list[int], calculate_log_probs: bool, seed: int
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one prompt row: one sample (greedy = temperature 0 in vLLM) of
    at most ``response_length`` tokens, stopping at (and keeping) any stop token, with a seed of its own."""
    greedy = not params.do_sample
    return {
        "n": 1,
        "temperature": 0.0 if greedy else params.temperature,
        "top_p": 1.0 if greedy else params.top_p,
        "top_k": 0 if greedy or params.top_k <= 0 else params.top_k,  # 0 = no top-k
        "max_tokens": int(response_length),
        "min_tokens": 0,
        "stop_token_ids": list(stop_token_ids),
        "ignore_eos": False,
        "skip_special_tokens": False,
        "detokenize": False,
        "logprobs": 0 if calculate_log_probs else None,  # 0 = the sampled token's log-prob only
        "seed": int(seed),
    }


def tensor_parallel_slice(counts: list[int], tp_rank: int) -> slice:
    """Which of the gathered prompts are this TP rank's own: the ranks of a TP group generate for the union of their
    prompts (vLLM's TP ranks must see the same requests) and each keeps the rows it brought, in rank order."""
    start = sum(counts[:tp_rank])
    return slice(start, start + counts[tp_rank])
