"""How a worker method's inputs are spread over the ranks of a worker group, declared on the method itself.

The decorator only records the mode (rl_core knows nothing of Ray); ``infra.dispatch`` implements it:

  ONE_TO_ALL  every rank gets the same arguments; the result is rank 0's
  DP_COMPUTE  the Batch argument is padded to a multiple of the world size and split, one shard per rank;
              the ranks' Batch results are concatenated and the padding removed (one output row per input row:
              generation gets its prompts already repeated ``n`` times), their metric dicts reduced
              (:func:`reduce_rank_metrics`)
  RANK_ZERO   only rank 0 runs the method
"""

from __future__ import annotations

from collections.abc import Callable

ONE_TO_ALL = "one_to_all"
DP_COMPUTE = "dp_compute"
RANK_ZERO = "rank_zero"
DISPATCH_ATTRIBUTE = "__ppoflow_dispatch__"


def dispatch(mode: str) -> Callable[[Callable], Callable]:
    """Mark a worker method with its dispatch mode."""
    if mode not in (ONE_TO_ALL, DP_COMPUTE, RANK_ZERO):
        raise ValueError(f"unknown dispatch mode {mode!r}")

    def decorator(method: Callable) -> Callable:
        setattr(method, DISPATCH_ATTRIBUTE, mode)
        return method

    return decorator


def dispatch_mode(method: Callable) -> str | None:
    return getattr(method, DISPATCH_ATTRIBUTE, None)


# metrics whose ranks' values are reduced by max (a peak); every other metric is averaged
MAX_REDUCED_PREFIXES = ("perf/max_memory",)


def reduce_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One metric dict from the ranks' own: the maximum for peaks (``perf/max_memory_*``), the mean otherwise. A worker
    reports each metric either as a global value (computed with collectives: losses scaled by the global counts,
    grad norms, entropy) or as its rank's own rate (MFU), so that the mean is the group's value."""
    reduced = {}
    for key in per_rank[0]:
        values = [metrics[key] for metrics in per_rank]
        reduced[key] = float(max(values) if key.startswith(MAX_REDUCED_PREFIXES) else sum(values) / len(values))
    return reduced
