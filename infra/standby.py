"""Standby worker groups: started before a run asks for them, adopted by the run whose workers they fit.

A worker process spends seconds before a run can use it: Ray starts it, it imports torch, transformers and the
workers' code, then the model's code as the model loads. Ray binds a worker process to the job (the command) it was
started for, so the idle processes it keeps serve no later command; a *standby* group is a detached worker group of
its own namespace, with nothing loaded, that any later command may adopt: started for that, or the group of a run on
the stack, kept once that run has ended (flows/standby_workers.py decides when one is left, flows/workers.py which
runs fit it). It holds its resources like any group: a command that makes a group of another shape ends it first
(:func:`release`).

Ray's internal key-value store (it lives and dies with the cluster) records
* ``standby/<shape>/<namespace>``: a standby group and the shape of worker it offers; claimed by deleting the key
  (of two commands, one gets it);
* ``workers-of/<namespace>``: where the workers of a run's namespace (its checkpoint folder's) live once it adopted a
  standby group (:func:`live_namespace`): a later controller of the run reattaches there, a fresh run ends them there.
"""

from __future__ import annotations

import ray
from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_list, _internal_kv_put

from infra.worker_group import WorkerGroup

KV_NAMESPACE = "ppoflow"
STANDBY_KEY = "standby/"
ALIAS_KEY = "workers-of/"
NAMESPACE_MARK = "standby-"  # in a standby group's namespace name: its workers are found by it after a lost record


def register(namespace: str, shape: str) -> None:
    """Offer the worker group started in ``namespace`` (named as any run's group) to the runs of ``shape``."""
    _internal_kv_put(f"{STANDBY_KEY}{shape}/{namespace}", b"", namespace=KV_NAMESPACE)


def has_any() -> bool:
    """Whether any standby group is offered (one call to the store: a run checks this before working out its shape)."""
    return bool(_internal_kv_list(STANDBY_KEY, namespace=KV_NAMESPACE))


def claim(shape: str) -> str | None:
    """The namespace of a standby group offered for ``shape``, now the caller's (no other command gets it); None when
    there is none. Standby groups of other shapes are not touched."""
    for key in _internal_kv_list(f"{STANDBY_KEY}{shape}/", namespace=KV_NAMESPACE):
        if _internal_kv_del(key, namespace=KV_NAMESPACE) == 1:
            return key.decode().rsplit("/", 1)[1]
    return None


def release(prefix: str) -> int:
    """End every standby group on the cluster (its workers killed, its placement groups removed): the recorded ones
    and any whose record was lost (a command stopped between starting one and recording it). Returns how many
    workers were killed."""
    for key in _internal_kv_list(STANDBY_KEY, namespace=KV_NAMESPACE):
        _internal_kv_del(key, namespace=KV_NAMESPACE)
    adopted = {value.decode() for value in _aliases().values()}
    namespaces = {
        actor["namespace"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if NAMESPACE_MARK in actor["namespace"] and actor["namespace"] not in adopted
    }
    return sum(WorkerGroup.kill_named(prefix, namespace) for namespace in namespaces)


def adopt(namespace: str, live: str) -> None:
    """Record that the workers of ``namespace`` (a run's) live in ``live`` (the standby group it adopted)."""
    _internal_kv_put(ALIAS_KEY + namespace, live, namespace=KV_NAMESPACE)


def forget(namespace: str) -> None:
    """The workers of ``namespace`` live there again (its adopted group has ended)."""
    _internal_kv_del(ALIAS_KEY + namespace, namespace=KV_NAMESPACE)


def live_namespace(namespace: str) -> str:
    """Where the workers of ``namespace`` live: the namespace of the standby group it adopted, else itself."""
    live = _internal_kv_get(ALIAS_KEY + namespace, namespace=KV_NAMESPACE)
    return live.decode() if live else namespace


def _aliases() -> dict[str, bytes]:
    keys = _internal_kv_list(ALIAS_KEY, namespace=KV_NAMESPACE)
    return {key.decode()[len(ALIAS_KEY) :]: _internal_kv_get(key, namespace=KV_NAMESPACE) or b"" for key in keys}
