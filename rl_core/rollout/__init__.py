"""Rollout engines: prompts in, responses (+ masks, positions, optional log-probs) out. See :mod:`.base`."""

from rl_core.rollout import (
    hf_engine,  # noqa: F401  (registers "hf")
    vllm,  # noqa: F401  (registers "vllm"; vLLM itself is imported only when it is built)
)
from rl_core.rollout.base import ROLLOUT_ENGINES, RolloutEngine, build_rollout_engine, register_rollout_engine

__all__ = ["ROLLOUT_ENGINES", "RolloutEngine", "build_rollout_engine", "register_rollout_engine"]
