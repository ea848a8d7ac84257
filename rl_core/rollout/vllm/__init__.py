"""The ``vllm`` rollout engine (GPU only, `pip install 'ppoflow[gpu]'`): see :mod:`.engine`. Registering it imports
nothing of vLLM: choosing it without vLLM installed is a clear error when the workers build it."""

from typing import Any

from rl_core.rollout.base import register_rollout_engine


@register_rollout_engine("vllm")
def _build_vllm_engine(model: Any, tokenizer: Any, rollout_config: Any, model_config: Any, compute_dtype: Any) -> Any:
    from rl_core.rollout.vllm.engine import VLLMRolloutEngine, require_cuda

    require_cuda(model)
    return VLLMRolloutEngine(model, tokenizer, rollout_config, model_config, compute_dtype)
