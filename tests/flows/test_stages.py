"""The stage runner's Prefect tasks: one per stage, retries only where a re-run gives the same result."""

from flows.stages import StageRunner, retryable, stage_task
from infra.worker_group import WorkerDiedError, WorkerTimeoutError
from rl_core import ppo_step
from rl_core.ppo_step import IDEMPOTENT_STAGES, TIMING_NAMES


def test_one_task_per_stage_and_retries_only_for_idempotent_stages():
    tasks = {name: stage_task(name, getattr(ppo_step, name), retries=2) for name in TIMING_NAMES}
    assert all(task.name == name for name, task in tasks.items())
    assert {name for name, task in tasks.items() if task.retries} == set(IDEMPOTENT_STAGES)
    assert all(task.retries == 2 for name, task in tasks.items() if name in IDEMPOTENT_STAGES)
    assert not any(stage_task(name, getattr(ppo_step, name), retries=0).retries for name in TIMING_NAMES)
    assert all(task.cache_policy is not None and not task.persist_result for task in tasks.values())


def test_the_runner_runs_the_stage_function_it_is_given(prefect_api):
    """A patched or custom stage function is what runs as the stage's task (not the module's function of that name)."""
    run_stage = StageRunner(retries=0)
    assert run_stage("advantage", lambda x: ("custom", x), 3) == ("custom", 3)
    custom = lambda x: ("custom", x)  # noqa: E731
    run_stage.step = 12
    assert run_stage("advantage", custom, 4) == ("custom", 4)


def test_a_dead_or_timed_out_worker_is_not_retried_in_place():
    assert retryable(ConnectionError("transient"))
    assert not retryable(WorkerDiedError("worker rank0 died", "rank0"))
    assert not retryable(WorkerTimeoutError("stage 'generate': workers ['rank0'] did not answer"))
