"""What a run records about itself in MLflow, on a real SQLite store: its experiment's kind (so that MLflow's UI
opens it as model training), the command, the overrides and the code's git commit, with secrets redacted; quick
steps' metrics sent together, every step there once flushed."""

import subprocess
import sys

from omegaconf import OmegaConf

import flows.tracking
from flows.tracking import EXPERIMENT_KIND, STEP_MARKER, RunTracker, experiment_id, open_store, provenance_tags
from tests.conftest import ROOT


def test_the_experiment_is_marked_as_model_training_new_or_old(tmp_path):
    client = open_store(f"sqlite:///{tmp_path}/mlflow.db")
    config = OmegaConf.create({"trainer": {"project_name": "p", "artifact_location": str(tmp_path / "artifacts")}})
    new = experiment_id(client, config)
    assert client.get_experiment(new).tags[EXPERIMENT_KIND[0]] == "custom_model_development"
    old = client.create_experiment("made-before", artifact_location=(tmp_path / "a2").as_uri())
    config.trainer.project_name = "made-before"
    assert experiment_id(client, config) == old
    assert client.get_experiment(old).tags[EXPERIMENT_KIND[0]] == "custom_model_development"


def test_a_run_records_its_command_overrides_and_commit_without_secrets(monkeypatch):
    monkeypatch.setattr(
        sys,
        "argv",
        ["ppoflow", "train", "trainer.tracking_uri=postgresql://u:hunter2@db/m", "reward.api_key=s3cr3tkey"],
    )
    overrides = ["algorithm.adv_estimator=rloo", "reward.api_key=s3cr3tkey"]
    tags = provenance_tags(overrides)
    assert tags["ppoflow.overrides"].splitlines() == ["algorithm.adv_estimator=rloo", "***"]
    assert "hunter2" not in tags["ppoflow.command"] and "s3cr3tkey" not in tags["ppoflow.command"]
    assert tags["ppoflow.command"].startswith("ppoflow train trainer.tracking_uri=postgresql://u:***@db/m")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout (CI's clone is one)
        assert tags["mlflow.source.git.commit"] == head.stdout.strip()


def test_an_experiment_without_an_artifact_location_keeps_them_where_its_store_does(tmp_path):
    """Beside a SQLite file: mlartifacts/ next to it; on a tracking server the server's store decides (the team stack's
    S3 bucket: tests/infra/test_team_stack.py)."""
    client = open_store(f"sqlite:///{tmp_path}/store/mlflow.db")
    config = OmegaConf.create({"trainer": {"project_name": "p", "artifact_location": None}})
    created = client.get_experiment(experiment_id(client, config))
    assert created.artifact_location == (tmp_path / "store" / "mlartifacts").as_uri()


def test_quick_steps_reach_mlflow_together_and_a_flush_sends_the_rest(tmp_path, monkeypatch):
    """Steps logged within METRICS_INTERVAL_S of the last send wait for the next one (one log_batch for several
    steps, at most MLflow's 1000 metrics a call); a flush (before a checkpoint, at the end) sends what waits."""
    config = OmegaConf.create(
        {
            "trainer": {
                "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
                "project_name": "p",
                "experiment_name": "e",
                "artifact_location": str(tmp_path / "artifacts"),
            }
        }
    )
    tracker = RunTracker(config)
    calls = []  # the number of metrics of each log_batch call (the real call made too)
    log_batch = tracker.client.log_batch

    def counted(run_id, metrics=(), **kwargs):
        if metrics:
            calls.append(len(metrics))
        return log_batch(run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(tracker.client, "log_batch", counted)
    monkeypatch.setattr(flows.tracking, "METRICS_INTERVAL_S", 3600.0)
    monkeypatch.setattr(flows.tracking, "MAX_METRICS_PER_CALL", 5)
    for step in (1, 2, 3):
        assert tracker.log_step(step, {"actor/loss": step / 10, "val-core/d/acc/mean@4": step})
    assert not tracker.log_step(2, {"actor/loss": 9.0})  # logged already: not again
    tracker.background.submit(lambda: None).result()  # its one thread has done whatever was handed to it before
    assert calls == [] and tracker.client.get_metric_history(tracker.run_id, STEP_MARKER) == []
    tracker.flush()
    assert calls == [5, 4]  # 3 steps x (2 metrics + the step marker), in calls of at most 5
    assert sorted(m.step for m in tracker.client.get_metric_history(tracker.run_id, STEP_MARKER)) == [1, 2, 3]
    losses = tracker.client.get_metric_history(tracker.run_id, "actor/loss")
    assert sorted((m.step, m.value) for m in losses) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert {m.value for m in tracker.client.get_metric_history(tracker.run_id, "val-core/d/acc/mean_at_4")} == {1, 2, 3}
    monkeypatch.setattr(flows.tracking, "METRICS_INTERVAL_S", 0.0)  # slow steps: each sent as it is logged
    tracker.log_step(4, {"actor/loss": 0.4})
    tracker.background.submit(lambda: None).result()
    assert calls[2:] == [2]
    tracker.finish()
