"""What a run records about itself in MLflow, on a real SQLite store: its experiment's kind (so that MLflow's UI
opens it as model training), the command, the overrides and the code's git commit, with secrets redacted."""

import subprocess
import sys

from omegaconf import OmegaConf

from flows.tracking import EXPERIMENT_KIND, experiment_id, open_store, provenance_tags
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
