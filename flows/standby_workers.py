"""Standby worker groups on the ``ppoflow up`` stack: a run that ends leaves one, the stack's launcher offers one again.

A training run on the stack that finishes (or is told to stop) leaves a standby group of its workers' shape
(infra/standby.py), which the next run of that shape adopts (:func:`flows.workers.adopt_standby`): its own workers
when they can serve another run (:func:`serve_again`: their imports done, nothing to wait for), else a new group, in
their place, whose workers import what the used ones had imported, while no run waits. What it was made from is kept in
the stack's folder (:func:`standby_recipe`), so that the launcher offers the same group when the stack starts again.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import ray
from omegaconf import DictConfig, OmegaConf

from flows.workers import (
    PREFIX,
    RUN_LABEL,
    STANDBY_LABEL,
    release_standby,
    resource_pool,
    role_specs,
    standby_namespace,
    worker_shape,
    workers_namespace,
)
from infra import standby
from infra.cluster import is_persistent
from infra.worker_group import WorkerGroup

STANDBY_SWITCH = "PPOFLOW_STANDBY_WORKERS"  # "0": a run on the stack leaves no standby group
# what a standby worker imports of what a used one had: libraries and the project's worker code, never a user's own
# module (it may change before the run that adopts the worker)
STANDBY_IMPORTS = ("torch", "transformers", "peft", "safetensors", "tokenizers", "rl_core", "infra")
STANDBY_ROOM_S = 10.0  # how long a run ending waits for room for a standby group (another run may hold it)
SERVE_AGAIN_S = 10.0  # how long a run ending waits for its workers to be ready for another run


def leaves_standby() -> bool:
    """Whether a training run that ends (finished, or told to stop) leaves a standby group (infra/standby.py): when it
    is connected to the Ray of the running ``ppoflow up`` stack (not the embedded cluster, which ends with the command,
    nor a team's, whose resources a standby group would hold), unless ``PPOFLOW_STANDBY_WORKERS=0``."""
    if os.environ.get(STANDBY_SWITCH) == "0" or not is_persistent():
        return False
    from infra.stack import HOST, Stack

    stack = Stack.load()
    ray_service = stack.services.get("ray") if stack is not None else None
    return ray_service is not None and ray.get_runtime_context().gcs_address == f"{HOST}:{ray_service.port}"


def leave_standby(used: WorkerGroup, config: DictConfig) -> str:
    """Offer a standby group of the run's shape once the run's ``used`` group has served it: that group itself when it
    can serve another run (:func:`serve_again`), else a new one in its place (:func:`offer_standby`), its workers
    importing what the used rank 0 had imported of STANDBY_IMPORTS, the used group ended. The stack's next start offers
    the same (:func:`offer_recorded_standby`). Returns a line saying what was left."""
    began = time.perf_counter()
    try:
        imports = ray.get(used.actors[0].imported_modules.remote(list(STANDBY_IMPORTS)), timeout=2)
    except Exception:  # a rank gone or still in a call (a run told to stop): it imports what its constructor does
        imports = []
    why_not_again = serve_again(used, config) if imports else "a worker is gone or still in a call"
    if why_not_again:
        used.kill()
        standby.forget(workers_namespace(config))
        left = offer_standby(config, imports)
        if left is not None:
            return f"no standby workers left ({left})"
        how = f"new ones importing {len(imports)} modules (not the run's own: {why_not_again})"
    else:
        how = "the run's own, their imports done"
    _record_recipe(config, imports)
    return (
        f"left {resource_pool(config).world_size} standby worker(s) in {time.perf_counter() - began:.2f} s, {how}, "
        "for the next run of this shape"
    )


def serve_again(used: WorkerGroup, config: DictConfig) -> str:
    """Offer the run's ``used`` group as the standby group of its shape, its processes as they are: when it lives in
    a standby group's namespace (adopted, or started there on the stack, :func:`flows.workers.start_fresh_workers`; a
    group in the run's own namespace would be found there by a later controller of the run) and every worker can
    serve another run (:meth:`FusedWorkerBase.serve_again`: a CPU worker that imported no user code and left nothing
    running). Returns "" when it is offered, else why not."""
    if standby.NAMESPACE_MARK not in used.namespace:
        return "they were started in the run's own namespace"
    try:
        answers = used.serve_again(role_specs(config), {RUN_LABEL: STANDBY_LABEL}, SERVE_AGAIN_S)
    except Exception as error:  # a rank gone, or still busy
        return f"{type(error).__name__}: {error}"[:200]
    why_not = next((answer for answer in answers if answer), "")
    if why_not:
        return why_not
    release_standby()  # one standby group at a time (this one is still recorded as the run's: spared)
    standby.register(used.namespace, worker_shape(config))
    standby.forget(workers_namespace(config))
    return ""


def _record_recipe(config: DictConfig, imports: list[str]) -> None:
    """Write down what the standby group was made from (:func:`standby_recipe`): the run's config without its
    secrets (the standby workers need none: the adopting run gives its own config) and the workers' imports."""
    from flows.secrets import redacted

    recipe, staging = standby_recipe(), standby_recipe().with_suffix(".tmp")
    recipe.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as handle:
        json.dump({"config": OmegaConf.to_yaml(redacted(config)), "imports": imports}, handle)
    os.replace(staging, recipe)


def offer_standby(config: DictConfig, imports: list[str]) -> str | None:
    """Start a standby group of ``config``'s worker shape, each worker importing ``imports``, while no run waits, and
    offer it (infra/standby.py); an earlier one ends first. None when it is offered, else why not: no room within
    STANDBY_ROOM_S (another run holds it), or the cluster failed to start it; a run that ended is not failed by what is
    only a head start for the next."""
    namespace = standby_namespace()
    try:
        release_standby()  # one at a time
        WorkerGroup.create(
            resource_pool(config),
            role_specs(config),
            PREFIX,
            namespace,
            timeout_s=STANDBY_ROOM_S,
            join=False,  # the command ends now: the workers start on their own, their adopter joins them
            labels={RUN_LABEL: STANDBY_LABEL},
            imports=tuple(imports),
        )
        standby.register(namespace, worker_shape(config))  # unrecorded, it would be ended as one whose record was lost
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def standby_recipe() -> Path:
    """What the stack's last standby group was made from (a run's config and its workers' imports), in its folder."""
    from infra.stack import stack_home

    return stack_home() / "standby.json"


def offer_recorded_standby() -> str:
    """Offer the standby group the stack's last run left (:func:`standby_recipe`) on the stack's Ray: what its launcher
    does as it starts (flows/launcher.py), so that the first run after ``ppoflow up`` (or after the launcher restarted
    with changed code) finds one too. Returns a line saying what happened."""
    from infra.cluster import connect
    from infra.stack import HOST, Stack

    try:
        record = json.loads(standby_recipe().read_text())
    except (OSError, ValueError):
        return "no standby workers: no run has left any on this stack"
    stack = Stack.load()
    if stack is None or "ray" not in stack.services or os.environ.get(STANDBY_SWITCH) == "0":
        return "no standby workers: no stack's Ray, or PPOFLOW_STANDBY_WORKERS=0"
    connect(f"{HOST}:{stack.services['ray'].port}")
    config = OmegaConf.create(record["config"])
    why_not = offer_standby(config, record["imports"])
    return f"no standby workers ({why_not})" if why_not else "standby workers offered as the stack's last run left them"
