"""A worker group: one fused worker actor per bundle of a resource pool, driven as one object.

* Actors are named ``<prefix>-rank<r>``, detached, in the run's namespace: a later driver (a retried flow run)
  reattaches with :meth:`WorkerGroup.reattach` instead of reloading models; :meth:`WorkerGroup.kill` ends them.
* Each actor gets RANK / WORLD_SIZE / LOCAL_RANK (set by its constructor); rank 0 picks MASTER_ADDR / MASTER_PORT
  and every rank joins the torch.distributed group (gloo on CPU, nccl on GPU).
* ``group.role("actor_rollout_ref").update_actor(batch)`` calls ``actor_rollout_ref_update_actor`` on the
  ranks as the method's dispatch mode says, and waits at most ``timeout_s``: a dead worker is an error naming
  it as soon as Ray reports the death (never a hang on its peers), a slow one an error naming the stage and
  the ranks that did not answer, and an error raised in a worker comes back as itself, noted with the stage and
  the worker (:func:`worker_exception`).
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from infra.dispatch import collect_results, split_arguments
from infra.fused_worker import RoleSpec, fused_worker_class
from infra.resource_pool import InsufficientResourcesError, ResourcePool, remove_placement_groups
from rl_core.workers.dispatch import dispatch_mode


class WorkerDiedError(RuntimeError):
    """A worker process died (or was killed) during a call."""

    def __init__(self, message: str, worker: str):
        super().__init__(message)
        self.worker = worker


class WorkerTimeoutError(TimeoutError):
    """Workers did not answer a call within its timeout. The call goes on running: Ray cannot stop a running call of
    a plain actor, nor one queued behind it (measured on Ray 2.60: a cancelled queued call still runs), so the
    group is unusable until it is rebuilt; a retry on the same workers would queue behind the stale call."""


def worker_exception(error: RayTaskError, stage: str, worker: str) -> BaseException:
    """The exception a worker raised, as itself (its own type and message, not Ray's wrapper line), with a note naming
    the stage and the worker; Ray's wrapper, which holds the worker's traceback, is chained as its cause. An exception
    Ray could not bring back stays wrapped."""
    cause = error.cause
    if not isinstance(cause, BaseException) or isinstance(cause, RayError):
        return error.as_instanceof_cause()
    cause.add_note(f"raised in stage {stage!r} by worker {worker}")
    return cause


def raise_if_room_lost(pool: ResourcePool, error: WorkerTimeoutError, timeout_s: float) -> None:
    """A group whose set-up timed out because a node it was placed on left before its workers started (Ray then
    re-places the node's bundles and the workers wait for room that may never come): the shortfall, named as when there
    is no room at the start, instead of the timeout's advice to wait longer. Nothing when the pool still fits."""
    try:
        pool.check_fits()
    except InsufficientResourcesError as lacking:
        waited = f"they waited {timeout_s:.0f} s for room: trainer.worker_timeout_s"
        lacking.add_note(f"a node left after the workers were placed; {waited}")
        raise lacking from error


def placement_group_prefix(namespace: str, prefix: str) -> str:
    """The group's placement groups are named after its namespace too: killing one run's group frees only its own."""
    return f"{namespace}.{prefix}"


class WorkerGroup:
    def __init__(
        self, actors: list[Any], names: list[str], role_specs: dict[str, RoleSpec], namespace: str, prefix: str
    ):
        self.actors, self.names, self.namespace, self.prefix = actors, names, namespace, prefix
        self.fused_class = fused_worker_class(role_specs)
        self.roles = list(role_specs)
        self.nodes: dict[str, str] = {}  # worker name -> Ray node id, as the last health check saw it
        self.adopted = False  # a standby group this process adopted (infra/standby.py), not one it started

    @property
    def world_size(self) -> int:
        return len(self.actors)

    # ------------------------------------------------------------------ creation and reattachment
    @classmethod
    def create(
        cls,
        pool: ResourcePool,
        role_specs: dict[str, RoleSpec],
        prefix: str,
        namespace: str,
        timeout_s: float = 120.0,
        env_vars: dict[str, str] | None = None,
        join: bool = True,
        labels: dict[str, str] | None = None,
        imports: tuple[str, ...] = (),
    ) -> WorkerGroup:
        """Start one fused worker per bundle of ``pool`` and (``join``) wait for them and join them in a process
        group; without ``join`` the workers start on their own (a standby group: its adopter joins them,
        :meth:`join`). The pool's placement groups are created here, named after ``prefix`` (so that :meth:`kill` finds
        them after a reattach). ``env_vars``: what the worker processes need from their start (PYTHONPATH); without it
        an actor takes one of the idle processes Ray keeps started. ``labels``, ``imports``: each worker's (its
        constructor's, :class:`infra.fused_worker.FusedWorkerBase`)."""
        if not pool.placement_groups:
            pool.create(placement_group_prefix(namespace, prefix), timeout_s)
        remote_class = ray.remote(fused_worker_class(role_specs))
        world, actors, names = pool.world_size, [], []
        share = 1.0 / pool.max_colocate_count
        try:
            for rank, (group, bundle_index, local_rank) in enumerate(pool.slots()):
                name = f"{prefix}-rank{rank}"
                rank_env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank)}
                options: dict[str, Any] = {
                    "name": name,
                    "namespace": namespace,
                    "lifetime": "detached",
                    "max_restarts": 0,
                    "num_cpus": pool.cpus_per_worker * share,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=bundle_index
                    ),
                }
                if env_vars:  # what the process needs from its start (PYTHONPATH): a process of its own
                    options["runtime_env"] = {"env_vars": env_vars}
                if pool.accelerator == "GPU":
                    options["num_gpus"] = share
                elif pool.accelerator:
                    options["resources"] = {pool.accelerator: share}
                actors.append(remote_class.options(**options).remote(role_specs, rank_env, labels, imports))
                names.append(name)
            group = cls(actors, names, role_specs, namespace, prefix)
            if join:
                group.join("nccl" if pool.accelerator == "GPU" else "gloo", timeout_s)
        except BaseException as error:  # a half-made group holds resources: free them before reporting
            cls(actors, names, role_specs, namespace, prefix).kill()
            if isinstance(error, WorkerTimeoutError):
                raise_if_room_lost(pool, error, timeout_s)
            raise
        return group

    @classmethod
    def reattach(
        cls, prefix: str, namespace: str, role_specs: dict[str, RoleSpec], timeout_s: float = 30.0
    ) -> WorkerGroup:
        """The live group named ``prefix`` in ``namespace`` (raises ValueError when rank 0 does not exist)."""
        try:
            first = ray.get_actor(f"{prefix}-rank0", namespace=namespace)
        except ValueError as error:
            raise ValueError(f"no worker group {prefix!r} in namespace {namespace!r}") from error
        world = ray.get(first.health.remote(), timeout=timeout_s)["world_size"]
        names = [f"{prefix}-rank{rank}" for rank in range(world)]
        actors = [first] + [ray.get_actor(name, namespace=namespace) for name in names[1:]]
        group = cls(actors, names, role_specs, namespace, prefix)
        group.health(timeout_s)
        return group

    def join(self, backend: str, timeout_s: float) -> None:
        """Wait for every rank to be constructed; with several, join them in a torch.distributed group (``backend``:
        gloo on CPU, nccl on GPU) whose rendezvous rank 0 hosts."""
        if self.world_size == 1:
            self.health(timeout_s)
            return
        master_addr, master_port = self._wait(
            [self.actors[0].master_address.remote()], "set-up", timeout_s, self.names[:1]
        )[0]
        self._wait(
            [a.setup_distributed.remote(master_addr, master_port, backend) for a in self.actors],
            "set-up",
            timeout_s,
            self.names,
        )

    # ------------------------------------------------------------------ calls
    def role(self, role: str, timeout_s: float = 600.0) -> RoleView:
        """The methods of one role; each call waits at most ``timeout_s`` unless the call says otherwise."""
        if role not in self.roles:
            raise KeyError(f"this worker group has roles {self.roles}, not {role!r}")
        return RoleView(self, role, timeout_s)

    def execute(
        self, method: str, *args: Any, timeout_s: float = 600.0, stage: str | None = None, **kwargs: Any
    ) -> Any:
        """Call ``method`` (a role-prefixed name) on the ranks according to its dispatch mode."""
        mode = dispatch_mode(getattr(self.fused_class, method))
        per_rank, pad_size = split_arguments(mode, self.world_size, args, kwargs)
        refs = [getattr(actor, method).remote(*a, **k) for actor, (a, k) in zip(self.actors, per_rank)]
        results = self._wait(refs, stage or method, timeout_s, self.names[: len(refs)])
        return collect_results(mode, results, pad_size)

    def set_roles(self, role_specs: dict[str, RoleSpec], timeout_s: float = 30.0) -> None:
        """Make every rank's role objects again with ``role_specs``' arguments (same roles and classes): a group
        started before its run's config was final gets the final one before it loads its models."""
        self._wait([actor.set_roles.remote(role_specs) for actor in self.actors], "set roles", timeout_s, self.names)

    def serve_again(self, role_specs: dict[str, RoleSpec], labels: dict[str, str], timeout_s: float) -> list[str]:
        """Make every rank ready for another run (:meth:`infra.fused_worker.FusedWorkerBase.serve_again`); returns
        what keeps each from it ("" where nothing does)."""
        refs = [actor.serve_again.remote(role_specs, labels) for actor in self.actors]
        return self._wait(refs, "serve again", timeout_s, self.names)

    def label(self, labels: dict[str, str], timeout_s: float = 10.0) -> None:
        """Label every rank (their health reports carry the labels: which run the group serves)."""
        self._wait([actor.set_labels.remote(labels) for actor in self.actors], "label", timeout_s, self.names)

    def health(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Each rank's health report; WorkerDiedError / WorkerTimeoutError name the first bad worker."""
        reports = self._wait([actor.health.remote() for actor in self.actors], "health check", timeout_s, self.names)
        self.nodes = {name: report["node"] for name, report in zip(self.names, reports)}
        return reports

    def _where(self, name: str) -> str:
        """`` on node <id>`` for a worker whose node a health check saw, and whether that node has left the
        cluster (a machine lost, not only a process)."""
        node = self.nodes.get(name)
        if not node:
            return ""
        alive = any(entry["NodeID"] == node and entry["Alive"] for entry in ray.nodes())
        return f" on node {node[:12]}" + ("" if alive else ", which has left the cluster")

    def _wait(self, refs: list, stage: str, timeout_s: float, names: list[str]) -> list[Any]:
        """Results in rank order; the first failure is raised at once, naming its worker."""
        index_of = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending, deadline = list(refs), time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = [names[index_of[ref]] for ref in pending]
                raise WorkerTimeoutError(
                    f"stage {stage!r}: workers {late} did not answer within {timeout_s:.0f}s; raise "
                    "trainer.worker_timeout_s if the stage is just slow"
                )
            ref = ready[0]
            try:
                results[index_of[ref]] = ray.get(ref)
            except RayActorError as error:
                name = names[index_of[ref]]
                raise WorkerDiedError(
                    f"stage {stage!r}: worker {name}{self._where(name)} died ({type(error).__name__}); the group "
                    "must be rebuilt from the last checkpoint",
                    name,
                ) from error
            except RayTaskError as error:
                raise worker_exception(error, stage, names[index_of[ref]]) from error
        return results

    # ------------------------------------------------------------------ cleanup
    @staticmethod
    def kill_named(prefix: str, namespace: str) -> int:
        """Kill whatever ranks of the group ``prefix`` still exist (after a failed reattach); returns how many."""
        killed, rank = 0, 0
        while True:
            try:
                actor = ray.get_actor(f"{prefix}-rank{rank}", namespace=namespace)
            except ValueError:
                break
            ray.kill(actor, no_restart=True)
            killed, rank = killed + 1, rank + 1
        remove_placement_groups(f"{placement_group_prefix(namespace, prefix)}-")
        return killed

    def kill(self) -> None:
        """End every worker and free the pool's placement groups."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        remove_placement_groups(f"{placement_group_prefix(self.namespace, self.prefix)}-")


class RoleView:
    """``view.method(...)`` = ``group.execute("<role>_method", ...)``: the bare method names of one role."""

    def __init__(self, group: WorkerGroup, role: str, timeout_s: float = 600.0):
        self._group, self._role, self._timeout_s = group, role, timeout_s

    def __getattr__(self, method: str) -> Any:
        full_name = f"{self._role}_{method}"
        if not hasattr(self._group.fused_class, full_name):
            raise AttributeError(f"role {self._role!r} has no dispatched method {method!r}")

        def call(*args: Any, timeout_s: float | None = None, stage: str | None = None, **kwargs: Any) -> Any:
            return self._group.execute(
                full_name, *args, timeout_s=timeout_s or self._timeout_s, stage=stage or method, **kwargs
            )

        return call
