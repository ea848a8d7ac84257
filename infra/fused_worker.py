"""Fusing several role classes into one Ray actor process (verl's colocated worker), methods role-prefixed.

``fused_worker_class({"actor_rollout_ref": (ActorRolloutRefWorker, args, kwargs), "critic": (...)})`` builds a
plain class whose instances hold one object per role and expose ``actor_rollout_ref_update_actor``,
``critic_compute_values``, ... ; each exposed method keeps its dispatch mode. The fused process also joins the
torch.distributed group of its worker group and answers health checks.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from rl_core.workers.dispatch import DISPATCH_ATTRIBUTE, dispatch_mode

RoleSpec = tuple[type, tuple, dict]


def _public_methods(cls: type) -> dict[str, Callable]:
    return {
        name: getattr(cls, name)
        for name in dir(cls)
        if not name.startswith("_") and callable(getattr(cls, name)) and dispatch_mode(getattr(cls, name))
    }


def _forwarder(role: str, method_name: str, mode: str) -> Callable:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.roles[role], method_name)(*args, **kwargs)

    call.__name__ = f"{role}_{method_name}"
    setattr(call, DISPATCH_ATTRIBUTE, mode)
    return call


class FusedWorkerBase:
    """What every fused worker process has besides its roles: distributed set-up and health."""

    def __init__(
        self,
        role_specs: dict[str, RoleSpec],
        rank_env: dict[str, str],
        labels: dict[str, str] | None = None,
        imports: tuple[str, ...] = (),
    ):
        """``rank_env``: RANK / WORLD_SIZE / LOCAL_RANK, set here rather than in a Ray ``runtime_env``, which would
        start a process of its own for the actor where Ray has idle ones started already (~1 s of start-up).
        ``labels``: as :meth:`set_labels`. ``imports``: modules imported before the worker answers (a standby worker
        imports what a used one had, :meth:`imported_modules`); one that does not import is skipped."""
        os.environ.update(rank_env)
        self.set_roles(role_specs)
        self.started_at = time.time()
        self.labels: dict[str, str] = dict(labels or {})
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()  # the Ray node this worker runs on
        for name in imports:
            try:
                importlib.import_module(name)
            except Exception:  # e.g. a module made at run time; the run imports what it needs anyway
                pass

    def set_roles(self, role_specs: dict[str, RoleSpec]) -> None:
        """Make the role objects (again) from ``role_specs``: the same roles and classes this process was made for,
        with other arguments (a group started before its run's config was final). Nothing is loaded yet."""
        if set(role_specs) != set(getattr(self, "roles", role_specs)):
            raise ValueError(f"this worker holds roles {sorted(self.roles)}, not {sorted(role_specs)}")
        self.roles = {role: cls(*args, **kwargs) for role, (cls, args, kwargs) in role_specs.items()}

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the process group's rendezvous."""
        import ray

        with socket.socket() as probe:
            probe.bind(("", 0))
            return ray.util.get_node_ip_address(), probe.getsockname()[1]

    def setup_distributed(self, master_addr: str, master_port: int, backend: str) -> None:
        """Join the worker group's torch.distributed group (RANK/WORLD_SIZE/LOCAL_RANK are already in the env)."""
        from rl_core.workers.fsdp import init_distributed_from_env

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
        init_distributed_from_env(backend)

    def set_labels(self, labels: dict[str, str]) -> None:
        """What the controller says this worker serves (e.g. its training run), reported by :meth:`health`."""
        self.labels.update(labels)

    def imported_modules(self, packages: list[str]) -> list[str]:
        """The modules of ``packages`` (top-level names) this process has imported, in the order it imported them."""
        return [name for name in list(sys.modules) if name.partition(".")[0] in packages]

    def health(self) -> dict[str, Any]:
        """Liveness and where the weights are: rank, pid, Ray node id, start time, labels, and each role's number of
        updates done and begun (they differ while an update runs, or after one failed half-way: the weights then match
        no checkpoint)."""
        return {
            "rank": int(os.environ.get("RANK", 0)),
            "world_size": int(os.environ.get("WORLD_SIZE", 1)),
            "pid": os.getpid(),
            "node": self.node_id,
            "started_at": self.started_at,
            "labels": dict(self.labels),
            "steps_trained": {role: getattr(obj, "steps_trained", None) for role, obj in self.roles.items()},
            "updates_started": {role: getattr(obj, "updates_started", None) for role, obj in self.roles.items()},
        }


def fused_worker_class(role_specs: dict[str, RoleSpec]) -> type:
    """A subclass of :class:`FusedWorkerBase` with ``<role>_<method>`` for every dispatch-declared method of each
    role."""
    methods: dict[str, Any] = {}
    for role, (cls, _, _) in role_specs.items():
        for name, method in _public_methods(cls).items():
            methods[f"{role}_{name}"] = _forwarder(role, name, dispatch_mode(method))
    return type("FusedWorker_" + "_".join(role_specs), (FusedWorkerBase,), methods)
