"""Mixed into vLLM's GPU worker (``LLM(worker_extension_cls=...)``): how the actor's weights get into the engine.

The engine runs in the actor's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uniprocess or external-launcher
executor), so ``LLM.collective_rpc("load_actor_weights", args=(weights,))`` hands this method the actor's tensors
themselves: nothing is serialised or copied on the way, ``load_weights`` copies them into vLLM's own (fused) layout.
Written against vLLM's documented RLHF extension API; never run on this project's machines (no GPU, see the module
doc of :mod:`rl_core.rollout.vllm`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class ActorWeightLoader:
    def load_actor_weights(self, weights: Iterable[tuple[str, Any]]) -> int:
        """Load Hugging Face-named weights (an iterable, consumed once) into the engine's model; returns how many
        tensors were given."""
        count = 0

        def counted() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for item in weights:
                count += 1
                yield item

        self.model_runner.model.load_weights(weights=counted())  # type: ignore[attr-defined]
        return count
