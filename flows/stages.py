"""The PPO step's stages as Prefect tasks: the stage runner the training flow gives
:func:`rl_core.ppo_step.run_ppo_step`.

Each stage function of ``rl_core.ppo_step`` becomes one task of the same name, so the Prefect UI shows one task run
per stage per step, named by its step (``step-12/generate``), with the data dependencies between them (a stage's inputs
are earlier stages' outputs). The run's other phases are tasks too (:func:`run_phase`: ``load-inputs``, ``set-up``,
``step-12/validate``, ``step-12/save_checkpoint``), so the graph covers the whole run. The batch never crosses a
persisted boundary (``NO_CACHE``, ``persist_result=False``): it stays in the flow process and Ray's object store.

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


def stage_task(
    name: str,
    fn: Callable,
    retries: int,
    retry_safe: tuple[str, ...] = ppo_step.IDEMPOTENT_STAGES,
    run_name: Callable[[], str] | None = None,
) -> Task:
    """The Prefect task ``name`` running ``fn``, its runs named by ``run_name()``; a stage of ``retry_safe`` is retried
    ``retries`` times."""
    options: dict[str, Any] = {"name": name, "cache_policy": NO_CACHE, "persist_result": False}
    if run_name is not None:
        options["task_run_name"] = run_name
    if name in retry_safe and retries > 0:
        options.update(retries=retries, retry_delay_seconds=1, retry_condition_fn=_retry_condition)
    return task(fn, **options)


TASK_RUNS = {"started": 0}  # the task runs this process started (its Prefect server records as many)


class StageRunner:
    """``runner(name, fn, *args)`` runs the stage function ``fn`` as the Prefect task ``name`` (one task object per
    stage function, made on first use), its run named ``step-<step>/<name>`` after the runner's current :attr:`step`;
    the stages of ``retry_safe`` are retried ``retries`` times."""

    def __init__(self, retries: int, retry_safe: tuple[str, ...] = ppo_step.IDEMPOTENT_STAGES):
        self.retries, self.retry_safe = retries, retry_safe
        self.step = 0  # the step the next task runs belong to (the session sets it)
        self.tasks: dict[tuple[str, Callable], Task] = {}

    def __call__(self, name: str, fn: Callable, *args: Any) -> Any:
        if (name, fn) not in self.tasks:
            run_name = lambda: f"step-{self.step}/{name}"  # noqa: E731 (read when the task run starts)
            self.tasks[(name, fn)] = stage_task(name, fn, self.retries, self.retry_safe, run_name)
        TASK_RUNS["started"] += 1
        return self.tasks[(name, fn)](*args)


def run_phase(name: str, fn: Callable, *args: Any, step: int | None = None) -> Any:
    """A phase of the run besides the step's stages (loading the inputs, set-up, validation, a checkpoint) as a task
    run named ``name``, or ``step-<step>/<name>``; never retried here (the flow recovers)."""
    TASK_RUNS["started"] += 1
    run_name = name if step is None else f"step-{step}/{name}"
    return task(fn, name=name, task_run_name=run_name, cache_policy=NO_CACHE, persist_result=False)(*args)
