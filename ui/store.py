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

STEP_MARKER = "training/global_step"  # flows.tracking logs it once per step
SCORE = "critic/score/mean"
# the curves the page overlays: name -> the metrics that make it (the first one a run has)
CURVES = {
    "score": ("critic/score/mean",),
    "validation accuracy": (),  # every val-core/<source>/acc/mean_at_<n> of the run (see curve_keys)
    "KL": ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl"),
    "entropy": ("actor/entropy",),
    "response length": ("response_length/mean",),
    "throughput (tokens/s)": ("perf/throughput",),
}
SAMPLES_FOLDER = "samples"
ENDED = ("FINISHED", "FAILED", "KILLED")


def downsample(steps: list[int], values: list[float], max_points: int) -> tuple[list[int], list[float]]:
    """At most ``max_points`` points of a curve sorted by step: the points are cut into ``max_points // 2`` buckets of
    consecutive steps and each bucket keeps its minimum and its maximum (in step order). Short curves are returned
    unchanged."""
    if len(steps) <= max_points:
        return list(steps), list(values)
    buckets = max(1, max_points // 2)
    size = len(steps) / buckets
    out_steps: list[int] = []
    out_values: list[float] = []
    for bucket in range(buckets):
        start, end = int(bucket * size), int((bucket + 1) * size)
        if start >= end:
            continue
        indices = range(start, end)
        low = min(indices, key=lambda i: values[i])
        high = max(indices, key=lambda i: values[i])
        for index in sorted({low, high}):
            out_steps.append(steps[index])
            out_values.append(values[index])
    return out_steps, out_values


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

    def _points(self, run_id: str, key: str, ended: bool) -> list[tuple[int, float]]:
        """The metric's (step, value) history in step order."""

        def load() -> list[tuple[int, float]]:
            history = sorted(self.client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
            return [(m.step, m.value) for m in history]

        return self._cached((run_id, key), load, keep=ended)

    # ------------------------------------------------------------------ runs
    def experiments(self) -> list[dict[str, str]]:
        return [{"id": e.experiment_id, "name": e.name} for e in self.client.search_experiments()]

    def runs(self, experiment: str) -> list[dict[str, Any]]:
        """The experiment's runs, newest first: status, algorithm, model, step, latest score."""
        found = self.client.get_experiment_by_name(experiment) or self.client.get_experiment(experiment)
        runs = self.client.search_runs([found.experiment_id], order_by=["attributes.start_time DESC"], max_results=500)
        return [
            {
                "run_id": run.info.run_id,
                "name": run.info.run_name,
                "status": run.info.status,
                "algorithm": run.data.params.get("algorithm.adv_estimator", ""),
                "model": run.data.params.get("actor_rollout_ref.model.path", ""),
                "step": int(run.data.metrics.get(STEP_MARKER, 0)),
                "score": run.data.metrics.get(SCORE),
                "start_time": run.info.start_time,
                "experiment_id": run.info.experiment_id,
                "prefect_flow_run_id": run.data.tags.get("ppoflow.prefect_flow_run_id"),
            }
            for run in runs
        ]

    # ------------------------------------------------------------------ curves
    def curve_keys(self, run: Any) -> dict[str, list[str]]:
        """For each curve of :data:`CURVES`, the metric keys the MLflow ``run`` has."""
        metrics = run.data.metrics
        keys: dict[str, list[str]] = {}
        for name, candidates in CURVES.items():
            if name == "validation accuracy":
                keys[name] = sorted(k for k in metrics if k.startswith("val-core/") and "/acc/mean_at_" in k)
            else:
                keys[name] = [k for k in candidates if k in metrics][:1]
        return keys

    def curves(self, run_ids: list[str], max_points: int = 1000) -> dict[str, Any]:
        """``{curve name: [{run_id, key, steps, values}, ...]}`` for the selected runs."""
        out: dict[str, list] = {name: [] for name in CURVES}
        for run_id in run_ids:
            run = self.client.get_run(run_id)
            for name, keys in self.curve_keys(run).items():
                for key in keys:
                    points = self._points(run_id, key, run.info.status in ENDED)
                    steps, values = downsample([p[0] for p in points], [p[1] for p in points], max_points)
                    out[name].append({"run_id": run_id, "key": key, "steps": steps, "values": values})
        return out

    def timeline(self, run_id: str, max_points: int = 500) -> dict[str, Any]:
        """Seconds per stage per step (every ``timing_s/*`` metric), on one shared step axis."""
        run = self.client.get_run(run_id)
        keys = sorted(k for k in run.data.metrics if k.startswith("timing_s/"))
        histories = {k: dict(self._points(run_id, k, run.info.status in ENDED)) for k in keys}
        steps = sorted({step for history in histories.values() for step in history})
        if len(steps) > max_points:  # every n-th step: stacked bars need the same steps in every series
            stride = -(-len(steps) // max_points)
            steps = steps[::stride]
        return {
            "steps": steps,
            "stages": [
                {"stage": k[len("timing_s/") :], "values": [histories[k].get(s, 0.0) for s in steps]} for k in keys
            ],
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
