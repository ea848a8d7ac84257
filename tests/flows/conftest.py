"""Flow tests: a real Prefect API (the test harness), the session's Ray head, MLflow on SQLite in tmp."""

import pytest
from mlflow.tracking import MlflowClient
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session")
def prefect_api():
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
    """The embedded demo's SFT model and data, built once for all flow tests."""
    return tmp_path_factory.mktemp("demo-cache")


@pytest.fixture()
def run_overrides(tmp_path, demo_cache, ray_address, prefect_api):
    """Small, fast settings in a per-test folder; tests add their own overrides."""
    def make(*extra: str, folder=None) -> list[str]:
        folder = folder or tmp_path
        return [
            f"trainer.tracking_uri=sqlite:///{folder}/mlflow.db", f"trainer.artifact_location={folder}/mlartifacts",
            f"trainer.default_local_dir={folder}/checkpoints", f"trainer.cache_dir={demo_cache}",
            "data.synthetic.train_size=64", "data.synthetic.val_size=16", "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.total_training_steps=3",
            "trainer.save_freq=1", "trainer.test_freq=3", "trainer.log_samples_freq=1", "trainer.worker_timeout_s=120",
            "trainer.cpus_per_worker=1", *extra,
        ]
    return make


def metric_history(tracking_uri: str, run_id: str) -> dict[str, dict[int, list[float]]]:
    """{metric: {step: [values]}} of an MLflow run (a list, so that duplicates show)."""
    client = MlflowClient(tracking_uri)
    history: dict[str, dict[int, list[float]]] = {}
    for key in client.get_run(run_id).data.metrics:
        for metric in client.get_metric_history(run_id, key):
            history.setdefault(key, {}).setdefault(metric.step, []).append(metric.value)
    return history
