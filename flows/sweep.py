"""The sweep flow: many training runs over a grid or a search space, nested under one MLflow parent run, compared.

The sweep is written as Hydra overrides, parsed by Hydra's own override parser (:mod:`flows.sweep_space`): a plain
``key=value`` holds for every child, a sweep value varies.

* ``search="grid"``: every combination of the choice and range sweeps
  (``algorithm.adv_estimator=grpo,rloo actor_rollout_ref.actor.optim.lr=1e-5,3e-5`` -> 4 children);
* ``search="random"`` / ``"tpe"``: ``trials`` children drawn by Optuna from the same choices and ranges and from
  intervals (``interval(1e-6,1e-4)``, ``tag(log,interval(1e-6,1e-4))``). The Optuna study is stored next to the
  MLflow store (``optuna.db`` beside a SQLite store, else in ``trainer.default_local_dir``) under the sweep's name,
  so the same sweep started again continues it.

Each child is a training run whose MLflow run is nested under the parent (``mlflow.parentRunId``) with its own
checkpoint folder; children run as the ``ppoflow-train/train`` deployment when the sweep itself runs as a deployment
of ``ppoflow serve`` (which serves both), else as subflows; one after another. A child that fails is marked (``FAILED``,
with its error) and the sweep goes on; a
sweep started again with the same name continues under the same parent run and skips the children that finished.
At the end the comparison (each child's overrides and final metrics, best first by ``metric`` in ``direction``) is
a Prefect markdown artifact and ``comparison.md`` / ``comparison.json`` on the parent run, with ``curves.png``.
"""

from __future__ import annotations

import functools
import json
import math
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from mlflow.entities import Param, RunTag
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig
from prefect import flow, runtime
from prefect.artifacts import create_markdown_artifact
from prefect.deployments import run_deployment

from flows.parameters import hydra_value
from flows.prefect_view import PrefectRunView, mlflow_run_url, one_line
from flows.sweep_space import SearchSpace, check_sweep, suggest, sweep_name
from flows.tracking import experiment_id, metric_key, open_store, tracking_uri
from flows.train import train
from rl_core.remote_folder import is_remote
from rl_core.step_checkpoint import run_checkpoints

TRAIN_DEPLOYMENT = "ppoflow-train/train"
SCORE_METRIC = "critic/score/mean"


@dataclass
class ChildResult:
    index: int
    overrides: list[str]
    status: str = "FAILED"  # FINISHED | FAILED
    run_id: str | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def optuna_storage(config: DictConfig) -> str:
    """Beside a SQLite MLflow store, else in ``trainer.default_local_dir``."""
    uri = tracking_uri(config)
    folder = (
        Path(uri.removeprefix("sqlite:///")).parent
        if uri.startswith("sqlite:///")
        else run_checkpoints(config.trainer).root  # a URL's: its local copy
    )
    folder = folder.expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'optuna.db'}"


# ---------------------------------------------------------------------------------------------- runs
def resolve_metric(metric: str, metrics: dict[str, float]) -> str:
    """``metric`` in MLflow's form; ``auto`` = the first validation mean (``val-core/.../mean_at_n``), else the
    score."""
    if metric != "auto":
        return metric_key(metric)
    val = sorted(k for k in metrics if k.startswith("val-core/") and "/mean_at_" in k)
    return val[0] if val else SCORE_METRIC


def children_as_deployments() -> bool:
    """True when this sweep runs as a deployment of ``ppoflow serve``, which serves the train deployment too (a
    deployment's READY status alone lags: it stays READY for a while after its server stopped)."""
    return runtime.deployment.id is not None


def run_child(overrides: list[str], tags: dict[str, str], as_deployment: bool) -> str | None:
    """Run one training child; its error in one line, or None when it finished."""
    if as_deployment:
        flow_run = run_deployment(TRAIN_DEPLOYMENT, parameters={"overrides": overrides, "tags": tags}, timeout=None)
        state = flow_run.state
    else:
        state = train(overrides=overrides, tags=tags, return_state=True)
    return (
        None
        if state is not None and state.is_completed()
        else (state.message if state is not None else "no final state")
    )


class ParentRun:
    """The sweep's MLflow parent run (the existing one of the same name, when there is one) and its children."""

    def __init__(self, config: DictConfig, name: str, settings: dict[str, Any]):
        self.client = open_store(tracking_uri(config))
        self.uri = tracking_uri(config)
        self.experiment_id = experiment_id(self.client, config)
        self.name = name
        found = self.client.search_runs(
            [self.experiment_id],
            f"tags.`ppoflow.sweep` = '{name}' and tags.`ppoflow.kind` = 'sweep'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if found:  # the same sweep started again: continue it
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(
                self.experiment_id, run_name=name, tags={"ppoflow.kind": "sweep", "ppoflow.sweep": name}
            ).info.run_id
            self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in settings.items()])

    def child_tags(self, index: int) -> dict[str, str]:
        return {"mlflow.parentRunId": self.run_id, "ppoflow.sweep": self.name, "ppoflow.sweep_child": str(index)}

    def child_run(self, index: int) -> Any:
        found = self.client.search_runs(
            [self.experiment_id],
            f"tags.`mlflow.parentRunId` = '{self.run_id}' and tags.`ppoflow.sweep_child` = '{index}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        return found[0] if found else None

    def child_overrides(self, config: DictConfig, index: int) -> list[str]:
        """What the sweep sets for child ``index``: its run name, its own checkpoint folder, the same store."""
        parent = config.trainer.default_local_dir
        parent = parent.rstrip("/") if is_remote(parent) else str(Path(parent).expanduser().resolve())
        folder = f"{parent}/sweeps/{self.run_id}/child-{index}"
        return [
            f"trainer.experiment_name={hydra_value(f'{self.name}-{index}')}",
            f"trainer.default_local_dir={hydra_value(folder)}",
            f"trainer.tracking_uri={hydra_value(self.uri)}",
            "trainer.resume_mode=auto",
        ]

    def record(self, index: int, overrides: list[str], error: str | None) -> ChildResult:
        """The child's result from its MLflow run; a child that failed before making one gets a FAILED run here."""
        run = self.child_run(index)
        if run is None:
            run = self.client.create_run(
                self.experiment_id, run_name=f"{self.name}-{index}", tags=self.child_tags(index)
            )
            self.client.set_terminated(run.info.run_id, status="FAILED")
        result = ChildResult(index, overrides, run_id=run.info.run_id, metrics=dict(run.data.metrics))
        if error is None and run.info.status == "FINISHED":
            result.status = "FINISHED"
        else:
            result.error = error or run.data.tags.get("ppoflow.error", f"the run ended {run.info.status}")
            self.client.log_batch(
                run.info.run_id, tags=[RunTag("ppoflow.error", result.error[:5000]), RunTag("ppoflow.status", "failed")]
            )
            if run.info.status != "FAILED":
                self.client.set_terminated(run.info.run_id, status="FAILED")
        return result


# ---------------------------------------------------------------------------------------------- comparison
def ranked(results: list[ChildResult], metric: str, direction: str) -> list[ChildResult]:
    """Best first by ``metric`` (``max`` or ``min``); children without the metric (failed ones) last."""

    def key(result: ChildResult) -> tuple[int, float]:
        value = result.metrics.get(metric)
        if value is None or not math.isfinite(value):
            return (1, 0.0)
        return (0, -value if direction == "max" else value)

    return sorted(results, key=key)


def comparison_markdown(name: str, results: list[ChildResult], metric: str, direction: str, swept: list[str]) -> str:
    columns = sorted(
        {k for r in results for k in r.metrics if k.startswith("val-core/") or k == SCORE_METRIC} | {metric}
    )
    lines = [
        f"# Sweep {name}: best first by `{metric}` ({direction})",
        "",
        "| rank | child | status | " + " | ".join(swept) + " | " + " | ".join(f"`{c}`" for c in columns) + " | run |",
        "|" + "---|" * (4 + len(swept) + len(columns)),
    ]
    for rank, result in enumerate(results, 1):
        chosen = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in result.overrides}
        values = [f"{result.metrics[c]:.4f}" if c in result.metrics else "-" for c in columns]
        status = result.status if result.error is None else f"FAILED: {result.error[:120]}"
        lines.append(
            f"| {rank} | {result.index} | {status} | "
            + " | ".join(chosen.get(k, "") for k in swept)
            + " | "
            + " | ".join(values)
            + f" | {result.run_id or '-'} |"
        )
    return "\n".join(lines) + "\n"


def curves_png(client: MlflowClient, results: list[ChildResult], metric: str, path: Path) -> None:
    """The children's training score and ``metric`` against the step, one line per child."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [SCORE_METRIC] if metric == SCORE_METRIC else [SCORE_METRIC, metric]
    figure, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for axis, name in zip(axes[0], names):
        for result in results:
            if result.run_id is None:
                continue
            history = sorted((m.step, m.value) for m in client.get_metric_history(result.run_id, name))
            if history:
                axis.plot(
                    *zip(*history),
                    marker="." if len(history) < 20 else None,
                    label=f"{result.index}: {' '.join(result.overrides)}",
                )
        axis.set_title(name)
        axis.set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ---------------------------------------------------------------------------------------------- the flow
def run_sweep(
    overrides: list[str],
    search: str = "grid",
    trials: int = 8,
    metric: str = "auto",
    direction: str = "max",
    name: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Everything the sweep flow does (see the module doc); returns the parent run id and the ranked children."""
    space, base, candidates = check_sweep(overrides, search, trials, direction)
    name = name or sweep_name(overrides, search)
    parent = ParentRun(
        base,
        name,
        {
            "sweep.search": search,
            "sweep.overrides": " ".join(overrides),
            "sweep.metric": metric,
            "sweep.direction": direction,
            "sweep.trials": trials if search != "grid" else len(candidates),
        },
    )
    view = PrefectRunView()
    view.log(f"sweep {name}: {search} over {', '.join(space.keys())}; MLflow parent run {parent.run_id}")
    run_one = functools.partial(run_child_once, parent, space, base, view, children_as_deployments())
    if candidates is not None:
        results = [run_one(index, child) for index, child in enumerate(candidates)]
    else:
        results = run_search(run_one, parent, space, base, name, search, trials, metric, direction, seed)
    order, chosen_metric = publish_comparison(parent, view, name, results, metric, direction, space.keys())
    return {
        "tracking_uri": parent.uri,
        "parent_run_id": parent.run_id,
        "name": name,
        "metric": chosen_metric,
        "children": [asdict(r) for r in order],
    }


def run_child_once(
    parent: ParentRun,
    space: SearchSpace,
    base: DictConfig,
    view: PrefectRunView,
    as_deployment: bool,
    index: int,
    child: list[str],
) -> ChildResult:
    """Child ``index`` of the sweep with the overrides ``child``: its earlier result when it finished before, else run
    now (a child that fails, or cannot even start, is marked and the sweep goes on)."""
    existing = parent.child_run(index)
    if existing is not None and existing.info.status == "FINISHED":
        view.log(f"child {index} ({' '.join(child)}) finished earlier: run {existing.info.run_id}")
        return ChildResult(index, child, "FINISHED", existing.info.run_id, metrics=dict(existing.data.metrics))
    view.log(f"child {index}: {' '.join(child)} ({'deployment ' + TRAIN_DEPLOYMENT if as_deployment else 'subflow'})")
    try:
        # a failed child frees its workers for the next one (unless the sweep's own overrides say otherwise)
        overrides = ["trainer.keep_workers=false", *space.fixed, *child, *parent.child_overrides(base, index)]
        error = run_child(overrides, parent.child_tags(index), as_deployment)
    except Exception as exc:
        error = one_line(exc)
    result = parent.record(index, child, error)
    view.log(f"child {index}: {result.status}" + (f" ({result.error})" if result.error else ""))
    return result


def run_search(
    run_one: Callable[[int, list[str]], ChildResult],
    parent: ParentRun,
    space: SearchSpace,
    base: DictConfig,
    name: str,
    search: str,
    trials: int,
    metric: str,
    direction: str,
    seed: int,
) -> list[ChildResult]:
    """A random or TPE search of ``trials`` children in the Optuna study ``name`` (continued when it exists: its
    finished trials count, a crashed sweep's running trial is marked failed)."""
    import optuna

    sampler = optuna.samplers.RandomSampler(seed=seed) if search == "random" else optuna.samplers.TPESampler(seed=seed)
    study = optuna.create_study(
        study_name=name,
        storage=optuna_storage(base),
        sampler=sampler,
        load_if_exists=True,
        direction="maximize" if direction == "max" else "minimize",
    )
    for stale in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(stale.number, state=optuna.trial.TrialState.FAIL)
    results = []
    for done in (t for t in study.get_trials(deepcopy=False) if t.state.is_finished()):
        run = parent.child_run(done.number)
        status = "FINISHED" if run is not None and run.info.status == "FINISHED" else "FAILED"
        overrides = [f"{k}={v}" for k, v in done.params.items()]
        metrics = dict(run.data.metrics) if run else {}
        results.append(ChildResult(done.number, overrides, status, run.info.run_id if run else None, metrics=metrics))
    while len(results) < trials:
        trial = study.ask()
        result = run_one(trial.number, suggest(trial, space))
        results.append(result)
        value = result.metrics.get(resolve_metric(metric, result.metrics)) if result.status == "FINISHED" else None
        if value is None:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial, value)
    return results


def publish_comparison(
    parent: ParentRun,
    view: PrefectRunView,
    name: str,
    results: list[ChildResult],
    metric: str,
    direction: str,
    swept: list[str],
) -> tuple[list[ChildResult], str]:
    """(the children best first, the metric compared): the comparison table, JSON and curves on the parent run (and
    as a Prefect artifact), the best child tagged, the parent run FINISHED."""
    finished_metrics = next((r.metrics for r in results if r.status == "FINISHED"), {})
    chosen_metric = resolve_metric(metric, finished_metrics)
    order = ranked(results, chosen_metric, direction)
    table = comparison_markdown(name, order, chosen_metric, direction, swept)
    with tempfile.TemporaryDirectory(prefix="ppoflow-sweep-") as folder:
        (Path(folder) / "comparison.md").write_text(table)
        (Path(folder) / "comparison.json").write_text(json.dumps([asdict(r) for r in order], indent=1))
        curves_png(parent.client, order, chosen_metric, Path(folder) / "curves.png")
        parent.client.log_artifacts(parent.run_id, folder)
    best = order[0] if order and order[0].status == "FINISHED" else None
    tags = [RunTag("ppoflow.status", "finished"), RunTag("ppoflow.sweep_metric", chosen_metric)]
    if best is not None:
        tags.append(RunTag("ppoflow.best_child_run_id", best.run_id))
        parent.client.log_metric(parent.run_id, f"best/{chosen_metric}", best.metrics[chosen_metric])
    parent.client.log_batch(parent.run_id, tags=tags)
    parent.client.set_terminated(parent.run_id, status="FINISHED")
    if view.in_flow_run:
        parent_url = mlflow_run_url(parent.uri, parent.experiment_id, parent.run_id)
        parent_line = f"[MLflow parent run]({parent_url})" if parent_url else f"MLflow parent run `{parent.run_id}`"
        create_markdown_artifact(
            f"{table}\n{parent_line}",
            key="sweep-comparison",
            description=f"sweep {name}: children best first by {chosen_metric}",
        )
    view.log(table)
    return order, chosen_metric


@flow(name="ppoflow-sweep")
def sweep(
    overrides: list[str],
    search: Literal["grid", "random", "tpe"] = "grid",
    trials: int = 8,
    metric: str = "auto",
    direction: Literal["max", "min"] = "max",
    name: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Training runs over the Hydra sweep in ``overrides`` (``key=a,b`` varies, ``key=v`` is fixed; ``range(...)``;
    ``interval(...)`` for random/tpe), compared by ``metric`` (``auto``: the first validation mean@n, else the
    training score) in ``direction``. ``trials`` bounds a random/tpe search; ``name`` (default: from the overrides)
    lets the same sweep continue where it stopped."""
    return run_sweep(overrides, search, trials, metric, direction, name, seed)
