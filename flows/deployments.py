"""``ppoflow serve``: the train, evaluate and sweep flows as deployments of the Prefect server in ``PREFECT_API_URL``,
served by this process (each flow run in a subprocess of it).

* ``ppoflow-train/train``: the Prefect UI's form is :class:`flows.parameters.TrainSettings` plus a free list of
  Hydra overrides; Prefect checks the values against the schema before a run is created. At most
  ``train_concurrency`` training runs at a time (default 1: one machine, one run);
* ``ppoflow-evaluate/evaluate``: a checkpoint folder or ``models:/<name>/<version>``;
* ``ppoflow-sweep/sweep``: a grid or search in Hydra's sweep syntax; with ``sweep_cron`` or ``sweep_interval_s``
  it runs on that schedule with ``sweep_overrides`` (its children then run as the train deployment).

``ppoflow deploy --work-pool NAME`` registers the same deployments in a work pool instead, for Prefect workers
elsewhere to run (infra/k8s).
"""

from __future__ import annotations

from typing import Any

import httpx
from prefect import serve
from prefect.settings import PREFECT_API_URL
from prefect.types.entrypoint import EntrypointType

from flows.evaluate import evaluate
from flows.sweep import sweep
from flows.sweep_space import parse_search_space
from flows.train import train


class PrefectUnavailableError(ConnectionError):
    """No Prefect server answers at PREFECT_API_URL."""


START_A_SERVER = "start the local stack with `ppoflow up` (or point PREFECT_API_URL at a running Prefect server)"


def check_prefect_api() -> str:
    """The API URL, once it answers; else a :class:`PrefectUnavailableError` saying how to start one."""
    url = PREFECT_API_URL.value()
    if not url:
        raise PrefectUnavailableError(
            f"PREFECT_API_URL is not set: deployments live on a Prefect server; {START_A_SERVER}"
        )
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=5).raise_for_status()
    except httpx.HTTPError as error:
        raise PrefectUnavailableError(
            f"no Prefect server answers at PREFECT_API_URL={url} ({error}); {START_A_SERVER}"
        ) from None
    return url


def deployments(
    train_concurrency: int = 1,
    train_retries: int = 0,
    sweep_cron: str | None = None,
    sweep_interval_s: float | None = None,
    sweep_overrides: list[str] | None = None,
    sweep_options: dict[str, Any] | None = None,
    train_overrides: list[str] | None = None,
) -> list:
    """The three deployments (see the module doc); a failed training run is retried ``train_retries`` times (from its
    latest checkpoint, reattaching to its workers); ``train_overrides`` are the train form's default free overrides
    (a cluster's sizing: ``trainer.nnodes=2 trainer.n_gpus_per_node=8``)."""
    if train_concurrency < 1:
        raise ValueError(f"train_concurrency={train_concurrency}: at least one training run must be allowed")
    if (sweep_cron or sweep_interval_s) and not sweep_overrides:
        raise ValueError(
            "a scheduled sweep needs the sweep's overrides (e.g. --sweep-overrides algorithm.adv_estimator=grpo,rloo)"
        )
    if sweep_overrides:
        # a bad sweep fails now, not at 2 am
        parse_search_space(sweep_overrides, (sweep_options or {}).get("search", "grid"))
    sweep_parameters = {"overrides": sweep_overrides, **(sweep_options or {})} if sweep_overrides else {}
    return [
        train.with_options(retries=train_retries, retry_delay_seconds=5).to_deployment(
            name="train",
            concurrency_limit=train_concurrency,
            tags=["ppoflow"],
            entrypoint_type=EntrypointType.MODULE_PATH,
            parameters={"overrides": list(train_overrides)} if train_overrides else None,
            description="PPO/GRPO training: the form's knobs, then free Hydra overrides (`ppoflow config` lists every "
            "key).",
        ),
        evaluate.to_deployment(
            name="evaluate",
            tags=["ppoflow"],
            entrypoint_type=EntrypointType.MODULE_PATH,
            description="Greedy and sampled validation of a checkpoint or a registered model version.",
        ),
        sweep.to_deployment(
            name="sweep",
            tags=["ppoflow"],
            entrypoint_type=EntrypointType.MODULE_PATH,
            cron=sweep_cron,
            interval=sweep_interval_s,
            parameters=sweep_parameters,
            description="Training runs over a Hydra grid or an Optuna search, compared under one MLflow parent run.",
        ),
    ]


def serve_deployments(**options: Any) -> None:
    """Register the deployments and serve them until interrupted."""
    url = check_prefect_api()
    items = deployments(**options)
    print(
        f"serving {', '.join(f'{d.flow_name}/{d.name}' for d in items)} on {url.removesuffix('/api')} (Ctrl-C stops)",
        flush=True,
    )
    serve(*items, print_starting_message=False)


def register_in_work_pool(work_pool: str, **options: Any) -> list[str]:
    """Register the deployments in ``work_pool`` (run by its workers, e.g. on Kubernetes) instead of serving them
    here; returns their names."""
    check_prefect_api()
    names = []
    for deployment in deployments(**options):
        deployment.apply(work_pool_name=work_pool)
        names.append(f"{deployment.flow_name}/{deployment.name}")
    return names
