"""The inspector's data layer: downsampling against a plain loop, and a long run stays small on the wire."""

import random

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from ui.store import RunStore, downsample


def log_long_run(tracking_uri, folder, steps, names):
    """A run with ``steps`` steps of each metric in ``names`` (value = step mod 97), logged in batches."""
    client = MlflowClient(tracking_uri)
    experiment = client.create_experiment("long", artifact_location=(folder / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    metrics = [Metric(name, float(step % 97), 0, step) for step in range(1, steps + 1) for name in names]
    for start in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[start : start + 1000])
    return run_id


def plain_downsample(steps, values, max_points):
    """The rule restated as a plain loop: equal buckets of consecutive points, each keeps its min and its max."""
    if len(steps) <= max_points:
        return steps, values
    buckets = max_points // 2
    out = []
    for b in range(buckets):
        members = [
            i for i in range(len(steps)) if int(b * len(steps) / buckets) <= i < int((b + 1) * len(steps) / buckets)
        ]
        if not members:
            continue
        lowest = members[0]
        highest = members[0]
        for i in members:
            if values[i] < values[lowest]:
                lowest = i
            if values[i] > values[highest]:
                highest = i
        out += sorted({lowest, highest})
    return [steps[i] for i in out], [values[i] for i in out]


@pytest.mark.parametrize("length,max_points", [(10, 20), (1000, 100), (997, 64), (5, 4)])
def test_downsample_matches_the_plain_loop(length, max_points):
    rng = random.Random(length)
    steps = list(range(1, length + 1))
    values = [rng.gauss(0, 1) for _ in steps]
    assert downsample(steps, values, max_points) == plain_downsample(steps, values, max_points)
    kept_steps, kept_values = downsample(steps, values, max_points)
    assert len(kept_steps) <= max(max_points, length if length <= max_points else 0)
    assert max(values) in kept_values and min(values) in kept_values  # spikes survive


def test_a_run_with_10000_steps_is_served_downsampled(tmp_path):
    """(Speed with 50 metrics: bench/ui_inspector.py.)"""
    run_id = log_long_run(
        f"sqlite:///{tmp_path}/mlflow.db",
        tmp_path,
        steps=10_000,
        names=["critic/score/mean", "timing_s/gen", "timing_s/update_actor"],
    )
    store = RunStore(f"sqlite:///{tmp_path}/mlflow.db")
    curves = store.curves([run_id], max_points=1000)
    timeline = store.timeline(run_id, max_points=500)
    (score,) = curves["score"]
    assert 500 < len(score["steps"]) <= 1000 and score["steps"] == sorted(score["steps"])
    assert max(score["values"]) == 96.0 and min(score["values"]) == 0.0
    assert len(timeline["steps"]) <= 500 and [s["stage"] for s in timeline["stages"]] == ["gen", "update_actor"]


def test_a_running_run_shows_new_steps_and_an_ended_run_is_read_once(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = log_long_run(uri, tmp_path, steps=5, names=["critic/score/mean"])
    store = RunStore(uri)
    assert store.curves([run_id])["score"][0]["steps"] == [1, 2, 3, 4, 5]
    MlflowClient(uri).log_metric(run_id, "critic/score/mean", 1.0, step=6)
    assert store.curves([run_id])["score"][0]["steps"] == [1, 2, 3, 4, 5, 6]  # still running: read again
    MlflowClient(uri).set_terminated(run_id)
    reads = []
    original = store.client.get_metric_history
    store.client.get_metric_history = lambda *args: reads.append(args) or original(*args)
    for _ in range(3):
        assert store.curves([run_id])["score"][0]["steps"] == [1, 2, 3, 4, 5, 6]
    assert len(reads) == 1  # ended: its history cannot change, so it is read once
