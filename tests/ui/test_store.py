"""The inspector's data layer: downsampling against a plain loop, and a long run stays small on the wire."""

import random

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from ui.store import RunStore, downsample_index


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
    """The rule restated as a plain loop: equal buckets of consecutive points, each keeps its min and its max (their
    indices)."""
    if len(steps) <= max_points:
        return list(range(len(steps)))
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
    return out


@pytest.mark.parametrize("length,max_points", [(10, 20), (1000, 100), (997, 64), (5, 4)])
def test_downsample_matches_the_plain_loop(length, max_points):
    rng = random.Random(length)
    steps = list(range(1, length + 1))
    values = [rng.gauss(0, 1) for _ in steps]
    kept = downsample_index(steps, values, max_points)
    assert kept == plain_downsample(steps, values, max_points)
    kept_values = [values[i] for i in kept]
    assert len(kept) <= max(max_points, length if length <= max_points else 0)
    assert max(values) in kept_values and min(values) in kept_values  # spikes survive


def test_a_run_with_10000_steps_is_served_downsampled(tmp_path):
    """(Speed with 50 metrics: bench/ui_inspector.py.)"""
    run_id = log_long_run(
        f"sqlite:///{tmp_path}/mlflow.db",
        tmp_path,
        steps=10_000,
        names=["critic/score/mean", "timing_s/update_actor", "timing_s/gen", "timing_s/tools", "perf/time_per_step"],
    )
    store = RunStore(f"sqlite:///{tmp_path}/mlflow.db")
    curves = store.curves([run_id], max_points=1000)
    timeline = store.timeline(run_id, max_points=500)
    (score,) = curves["score"]
    assert 500 < len(score["steps"]) <= 1000 and score["steps"] == sorted(score["steps"])
    assert max(score["values"]) == 96.0 and min(score["values"]) == 0.0
    assert len(timeline["steps"]) <= 500 and len(timeline["total"]) == len(timeline["steps"])
    # in the order they run; tools runs inside gen, so it is not stacked
    assert [s["stage"] for s in timeline["stages"]] == ["gen", "update_actor"]


def test_the_timeline_overhead_is_the_step_time_the_stages_leave(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("t", artifact_location=tmp_path.as_uri())).info.run_id
    logged = {  # step -> (gen, reward, update_actor, testing, tools, time_per_step)
        1: (0.5, 0.1, 1.0, None, 0.2, 2.0),
        2: (0.4, 0.1, 0.9, 0.6, 0.1, 2.5),
        3: (0.6, 0.2, 1.1, None, 0.0, 1.8),  # the stages took longer than the step's clock: no negative overhead
    }
    names = ("gen", "reward", "update_actor", "testing", "tools")
    for step, values in logged.items():
        for name, value in zip(names, values):
            if value is not None:
                client.log_metric(run_id, f"timing_s/{name}", value, step=step)
        client.log_metric(run_id, "perf/time_per_step", values[-1], step=step)
    timeline = RunStore(uri).timeline(run_id)
    assert timeline["steps"] == [1, 2, 3] and timeline["total"] == [2.0, 2.5, 1.8]
    assert [s["stage"] for s in timeline["stages"]] == ["gen", "reward", "update_actor", "testing"]
    assert timeline["stages"][3]["values"] == [0.0, 0.6, 0.0]
    assert timeline["overhead"] == pytest.approx([2.0 - 1.6, 2.5 - 2.0, 0.0])
    assert timeline["rollout"] is None  # colocated: one stream
    for step, seconds in ((2, 1.7), (3, 1.2)):  # a rollout of its own: its workers' seconds on each step's samples
        client.log_metric(run_id, "timing_s/generate_ahead", seconds, step=step)
    timeline = RunStore(uri).timeline(run_id)
    assert timeline["rollout"] == [None, 1.7, 1.2] and "generate_ahead" not in [s["stage"] for s in timeline["stages"]]


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
