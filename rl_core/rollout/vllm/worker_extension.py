"""Mixed into vLLM's worker (``LLM(worker_extension_cls=...)``): how the actor's weights get into the engine.

The engine runs in the actor's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uniprocess or external-launcher
executor), so ``LLM.collective_rpc("load_actor_weights", args=(weights,))`` hands this method the actor's tensors
themselves: nothing is serialised or copied on the way. vLLM's in-place reload (``model_runner.reload_weights``,
vLLM >= 0.2x) copies them into the engine's layout and processes them again as loading does (vLLM's CPU build repacks
linear weights for its kernels after loading: a plain ``model.load_weights`` into a processed model fails there);
older releases have only ``model.load_weights``.
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

        runner = self.model_runner  # type: ignore[attr-defined]
        if hasattr(runner, "reload_weights"):
            runner.reload_weights(weights_iterator=counted())
        else:
            runner.model.load_weights(weights=counted())
        return count
