"""Resource pools: placement groups of one bundle per worker, STRICT_PACK on each node (verl's design).

A pool is described by ``process_on_nodes``: how many workers on each node (``[8, 8]`` = two nodes of 8).
Each worker's bundle is ``{GPU: 1, CPU: k}`` on a GPU cluster, ``{CPU: k}`` on a CPU-only one, or
``{<accelerator>: 1, CPU: k}`` for a custom accelerator resource. Several worker groups can share a pool
(``max_colocate_count`` = how many colocated worker processes one bundle hosts, each taking an equal share).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group


class InsufficientResourcesError(RuntimeError):
    """The cluster cannot hold a pool; the message says what is needed and what there is."""


@dataclass
class ResourcePool:
    name: str
    process_on_nodes: list[int]
    accelerator: str | None = None  # "GPU", a custom resource name, or None for CPU-only workers
    cpus_per_worker: float = 1.0
    max_colocate_count: int = 1
    capacity_wait_s: float = 0.0  # how long create() waits for the cluster to have room (nodes joining) before refusing
    placement_groups: list[PlacementGroup] = field(default_factory=list)
    # called every second while the bundles wait to be placed: frees room that others may give up (standby groups)
    make_room: Callable[[], object] | None = None

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus_per_worker, **({self.accelerator: 1} if self.accelerator else {})}

    def check_fits(self) -> None:
        """Fail early, and clearly, when no set of nodes can hold the pool."""
        unit = self.accelerator or "CPU"
        per_worker = 1 if self.accelerator else self.cpus_per_worker
        capacities = sorted((node["Resources"].get(unit, 0) for node in ray.nodes() if node.get("Alive")), reverse=True)
        needs = sorted(self.process_on_nodes, reverse=True)
        if len(capacities) < len(needs) or any(cap < n * per_worker for cap, n in zip(capacities, needs)):
            wanted = ", ".join(f"{n * per_worker:g} {unit}" for n in needs)
            have = ", ".join(f"{c:g}" for c in capacities) or "none"
            raise InsufficientResourcesError(
                f"resource pool {self.name!r} needs {len(needs)} node(s) with {wanted}; the cluster's nodes have "
                f"{unit}: {have}. Lower trainer.n_gpus_per_node / trainer.nnodes or add nodes"
            )

    def create(self, namespace_prefix: str, timeout_s: float = 60.0, detached: bool = True) -> None:
        """Reserve the bundles (one placement group per node, STRICT_PACK); waits up to ``capacity_wait_s`` for nodes
        that can hold them (a lost node replaced, an autoscaler adding one), then up to ``timeout_s`` for them to be
        placed."""
        deadline = time.monotonic() + self.capacity_wait_s
        while True:
            try:
                self.check_fits()
                break
            except InsufficientResourcesError as error:
                if time.monotonic() >= deadline:
                    self._note_wait(error)
                    raise
                time.sleep(1.0)
        for node_index, count in enumerate(self.process_on_nodes):
            group = placement_group(
                [self.bundle()] * count,
                strategy="STRICT_PACK",
                name=f"{namespace_prefix}-{self.name}-node{node_index}",
                lifetime="detached" if detached else None,
            )
            if not self._placed(group, timeout_s):
                remove_placement_group(group)
                self.remove()
                try:  # the cluster has shrunk meanwhile (a node lost): say what it lacks
                    self.check_fits()
                except InsufficientResourcesError as error:
                    self._note_wait(error)
                    raise
                raise InsufficientResourcesError(
                    f"resource pool {self.name!r}: node {node_index}'s {count} bundles {self.bundle()} were not placed "
                    f"within {timeout_s:.0f}s (are other runs holding the resources?)"
                )
            self.placement_groups.append(group)

    def _placed(self, group: PlacementGroup, timeout_s: float) -> bool:
        """Whether ``group`` is placed within ``timeout_s``, :attr:`make_room` called every second meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready, _ = ray.wait([group.ready()], timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            if ready:
                return True
            if time.monotonic() >= deadline:
                return False
            if self.make_room is not None:
                self.make_room()

    def _note_wait(self, error: InsufficientResourcesError) -> None:
        if self.capacity_wait_s > 0:
            error.add_note(f"waited {self.capacity_wait_s:g} s for room: trainer.capacity_wait_s")

    def slots(self) -> list[tuple[PlacementGroup, int, int]]:
        """(placement group, bundle index, local rank) for each worker, in global rank order."""
        return [(group, index, index) for group in self.placement_groups for index in range(group.bundle_count)]

    def remove(self) -> None:
        for group in self.placement_groups:
            remove_placement_group(group)
        self.placement_groups = []


def smallest_node_cpus() -> float:
    """The CPU count of the smallest live node of the connected cluster that has CPUs (a head started with none, as
    on KubeRay, hosts no worker)."""
    counts = [node["Resources"].get("CPU", 0) for node in ray.nodes() if node.get("Alive")]
    return min((count for count in counts if count > 0), default=1)


def remove_placement_groups(name_prefix: str) -> int:
    """Remove every live placement group whose name starts with ``name_prefix`` (cleanup after a reattach)."""
    removed = 0
    for group_id, info in ray.util.placement_group_table().items():
        if info.get("name", "").startswith(name_prefix) and info.get("state") != "REMOVED":
            # by id: a name is only found from the namespace of the driver that made the group (a dead controller's)
            remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(group_id))))
            removed += 1
    return removed


class ResourcePoolManager:
    """Pools by name and which role runs on which pool (e.g. actor_rollout_ref and critic share ``global_pool``)."""

    def __init__(self, pools: list[ResourcePool], role_to_pool: dict[str, str]):
        self.pools = {pool.name: pool for pool in pools}
        missing = sorted(set(role_to_pool.values()) - set(self.pools))
        if missing:
            raise ValueError(f"roles map to undefined resource pools {missing}; defined: {sorted(self.pools)}")
        self.role_to_pool = dict(role_to_pool)

    def pool_for(self, role: str) -> ResourcePool:
        if role not in self.role_to_pool:
            raise KeyError(f"role {role!r} has no resource pool; mapped roles: {sorted(self.role_to_pool)}")
        return self.pools[self.role_to_pool[role]]

    def create_all(self, namespace_prefix: str, timeout_s: float = 60.0) -> None:
        for pool in self.pools.values():
            pool.check_fits()
        for pool in self.pools.values():
            pool.create(namespace_prefix, timeout_s)

    def remove_all(self) -> None:
        for pool in self.pools.values():
            pool.remove()
