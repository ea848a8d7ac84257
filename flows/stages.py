"""The PPO step's stages as Prefect tasks. Each body is one worker-group call (or cheap maths in the flow
process); the batch never crosses a persisted boundary (NO_CACHE, persist_result=False).

Idempotent stages (generation is seeded by the step; log-probs and values are pure functions of the weights)
may be retried on transient errors; updates and checkpoints are not retried (the flow recovers those from
the last checkpoint instead).
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from infra.worker_group import WorkerDiedError, WorkerGroup
from rl_core.batch import Batch
from rl_core.ppo_step import add_reward, compute_advantage, merge_stage
from rl_core.reward.manager import RewardManager

STAGE = {"cache_policy": NO_CACHE, "persist_result": False}
# what each worker stage reads: only these tensors travel to the workers (no per-sample Python objects)
SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def needed(batch: Batch, *extra: str) -> Batch:
    return batch.select([*SEQUENCE_KEYS, *(k for k in extra if k in batch.tensors)])


def _not_a_dead_worker(task: Any, task_run: Any, state: Any) -> bool:
    """Retry transient errors only: a dead worker needs the group rebuilt, which the flow does."""
    try:
        state.result()
    except WorkerDiedError:
        return False
    except Exception:
        return True
    return False


IDEMPOTENT = {**STAGE, "retry_condition_fn": _not_a_dead_worker}


@task(name="generate", **IDEMPOTENT)
def generate(workers: WorkerGroup, prompts: Batch, timeout_s: float) -> Batch:
    return workers.role("actor_rollout_ref").generate_sequences(prompts, timeout_s=timeout_s, stage="generate")


@task(name="reward", **STAGE)
def reward(workers: WorkerGroup, batch: Batch, reward_manager: RewardManager, timeout_s: float) -> dict[str, float]:
    if "reward_model" in workers.roles:
        batch.union(workers.role("reward_model").compute_rm_score(batch, timeout_s=timeout_s, stage="reward"))
    result = reward_manager(batch)
    add_reward(batch, result)
    return result.metrics


@task(name="old_log_prob", **IDEMPOTENT)
def old_log_prob(workers: WorkerGroup, batch: Batch, metrics: dict, timeout_s: float) -> None:
    merge_stage(batch, workers.role("actor_rollout_ref").compute_log_prob(needed(batch), timeout_s=timeout_s, stage="old_log_prob"), metrics)


@task(name="ref_log_prob", **IDEMPOTENT)
def ref_log_prob(workers: WorkerGroup, batch: Batch, metrics: dict, timeout_s: float) -> None:
    merge_stage(batch, workers.role("actor_rollout_ref").compute_ref_log_prob(needed(batch), timeout_s=timeout_s, stage="ref_log_prob"), metrics)


@task(name="values", **IDEMPOTENT)
def values(workers: WorkerGroup, batch: Batch, metrics: dict, timeout_s: float) -> None:
    merge_stage(batch, workers.role("critic").compute_values(needed(batch), timeout_s=timeout_s, stage="values"), metrics)


@task(name="advantage", **STAGE)
def advantage(batch: Batch, config: Any, kl_controller: Any) -> dict[str, float]:
    return compute_advantage(batch, config, kl_controller)


@task(name="update_critic", **STAGE)
def update_critic(workers: WorkerGroup, batch: Batch, metrics: dict, timeout_s: float) -> None:
    merge_stage(batch, workers.role("critic").update_critic(needed(batch, "values", "returns"), timeout_s=timeout_s, stage="update_critic"), metrics)


@task(name="update_actor", **STAGE)
def update_actor(workers: WorkerGroup, batch: Batch, metrics: dict, timeout_s: float) -> None:
    merge_stage(batch, workers.role("actor_rollout_ref").update_actor(needed(batch, "old_log_probs", "advantages", "ref_log_prob"), timeout_s=timeout_s, stage="update_actor"), metrics)
