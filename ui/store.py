"""What the run inspector reads from an MLflow tracking store (read only): runs, curves, stage timings, rollout
samples and configs, shaped for the page.

Curves are downsampled here, not in the browser: a run with 10,000 steps sends at most ``max_points`` points per
curve (:func:`downsample` keeps each bucket's minimum and maximum, so spikes stay visible). The metric histories of
runs that have ended are cached (they cannot change), so the page's polling costs a finished run nothing.
"""

from __future__ import annotations

import json
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from flows.tracking import PREFECT_FLOW_RUN_TAG, PREFECT_UI_TAG
from rl_core.ppo_step import TIMING_NAMES

STEP_MARKER = "training/global_step"  # flows.tracking logs it once per step
SCORE = "critic/score/mean"
# the curves the page opens with, before the user picks others: name -> the metrics that make it (the first one a run
# has; none listed: every val-core/<source>/acc/mean_at_<n> of the run, see default_curve_keys)
DEFAULT_CURVES = {
    "score": ("critic/score/mean",),
    "validation accuracy": (),
    "KL": ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl"),
    "entropy": ("actor/entropy",),
    "response length": ("response_length/mean",),
    "throughput (tokens/s)": ("perf/throughput",),
}
# the step's stages in the order they run (verl's timing names), then validation; the timeline stacks these only (a
# timing inside a stage, like timing_s/tools inside generation, would be counted twice)
STAGE_ORDER = (*TIMING_NAMES.values(), "testing")
STEP_TIME = "perf/time_per_step"
ROLLOUT_TIME = "timing_s/generate_ahead"  # a rollout of its own: its workers' seconds on the step's samples
SAMPLES_FOLDER = "samples"
ENDED = ("FINISHED", "FAILED", "KILLED")
PARENT_TAG = "mlflow.parentRunId"  # a sweep's children are nested under its parent run


def is_validation_accuracy(key: str) -> bool:
    return key.startswith("val-core/") and ("/acc/mean_at_" in key or "/acc/mean@" in key)


def downsample_index(steps: list[int], values: list[float], max_points: int) -> list[int]:
    """The indices of at most ``max_points`` points of a curve sorted by step: the points are cut into
    ``max_points // 2`` buckets of consecutive steps and each bucket keeps its minimum and its maximum (in step order).
    A short curve keeps every point."""
    if len(steps) <= max_points:
        return list(range(len(steps)))
    buckets = max(1, max_points // 2)
    size = len(steps) / buckets
    kept: list[int] = []
    for bucket in range(buckets):
        start, end = int(bucket * size), int((bucket + 1) * size)
        if start >= end:
            continue
        indices = range(start, end)
        low = min(indices, key=lambda i: values[i])
        high = max(indices, key=lambda i: values[i])
        kept += sorted({low, high})
    return kept


class RunStore:
    """Read-only views of one MLflow tracking store."""

    def __init__(self, tracking_uri: str, cache_size: int = 512):
        self.client = MlflowClient(tracking_uri)
        self.tracking_uri = tracking_uri
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()  # (run, metric key or samples file) -> data
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def _cached(self, key: tuple[str, str], load: Any, keep: bool) -> Any:
        """``load()``, remembered under ``key`` when ``keep`` (the data can no longer change); least recently used
        entries go first."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        value = load()
        if keep:
            with self._lock:
                self._cache[key] = value
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return value

    def _points(self, run_id: str, key: str, ended: bool) -> list[tuple[int, float, int]]:
        """The metric's (step, value, timestamp in ms) history in step order."""

        def load() -> list[tuple[int, float, int]]:
            history = sorted(self.client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
            return [(m.step, m.value, m.timestamp) for m in history]

        return self._cached((run_id, key), load, keep=ended)

    # ------------------------------------------------------------------ runs
    def experiments(self) -> list[dict[str, str]]:
        return [{"id": e.experiment_id, "name": e.name} for e in self.client.search_experiments()]

    def runs(self, experiment: str) -> list[dict[str, Any]]:
        """The experiment's runs, newest first: status, algorithm, model, step, latest training score and validation
        accuracy (the first ``val-core`` accuracy key), start and end times (ms), the sweep parent's id and the
        Prefect flow run's page when its server is still there (``ppoflow.prefect_ui_url``)."""
        found = self.client.get_experiment_by_name(experiment) or self.client.get_experiment(experiment)
        runs = self.client.search_runs([found.experiment_id], order_by=["attributes.start_time DESC"], max_results=500)
        rows = []
        for run in runs:
            metrics, tags = run.data.metrics, run.data.tags
            validation = sorted(k for k in metrics if is_validation_accuracy(k))
            prefect_ui, flow_run = tags.get(PREFECT_UI_TAG), tags.get(PREFECT_FLOW_RUN_TAG)
            rows.append(
                {
                    "run_id": run.info.run_id,
                    "name": run.info.run_name,
                    "status": run.info.status,
                    "algorithm": run.data.params.get("algorithm.adv_estimator", ""),
                    "model": run.data.params.get("actor_rollout_ref.model.path", ""),
                    "step": int(metrics.get(STEP_MARKER, 0)),
                    "score": metrics.get(SCORE),
                    "validation": metrics[validation[0]] if validation else None,
                    "validation_key": validation[0] if validation else None,
                    "start_time": run.info.start_time,
                    "end_time": run.info.end_time,
                    "experiment_id": run.info.experiment_id,
                    "parent_run_id": tags.get(PARENT_TAG),
                    "prefect_url": f"{prefect_ui}/runs/flow-run/{flow_run}" if prefect_ui and flow_run else None,
                }
            )
        return rows

    # ------------------------------------------------------------------ curves
    def metric_keys(self, run_ids: list[str]) -> list[str]:
        """Every metric key the runs logged, sorted (the page's picker groups them by their prefix)."""
        return sorted({key for run_id in run_ids for key in self.client.get_run(run_id).data.metrics})

    def default_curve_keys(self, run: Any) -> dict[str, list[str]]:
        """For each curve of :data:`DEFAULT_CURVES`, the metric keys the MLflow ``run`` has."""
        metrics = run.data.metrics
        return {
            name: sorted(k for k in metrics if is_validation_accuracy(k))
            if not candidates
            else [k for k in candidates if k in metrics][:1]
            for name, candidates in DEFAULT_CURVES.items()
        }

    def curves(self, run_ids: list[str], keys: list[str] | None = None, max_points: int = 1000) -> dict[str, Any]:
        """``{curve name: [{run_id, key, steps, values, times, start_time}, ...]}`` for the selected runs: one curve
        per metric of ``keys`` (named by the key), or the :data:`DEFAULT_CURVES`. ``times`` are the points' wall
        clock (ms), ``start_time`` the run's, for the page's wall-time and relative x-axes."""
        out: dict[str, list] = {key: [] for key in keys} if keys else {name: [] for name in DEFAULT_CURVES}
        for run_id in run_ids:
            run = self.client.get_run(run_id)
            wanted = {key: [key] for key in keys} if keys else self.default_curve_keys(run)
            for name, metric_keys in wanted.items():
                for key in metric_keys:
                    if key not in run.data.metrics:
                        continue
                    points = self._points(run_id, key, run.info.status in ENDED)
                    index = downsample_index([p[0] for p in points], [p[1] for p in points], max_points)
                    out[name].append(
                        {
                            "run_id": run_id,
                            "key": key,
                            "steps": [points[i][0] for i in index],
                            "values": [points[i][1] for i in index],
                            "times": [points[i][2] for i in index],
                            "start_time": run.info.start_time,
                        }
                    )
        return out

    def timeline(self, run_id: str, max_points: int = 500) -> dict[str, Any]:
        """Seconds per stage per step on one shared step axis: the stages of :data:`STAGE_ORDER` the run logged
        (``timing_s/<stage>``), in the order they run, the step's wall time ``perf/time_per_step`` (``total``) and
        what the stages leave of it (``overhead``: the controller, Prefect, logging; never below 0). With a rollout of
        its own, ``rollout``: the second stream, how long a rollout worker generated the samples each step trained on
        (``timing_s/generate_ahead``, beside the trainer's ``gen``: its wait for them); else None."""
        run = self.client.get_run(run_id)
        ended = run.info.status in ENDED
        stages = [stage for stage in STAGE_ORDER if f"timing_s/{stage}" in run.data.metrics]
        histories = {stage: {p[0]: p[1] for p in self._points(run_id, f"timing_s/{stage}", ended)} for stage in stages}
        totals = {p[0]: p[1] for p in self._points(run_id, STEP_TIME, ended)} if STEP_TIME in run.data.metrics else {}
        rollout = None
        if ROLLOUT_TIME in run.data.metrics:
            rollout = {p[0]: p[1] for p in self._points(run_id, ROLLOUT_TIME, ended)}
        steps = sorted({step for history in histories.values() for step in history if step > 0})
        if len(steps) > max_points:  # every n-th step: stacked bars need the same steps in every series
            stride = -(-len(steps) // max_points)
            steps = steps[::stride]
        values = {stage: [histories[stage].get(s, 0.0) for s in steps] for stage in stages}
        total = [totals.get(s) for s in steps]
        overhead = [
            None if t is None else max(0.0, t - sum(values[stage][i] for stage in stages)) for i, t in enumerate(total)
        ]
        return {
            "run_id": run_id,
            "steps": steps,
            "stages": [{"stage": stage, "values": values[stage]} for stage in stages],
            "total": total,
            "overhead": overhead,
            "rollout": None if rollout is None else [rollout.get(s) for s in steps],
        }

    # ------------------------------------------------------------------ rollout samples
    def sample_steps(self, run_id: str) -> list[int]:
        files = [a.path for a in self.client.list_artifacts(run_id, SAMPLES_FOLDER)]
        return sorted(int(Path(f).stem.split("_")[-1]) for f in files if f.endswith(".json"))

    def samples(self, run_id: str, step: int) -> list[dict[str, Any]]:
        """The rollout samples logged at ``step`` as rows (prompt, response, score, advantage, and per-token
        ``response_tokens`` / ``token_advantages`` / ``token_kl`` when the run logged them)."""
        path = f"{SAMPLES_FOLDER}/step_{step:06d}.json"

        def load() -> list[dict[str, Any]]:
            with tempfile.TemporaryDirectory() as folder:
                table = json.loads(Path(self.client.download_artifacts(run_id, path, folder)).read_text())
            return [dict(zip(table["columns"], values)) for values in table["data"]]

        return self._cached((run_id, path), load, keep=True)  # a step's samples are written once

    # ------------------------------------------------------------------ configs
    def config_diff(self, run_ids: list[str]) -> dict[str, Any]:
        """The config keys (MLflow params) whose values differ between the runs: ``{key: {run_id: value}}``."""
        params = {run_id: self.client.get_run(run_id).data.params for run_id in run_ids}
        keys = sorted(set().union(*(p.keys() for p in params.values()))) if params else []
        differing = {
            k: {r: params[r].get(k) for r in run_ids} for k in keys if len({params[r].get(k) for r in run_ids}) > 1
        }
        return {"run_ids": run_ids, "differing": differing}
