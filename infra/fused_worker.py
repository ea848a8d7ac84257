"""Fusing several role classes into one Ray actor process (verl's colocated worker), methods role-prefixed.

``fused_worker_class({"actor_rollout_ref": (ActorRolloutRefWorker, args, kwargs), "critic": (...)})`` builds a
plain class whose instances hold one object per role and expose ``actor_rollout_ref_update_actor``,
``critic_compute_values``, ... ; each exposed method keeps its dispatch mode. The fused process also joins the
torch.distributed group of its worker group, answers health checks, and, once its run has ended, may serve another
(:meth:`FusedWorkerBase.serve_again`).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import site
import socket
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from typing import Any

from rl_core.workers.dispatch import DISPATCH_ATTRIBUTE, dispatch_mode

RoleSpec = tuple[type, tuple, dict]
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREAD_PREFIX = "ppoflow-"  # the name of every thread the workers' code starts
WORKER_PACKAGES = ("rl_core", "infra")  # the project's code a worker runs (the controller's, flows, it never imports)


def library_folders() -> list[str]:
    """Where code that stays put while a worker lives is found: the standard library, the site-packages folders,
    and the workers' own packages of this project (their version is part of a standby group's shape)."""
    paths = sysconfig.get_paths()
    folders = [paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")]
    folders += [*site.getsitepackages(), site.getusersitepackages()]
    folders += [os.path.join(PROJECT_ROOT, package) for package in WORKER_PACKAGES]
    return sorted({os.path.realpath(folder) + os.sep for folder in folders})


def modules_from_elsewhere(folders: list[str]) -> list[str]:
    """The imported modules with a source file or package folder outside ``folders`` (a user's module: a custom
    reward's file, a model's ``external_lib``, code a pickled function brought); modules without one (built in, made
    at run time) are not counted."""
    found = []
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        try:
            locations = [where] if where else list(getattr(module, "__path__", None) or [])
        except Exception:  # an odd module's __path__
            locations = []
        # a relative "file" names no place (torch.ops' "_ops.py")
        real = [os.path.realpath(place) for place in locations if isinstance(place, str) and os.path.isabs(place)]
        if any(not location.startswith(tuple(folders)) for location in real):
            found.append(name)
    return found


def child_processes() -> list[int]:
    """This process's children (Linux's /proc; none found elsewhere)."""
    children = []
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                parent = stat.read().rsplit(")", 1)[1].split()[1]  # the fields after the command's name: state, ppid
        except (OSError, IndexError):  # not a process, or one that just ended
            continue
        if int(parent) == os.getpid():
            children.append(int(pid))
    return children


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
        self.served = 0  # runs this process served before the current one (:meth:`serve_again`)
        self.labels: dict[str, str] = dict(labels or {})
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()  # the Ray node this worker runs on
        for name in imports:
            try:
                importlib.import_module(name)
            except Exception:  # e.g. a module made at run time; the run imports what it needs anyway
                pass
        self.threads_at_start = {thread.ident for thread in threading.enumerate()}

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

    def serve_again(self, role_specs: dict[str, RoleSpec], labels: dict[str, str]) -> str:
        """Serve no run any more, ready for the next (a standby worker again, flows/standby_workers.py): the process
        group left, the role objects made anew from ``role_specs`` (the ended run's models, optimizers and caches
        dropped, their memory handed back to the system), ``labels`` its only labels. Returns "" when done, else
        why this process should serve no other run (the caller then ends it): it used a GPU or ran vLLM (dropping
        their objects is not known to free their memory and engine processes), it imported code from outside
        :func:`library_folders` (a user's module, which may change before the next run), or a thread or child
        process of the ended run is still alive (a thread of its code's, THREAD_PREFIX, or any that is not a daemon)."""
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return "it used a GPU"
        if "vllm" in sys.modules:
            return "it ran vLLM"
        elsewhere = modules_from_elsewhere(library_folders())
        if elsewhere:
            return f"it imported {len(elsewhere)} module(s) from outside the installed libraries: {elsewhere[:3]}"
        if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.set_roles(role_specs)
        gc.collect()
        try:
            ctypes.CDLL(None).malloc_trim(0)  # glibc keeps freed heap memory for the process otherwise
        except (OSError, AttributeError):  # another C library
            pass
        threads = [  # a library's daemon thread (tqdm's monitor) is the process's; the project names its own
            thread.name
            for thread in threading.enumerate()
            if thread.ident not in self.threads_at_start
            and (thread.name.startswith(THREAD_PREFIX) or not thread.daemon)
        ]
        if threads:
            return f"a thread of the ended run is still alive: {threads[:3]}"
        if child_processes():
            return "a child process of the ended run is still alive"
        self.labels, self.served = dict(labels), self.served + 1
        return ""

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
            "served": self.served,
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
