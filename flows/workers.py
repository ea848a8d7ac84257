"""The run's worker group: which roles it fuses, where it runs, and how a flow (re)gets it.

All roles share one resource pool (``trainer.nnodes`` x ``trainer.n_gpus_per_node`` workers) and one Ray
actor per bundle (verl's colocated hybrid engine). Models load in verl's order: critic, then reference and
actor (together, in the fused ``actor_rollout_ref`` role), then the reward model.
"""

from __future__ import annotations

from omegaconf import DictConfig

from infra.resource_pool import ResourcePool, smallest_node_cpus
from infra.worker_group import WorkerGroup
from rl_core.ppo_step import StepWorkers, use_critic, use_reference
from rl_core.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker

PREFIX = "workers"


def role_specs(config: DictConfig) -> dict:
    policy_role = "actor_rollout_ref" if use_reference(config) else "actor_rollout"
    specs = {"actor_rollout_ref": (ActorRolloutRefWorker, (config.actor_rollout_ref, policy_role), {})}
    if use_critic(config):
        specs["critic"] = (CriticWorker, (config.critic,), {})
    if config.reward_model.enable:
        specs["reward_model"] = (RewardModelWorker, (config.reward_model,), {})
    return specs


def resource_pool(config: DictConfig) -> ResourcePool:
    """``nnodes`` x ``n_gpus_per_node`` bundles; without ``cpus_per_worker``, the smallest node's CPUs shared out
    evenly (torch then uses that many threads in each worker)."""
    trainer = config.trainer
    cpus = trainer.cpus_per_worker
    if cpus is None:
        cpus = max(1, int(smallest_node_cpus() // trainer.n_gpus_per_node))
    return ResourcePool("global_pool", [trainer.n_gpus_per_node] * trainer.nnodes,
                        accelerator="GPU" if trainer.device == "cuda" else None, cpus_per_worker=cpus)


def build_workers(config: DictConfig, namespace: str) -> WorkerGroup:
    """A fresh worker group with every model loaded (critic -> ref + actor -> reward model)."""
    group = WorkerGroup.create(resource_pool(config), role_specs(config), prefix=PREFIX, namespace=namespace, timeout_s=config.trainer.worker_timeout_s)
    timeout = config.trainer.worker_timeout_s
    try:
        for role in ("critic", "actor_rollout_ref", "reward_model"):
            if role in group.roles:
                group.role(role).init_model(timeout_s=timeout, stage=f"init {role}")
    except BaseException:  # a model that does not load: nothing of this group may stay alive
        group.kill()
        raise
    return group


def reattach_workers(config: DictConfig, namespace: str) -> WorkerGroup | None:
    """The run's live worker group (a retried flow run), or None when there is none or it is unhealthy."""
    try:
        return WorkerGroup.reattach(PREFIX, namespace, role_specs(config))
    except ValueError:  # no such group
        return None
    except Exception:  # some rank is dead or hangs: clear the remains, the caller builds a new group
        WorkerGroup.kill_named(PREFIX, namespace)
        return None


def step_workers(group: WorkerGroup, timeout_s: float) -> StepWorkers:
    """The group's roles as the PPO step calls them (each call waits at most ``timeout_s``)."""
    def role(name: str):
        return group.role(name, timeout_s) if name in group.roles else None

    return StepWorkers(actor=role("actor_rollout_ref"), critic=role("critic"), reward_model=role("reward_model"), world_size=group.world_size)
