"""Flow tests: a real Prefect API (the test harness), the session's Ray head, MLflow on SQLite in tmp."""

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import small_run_overrides


@pytest.fixture()
def run_overrides(tmp_path, demo_cache, ray_address, prefect_api):
    """Small, fast settings in a per-test folder; tests add their own overrides."""

    def make(*extra: str, folder=None) -> list[str]:
        return small_run_overrides(folder or tmp_path, demo_cache, *extra)

    return make


def metric_history(tracking_uri: str, run_id: str) -> dict[str, dict[int, list[float]]]:
    """{metric: {step: [values]}} of an MLflow run (a list, so that duplicates show)."""
    client = MlflowClient(tracking_uri)
    history: dict[str, dict[int, list[float]]] = {}
    for key in client.get_run(run_id).data.metrics:
        for metric in client.get_metric_history(run_id, key):
            history.setdefault(key, {}).setdefault(metric.step, []).append(metric.value)
    return history
