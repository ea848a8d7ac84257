"""The PPO step's stages as Prefect tasks: the stage runner the training flow gives
:func:`rl_core.ppo_step.run_ppo_step`.

Each stage function of ``rl_core.ppo_step`` becomes one task of the same name, so the Prefect UI shows one task run
per stage per step, with the data dependencies between them (a stage's inputs are earlier stages' outputs). The
batch never crosses a persisted boundary (``NO_CACHE``, ``persist_result=False``): it stays in the flow process and
Ray's object store.

Idempotent stages (generation is seeded by the step; log-probs and values are pure functions of the weights) are
retried on transient errors; updates are not (the flow recovers those from the last checkpoint instead), and a
dead or timed-out worker is never retried here: the flow rebuilds the worker group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE

from infra.worker_group import WorkerDiedError, WorkerTimeoutError
from rl_core import ppo_step


def retryable(error: BaseException) -> bool:
    """Transient errors are retried in place; a dead or timed-out worker needs the group rebuilt, which the flow does
    (a retry would reach a dead worker, or queue behind the stale call)."""
    return not isinstance(error, (WorkerDiedError, WorkerTimeoutError))


def _retry_condition(task: Any, task_run: Any, state: Any) -> bool:
    try:
        state.result()
    except Exception as error:
        return retryable(error)
    return False


def stage_task(name: str, fn: Callable, retries: int, retry_safe: tuple[str, ...] = ppo_step.IDEMPOTENT_STAGES) -> Task:
    """The Prefect task ``name`` running ``fn``; a stage of ``retry_safe`` is retried ``retries`` times."""
    options: dict[str, Any] = {"name": name, "cache_policy": NO_CACHE, "persist_result": False}
    if name in retry_safe and retries > 0:
        options.update(retries=retries, retry_delay_seconds=1, retry_condition_fn=_retry_condition)
    return task(fn, **options)


TASK_RUNS = {"started": 0}  # the stage task runs this process started (its Prefect server records as many)


def prefect_stage_runner(retries: int, retry_safe: tuple[str, ...] = ppo_step.IDEMPOTENT_STAGES) -> Callable[..., Any]:
    """``run_stage(name, fn, *args)`` that runs the stage function ``fn`` as the Prefect task ``name`` (one task object
    per stage function, made on first use); the stages of ``retry_safe`` are retried ``retries`` times."""
    tasks: dict[tuple[str, Callable], Task] = {}

    def run_stage(name: str, fn: Callable, *args: Any) -> Any:
        if (name, fn) not in tasks:
            tasks[(name, fn)] = stage_task(name, fn, retries, retry_safe)
        TASK_RUNS["started"] += 1
        return tasks[(name, fn)](*args)

    return run_stage
