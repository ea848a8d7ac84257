"""How a worker method's inputs are spread over the ranks of a worker group, declared on the method itself.

The decorator only records the mode (rl_core knows nothing of Ray); ``infra.dispatch`` implements it:

  ONE_TO_ALL  every rank gets the same arguments; the result is rank 0's
  DP_COMPUTE  the Batch argument is padded to a multiple of the world size and split, one shard per rank;
              the ranks' Batch results are concatenated and the padding removed
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
