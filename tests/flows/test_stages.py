"""The stage runner's Prefect tasks: one per stage, retries only where a re-run gives the same result."""

from flows.stages import retryable, stage_tasks
from infra.worker_group import WorkerDiedError, WorkerTimeoutError
from rl_core.ppo_step import IDEMPOTENT_STAGES, TIMING_NAMES


def test_one_task_per_stage_and_retries_only_for_idempotent_stages():
    tasks = stage_tasks(retries=2)
    assert set(tasks) == set(TIMING_NAMES) and all(task.name == name for name, task in tasks.items())
    assert {name for name, task in tasks.items() if task.retries} == set(IDEMPOTENT_STAGES)
    assert all(task.retries == 2 for name, task in tasks.items() if name in IDEMPOTENT_STAGES)
    assert not any(task.retries for task in stage_tasks(retries=0).values())
    assert all(task.cache_policy is not None and not task.persist_result for task in tasks.values())


def test_a_dead_or_timed_out_worker_is_not_retried_in_place():
    assert retryable(ConnectionError("transient"))
    assert not retryable(WorkerDiedError("worker rank0 died", "rank0"))
    assert not retryable(WorkerTimeoutError("stage 'generate': workers ['rank0'] did not answer"))
