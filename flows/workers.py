"""The run's worker group: which roles it fuses, where it runs, and how a flow (re)gets it.

All roles share one resource pool (``trainer.nnodes`` x ``trainer.n_gpus_per_node`` workers) and one Ray
actor per bundle (verl's colocated hybrid engine). Models load in verl's order: critic, then reference and
actor (together, in the fused ``actor_rollout_ref`` role), then the reward model.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import ray
from omegaconf import DictConfig

from infra import standby
from infra.fused_worker import PROJECT_ROOT, WORKER_PACKAGES
from infra.resource_pool import ResourcePool, remove_placement_groups, smallest_node_cpus
from infra.weight_transport import CollectiveTransport, ObjectStoreTransport
from infra.worker_group import WorkerGroup, placement_group_prefix
from rl_core.device import DeviceError, resolve_device
from rl_core.ppo_step import StepWorkers
from rl_core.run_roles import use_critic, use_reference
from rl_core.step_checkpoint import run_checkpoints
from rl_core.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker

PREFIX = "workers"
ROLLOUT_PREFIX = "rollout"  # a rollout of its own: its group beside the trainer's, in the same namespace
NAMESPACE_PREFIX = "ppoflow-run-"
WORKERS_NAMESPACE_TAG = "ppoflow.workers_namespace"  # the MLflow run's tag naming its workers' namespace
RUN_LABEL = "mlflow_run_id"  # the group's label naming the MLflow run it serves (beside the namespace)
STANDBY_LABEL = "standby"  # a standby group's run label (`ppoflow workers` lists it so)


def workers_namespace(config: DictConfig) -> str:
    """The Ray namespace of a training run's workers, named after its checkpoint folder: known before the run's MLflow
    run exists (so the workers can start first, flows/prestart.py) and the same for every controller of the run (one
    at a time: the folder's lock). The MLflow run id is recorded beside it: the group's label, the run's tag."""
    folder = run_checkpoints(config.trainer).root.expanduser().resolve()  # a URL's: its local copy
    return NAMESPACE_PREFIX + hashlib.sha256(str(folder).encode()).hexdigest()[:16]


def worker_device(config: DictConfig) -> str:
    """``cpu`` or ``cuda``: ``trainer.device`` resolved against the GPUs of the connected Ray cluster (``auto`` = cuda
    when it has any; ``cuda`` without one is a DeviceError, before any worker starts)."""
    gpus = sum(node["Resources"].get("GPU", 0) for node in ray.nodes() if node.get("Alive"))
    return resolve_device(config.trainer.device, gpus)


def has_separate_rollout(config: DictConfig) -> bool:
    """Whether the rollout runs on workers of its own (``rollout.n_gpus_per_node > 0``: rl_core/separate_rollout.py)."""
    return config.rollout.n_gpus_per_node > 0


def weight_transport(config: DictConfig) -> ObjectStoreTransport | CollectiveTransport:
    """How the actor's weights reach a rollout of its own (``actor_rollout_ref.rollout.checkpoint_engine``)."""
    engine = config.actor_rollout_ref.rollout.checkpoint_engine
    bucket_bytes = engine.update_weights_bucket_megabytes * 2**20
    if engine.backend == "naive":
        return ObjectStoreTransport(bucket_bytes)
    if engine.backend == "nccl" and worker_device(config) != "cuda":
        raise DeviceError(
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl needs GPUs and the workers run on the CPU (no "
            "GPU in the cluster); use gloo"
        )
    return CollectiveTransport(engine.backend, bucket_bytes, config.trainer.worker_timeout_s)


def role_specs(config: DictConfig, evaluation: bool = False) -> dict:
    """Roles of the run's workers; an ``evaluation`` needs only the policy (and the reward model). With a rollout of
    its own the actor exports its weights through the configured transport (:func:`weight_transport`; the trainer's
    workers keep their rollout role: validation generates there)."""
    # with a rollout of its own the reference policy runs there, right after generation, off the trainer's path
    with_ref = use_reference(config) and not evaluation and not has_separate_rollout(config)
    policy_role = "actor_rollout_ref" if with_ref else "actor_rollout"
    on_device = {"device": worker_device(config)}
    policy_options = on_device | (
        {"weight_transport": weight_transport(config)} if has_separate_rollout(config) and not evaluation else {}
    )
    specs = {"actor_rollout_ref": (ActorRolloutRefWorker, (config.actor_rollout_ref, policy_role), policy_options)}
    if use_critic(config) and not evaluation:
        specs["critic"] = (CriticWorker, (config.critic,), on_device)
    if config.reward_model.enable:
        specs["reward_model"] = (RewardModelWorker, (config.reward_model,), on_device)
    return specs


def resource_pool(config: DictConfig, section: str = "trainer") -> ResourcePool:
    """``nnodes`` x ``n_gpus_per_node`` bundles of the ``trainer`` (or, with a rollout of its own, the ``rollout``)
    section; without its ``cpus_per_worker``, the smallest node's CPUs shared out evenly between both pools' workers
    on a node, whole CPUs when there are enough (torch then uses that many threads in each worker)."""
    pool = config[section]
    cpus = pool.cpus_per_worker
    if cpus is None:
        share = smallest_node_cpus() / (config.trainer.n_gpus_per_node + config.rollout.n_gpus_per_node)
        cpus = int(share) if share >= 1 else share  # fewer CPUs than workers: a fraction each (one torch thread)
    return ResourcePool(
        "global_pool" if section == "trainer" else "rollout_pool",
        [pool.n_gpus_per_node] * pool.nnodes,
        accelerator="GPU" if worker_device(config) == "cuda" else None,
        cpus_per_worker=cpus,
        capacity_wait_s=config.trainer.capacity_wait_s,
    )


def build_rollout_workers(config: DictConfig, namespace: str) -> list[WorkerGroup]:
    """The rollout's own workers, one group of one worker per replica of the policy (``rollout.nnodes x
    rollout.n_gpus_per_node``; role ``rollout``, and ``ref`` when the run has a reference policy: its log-probs are
    computed there after generation; weights from the actor through :func:`weight_transport`), built side by side with
    their models loaded; whatever an earlier run of the namespace left ends first."""
    kill_rollout_workers(namespace)
    release_standby()  # its resources may be the ones these workers need
    pool = resource_pool(config, "rollout")
    pool.make_room = release_standby
    options = {
        "device": worker_device(config),
        "weight_transport": weight_transport(config),
        "partial_rollout": bool(config.async_training.partial_rollout),
    }
    role = "rollout_ref" if use_reference(config) else "rollout"
    specs = {"actor_rollout_ref": (ActorRolloutRefWorker, (config.actor_rollout_ref, role), options)}
    timeout = config.trainer.worker_timeout_s

    def build(replica: int) -> WorkerGroup:
        replica_pool = ResourcePool(
            f"{pool.name}{replica}",
            [1],
            pool.accelerator,
            pool.cpus_per_worker,
            capacity_wait_s=pool.capacity_wait_s,
            make_room=pool.make_room,
        )
        group = WorkerGroup.create(replica_pool, specs, f"{ROLLOUT_PREFIX}-{replica}", namespace, timeout)
        try:
            group.role("actor_rollout_ref").init_model(timeout_s=timeout, stage="init rollout")
        except BaseException:
            group.kill()
            raise
        return group

    with ThreadPoolExecutor(max_workers=pool.world_size) as threads:
        futures = [threads.submit(build, replica) for replica in range(pool.world_size)]
        wait(futures)
    failed = [future.exception() for future in futures if future.exception() is not None]
    if failed:
        for future in futures:
            if future.exception() is None:
                future.result().kill()
        raise failed[0]
    return [future.result() for future in futures]


def kill_rollout_workers(namespace: str) -> int:
    """End every rollout worker the namespace holds (replicas ``rollout-0``, ``rollout-1``, ...) and free their
    placement groups, a dead worker's included; returns how many workers were killed."""
    prefixes = {
        actor["name"].rsplit("-rank", 1)[0]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == namespace and actor["name"].startswith(f"{ROLLOUT_PREFIX}-")
    }
    killed = sum(WorkerGroup.kill_named(prefix, namespace) for prefix in prefixes)
    remove_placement_groups(f"{placement_group_prefix(namespace, ROLLOUT_PREFIX)}-")
    return killed


def build_workers(
    config: DictConfig, namespace: str, evaluation: bool = False, log: Callable[[str], None] = print
) -> WorkerGroup:
    """A fresh worker group with every model loaded (critic -> ref + actor -> reward model); what loading changed or
    could not use (dropout turned off, a generation config ignored, an attention fallback) goes to ``log``."""
    group = start_workers(config, namespace, evaluation)
    load_models(group, config, log, evaluation)
    return group


def start_workers(config: DictConfig, namespace: str, evaluation: bool = False) -> WorkerGroup:
    """The worker processes of a fresh group, started (each imports torch and the models' code) with nothing loaded.
    The roles, resources and ranks come from ``config``; the models' paths and LR schedules may still change
    (:func:`load_models` takes the final config). A standby group on the cluster ends first: its resources may be the
    ones this group needs (and any that takes them while its bundles wait to be placed)."""
    release_standby()
    pool = resource_pool(config)
    pool.make_room = release_standby
    return WorkerGroup.create(
        pool,
        role_specs(config, evaluation),
        prefix=PREFIX,
        namespace=namespace,
        timeout_s=config.trainer.worker_timeout_s,
    )


def load_models(
    group: WorkerGroup, config: DictConfig, log: Callable[[str], None] = print, evaluation: bool = False
) -> None:
    """Load a started group's models with ``config``'s settings, in verl's order; a model that does not load kills the
    group."""
    timeout = config.trainer.worker_timeout_s
    try:
        group.set_roles(role_specs(config, evaluation), timeout)
        for role in ("critic", "actor_rollout_ref", "reward_model"):
            if role in group.roles:
                for note in group.role(role).init_model(timeout_s=timeout, stage=f"init {role}") or []:
                    log(f"[{role}] {note}")
    except BaseException:  # a model that does not load: nothing of this group may stay alive
        group.kill()
        raise


def start_fresh_workers(config: DictConfig) -> WorkerGroup:
    """:func:`start_workers` for the run, after ending whatever group an earlier run of the same folder left; a standby
    group whose workers fit the run's instead when there is one (:func:`adopt_standby`). The group starts in the run's
    namespace, except on the ``ppoflow up`` stack: there in a standby group's, recorded as the run's as an adopted one
    is, so that its workers may serve the next run once this one has ended (flows/standby_workers.py)."""
    namespace = workers_namespace(config)
    kill_worker_group(namespace)
    adopted = adopt_standby(config, namespace)
    if adopted is not None:
        return adopted
    from flows.standby_workers import leaves_standby  # (that module imports this one)

    if not leaves_standby():
        return start_workers(config, namespace)
    live = standby_namespace()
    standby.adopt(namespace, live)
    try:
        return start_workers(config, live)
    except BaseException:
        standby.forget(namespace)
        raise


def build_fresh_workers(config: DictConfig, log: Callable[[str], None] = print) -> WorkerGroup:
    """:func:`build_workers` in the run's namespace (see :func:`start_fresh_workers`)."""
    group = start_fresh_workers(config)
    load_models(group, config, log)
    return group


def reattach_workers(config: DictConfig, namespace: str) -> WorkerGroup | None:
    """The run's live worker group (a retried flow run), or None when there is none or it is unhealthy. ``namespace``:
    the run's (:func:`workers_namespace`); its workers may live in the standby group's it adopted."""
    live = standby.live_namespace(namespace)
    try:
        return WorkerGroup.reattach(PREFIX, live, role_specs(config))
    except ValueError:  # no such group
        return None
    except Exception:  # some rank is dead or hangs: clear the remains, the caller builds a new group
        WorkerGroup.kill_named(PREFIX, live)
        return None


def weights_at(group: WorkerGroup, trainer_state: dict, timeout: float) -> bool:
    """True when every rank's weights are those of the checkpoint whose ``trainer_state`` is given: each role has done
    exactly the checkpoint's updates and begun no other (a controller that died between a checkpoint and the next
    update). Then a reattached group needs no reload."""
    expected = trainer_state.get("worker_steps")
    return expected is not None and all(
        report["steps_trained"] == expected and report["updates_started"] == expected
        for report in group.health(timeout)
    )


def step_workers(group: WorkerGroup, timeout_s: float, reward_timeout_s: float | None = None) -> StepWorkers:
    """The group's roles as the PPO step calls them (each call waits at most ``timeout_s``; the reward model's at most
    ``reward_timeout_s`` when that is given: ``reward.timeout_s``)."""

    def role(name: str):
        if name not in group.roles:
            return None
        return group.role(name, reward_timeout_s if name == "reward_model" and reward_timeout_s else timeout_s)

    return StepWorkers(
        actor=role("actor_rollout_ref"),
        critic=role("critic"),
        reward_model=role("reward_model"),
        world_size=group.world_size,
    )


# ---------------------------------------------------------------------------------------------- the cluster's worker
# groups
@dataclass
class WorkerGroupInfo:
    namespace: str
    run_id: str  # the MLflow run the group serves; "?" when its workers are busy (a call is running) or unlabelled
    ranks: int
    pids: list[int]  # empty when the workers are busy (a call is running) and did not answer
    age_s: float | None
    resources: dict[str, float]
    run_status: str = "?"  # the MLflow run's status, when a tracking store is given


def worker_groups(tracking_uri: str | None = None, timeout_s: float = 5.0) -> list[WorkerGroupInfo]:
    """Every training run's worker group on the connected cluster: ranks, pids, age, the resources it holds."""
    from flows.tracking import open_store

    names_by_namespace: dict[str, list[str]] = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"].startswith(NAMESPACE_PREFIX) and actor["name"].startswith(f"{PREFIX}-rank"):
            names_by_namespace.setdefault(actor["namespace"], []).append(actor["name"])
    placement_groups = ray.util.placement_group_table().values()
    client = open_store(tracking_uri) if tracking_uri else None
    groups = []
    for namespace, names in sorted(names_by_namespace.items()):
        refs = [ray.get_actor(name, namespace=namespace).health.remote() for name in sorted(names)]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        reports = [ray.get(ref) for ref in ready]
        resources: dict[str, float] = {}
        prefix = f"{placement_group_prefix(namespace, PREFIX)}-"
        for group in placement_groups:
            if group.get("name", "").startswith(prefix) and group.get("state") != "REMOVED":
                for bundle in group["bundles"].values():
                    for key, amount in bundle.items():
                        resources[key] = resources.get(key, 0.0) + amount
        labels = reports[0].get("labels", {}) if reports else {}
        info = WorkerGroupInfo(
            namespace,
            labels.get(RUN_LABEL, "?"),
            len(names),
            sorted(r["pid"] for r in reports),
            time.time() - min(r["started_at"] for r in reports) if reports else None,
            resources,
        )
        if info.run_id == STANDBY_LABEL:
            info.run_status = "idle"  # serves no run yet (infra/standby.py)
        elif client is not None and info.run_id != "?":
            try:
                info.run_status = client.get_run(info.run_id).info.status
            except Exception:
                info.run_status = "UNKNOWN"
        groups.append(info)
    return groups


def namespace_of_run(run_id: str, client: Any = None, groups: list[WorkerGroupInfo] | None = None) -> str | None:
    """The namespace of MLflow run ``run_id``'s workers: the group labelled with it (of ``groups``), else the run's
    ``ppoflow.workers_namespace`` tag (a busy group does not answer), else None."""
    for group in groups or []:
        if group.run_id == run_id:
            return group.namespace
    if client is not None:
        try:
            return client.get_run(run_id).data.tags.get(WORKERS_NAMESPACE_TAG)
        except Exception:  # no such run in this store
            return None
    return None


def kill_worker_group(namespace: str) -> int:
    """End the worker groups of ``namespace`` (the trainer's and a rollout's own), there and in the standby group's
    namespace it adopted, and free their placement groups; returns how many workers were killed."""
    killed = sum(
        WorkerGroup.kill_named(PREFIX, where) + kill_rollout_workers(where)
        for where in {namespace, standby.live_namespace(namespace)}
    )
    standby.forget(namespace)
    return killed


# ---------------------------------------------------------------------------------------------- standby groups
# (left and offered by flows/standby_workers.py; adopted here, where a run gets its workers)
def standby_namespace() -> str:
    """A new namespace for a standby group (infra/standby.py finds such groups by its mark)."""
    return f"{NAMESPACE_PREFIX}{standby.NAMESPACE_MARK}{uuid.uuid4().hex[:12]}"


def release_standby() -> None:
    """End the cluster's standby groups (infra/standby.py): a group about to start may need their resources."""
    standby.release(PREFIX)


def code_fingerprint() -> str:
    """The workers' code as it is on disk: every source file of ``rl_core`` and ``infra`` (path, size, modification
    time). A worker that imported other code fits no run."""
    entries = []
    for package in WORKER_PACKAGES:
        for folder, _, files in sorted(os.walk(os.path.join(PROJECT_ROOT, package))):
            for name in sorted(file for file in files if file.endswith(".py")):
                stat = os.stat(os.path.join(folder, name))
                entries.append(f"{folder}/{name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def worker_shape(config: DictConfig) -> str:
    """What makes a started group fit a run before its models load: the roles and their classes, the resource pool
    (workers per node, CPUs each, accelerator) and the workers' code (:func:`code_fingerprint`)."""
    pool = resource_pool(config)
    record = {
        "roles": {role: f"{cls.__module__}.{cls.__qualname__}" for role, (cls, _, _) in role_specs(config).items()},
        "nodes": pool.process_on_nodes,
        "cpus": pool.cpus_per_worker,
        "accelerator": pool.accelerator,
        "code": code_fingerprint(),
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def adopt_standby(config: DictConfig, namespace: str) -> WorkerGroup | None:
    """A standby group whose workers fit ``config``'s (:func:`worker_shape`), joined and recorded as the workers of
    ``namespace`` (the run's); None when there is none (or it died: its remains end)."""
    if not standby.has_any():
        return None
    live = standby.claim(worker_shape(config))
    if live is None:
        return None
    standby.adopt(namespace, live)  # first: a command releasing standby groups spares an adopted one
    try:
        group = WorkerGroup.reattach(PREFIX, live, role_specs(config), config.trainer.worker_timeout_s)
        if group.world_size > 1:
            group.join("nccl" if worker_device(config) == "cuda" else "gloo", config.trainer.worker_timeout_s)
    except Exception:
        WorkerGroup.kill_named(PREFIX, live)
        standby.forget(namespace)
        return None
    group.adopted = True
    return group
