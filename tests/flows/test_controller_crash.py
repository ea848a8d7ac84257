"""Workers outlive their controller on a persistent cluster (the session's Ray head): a controller killed with SIGKILL
is replaced by the next one of the same run, which reattaches to the same worker processes; and a failed run leaves
its workers only when it should."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_API_URL

from flows.train import train
from flows.workers import kill_worker_group, namespace_of_run, worker_groups
from tests.conftest import ROOT, small_run_overrides
from tests.flows.conftest import metric_history

COMPARED = ("actor/pg_loss", "actor/entropy", "critic/score/mean", "actor/grad_norm")


def run_namespace(tracking_uri: str, run_id: str) -> str:
    """Where the run's workers live: its ``ppoflow.workers_namespace`` tag."""
    namespace = namespace_of_run(run_id, MlflowClient(tracking_uri))
    assert namespace, f"run {run_id} names no workers' namespace"
    return namespace


def run_actors(tracking_uri: str, run_id: str) -> list[str]:
    namespace = run_namespace(tracking_uri, run_id)
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]


def test_a_killed_controller_is_replaced_by_one_that_reattaches(tmp_path, demo_cache, ray_address, prefect_api):
    settings = (
        "trainer.total_training_steps=4",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.ray.address={ray_address}",
    )
    overrides = small_run_overrides(tmp_path / "crashed", demo_cache, *settings)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    command = [sys.executable, "-m", "flows.cli", "train", *overrides]
    log = tmp_path / "first.log"
    with open(log, "w") as output:
        first = subprocess.Popen(command, env=env, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
    checkpoint = tmp_path / "crashed" / "checkpoints" / "global_step_2" / "trainer_state.json"
    deadline = time.monotonic() + 300
    while not checkpoint.exists():
        assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    run_id = json.loads(checkpoint.read_text())["mlflow_run_id"]
    store = f"sqlite:///{tmp_path / 'crashed'}/mlflow.db"
    mlflow = MlflowClient(store)
    pids_before = mlflow.get_run(run_id).data.tags["ppoflow.worker_pids"]
    assert run_actors(store, run_id) == ["workers-rank0"]  # the workers outlived their controller

    second = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    result = json.loads(second.stdout.strip().splitlines()[-1])
    assert result["run_id"] == run_id and result["step"] == 4  # the same MLflow run, continued
    assert "reattached to the run's 1 live worker(s)" in second.stdout + second.stderr
    assert mlflow.get_run(run_id).data.tags["ppoflow.worker_pids"] == pids_before  # the same processes
    assert run_actors(store, run_id) == []  # a finished run ends its workers

    straight = train(overrides=small_run_overrides(tmp_path / "straight", demo_cache, *settings))
    crashed_history, straight_history = (
        metric_history(result["tracking_uri"], run_id),
        metric_history(straight["tracking_uri"], straight["run_id"]),
    )
    for name in COMPARED:
        # every step once, with the uninterrupted run's values
        assert crashed_history[name] == straight_history[name], name


@pytest.fixture()
def raising_reward(tmp_path) -> Path:
    path = tmp_path / "raising_reward.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    raise RuntimeError('scorer "
        "bug')\n"
    )
    return path


def failed_run_id(tracking_uri: str) -> str:
    client = MlflowClient(tracking_uri)
    [run] = client.search_runs([client.get_experiment_by_name("ppoflow").experiment_id])
    assert run.info.status == "FAILED"
    return run.info.run_id


def test_a_failed_run_on_a_persistent_cluster_keeps_its_workers_until_killed(
    tmp_path, demo_cache, ray_address, prefect_api, raising_reward
):
    overrides = small_run_overrides(
        tmp_path, demo_cache, f"custom_reward_function.path={raising_reward}", "trainer.val_before_train=false"
    )
    with pytest.raises(RuntimeError, match="scorer bug"):
        train(overrides=overrides)
    store = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = failed_run_id(store)
    namespace = run_namespace(store, run_id)
    assert run_actors(store, run_id) == ["workers-rank0"]  # kept for the next controller of this run
    [listed] = [g for g in worker_groups(store) if g.run_id == run_id]  # the workers say which run they serve
    assert (
        listed.namespace == namespace
        and listed.ranks == 1
        and len(listed.pids) == 1
        and listed.resources.get("CPU") == 1.0
        and listed.run_status == "FAILED"
    )
    assert kill_worker_group(namespace) == 1
    assert run_actors(store, run_id) == [] and not [
        g
        for g in ray.util.placement_group_table().values()
        if g["name"].startswith(namespace) and g["state"] != "REMOVED"
    ]


def test_with_keep_workers_false_a_failed_run_leaves_nothing(
    tmp_path, demo_cache, ray_address, prefect_api, raising_reward
):
    overrides = small_run_overrides(
        tmp_path,
        demo_cache,
        f"custom_reward_function.path={raising_reward}",
        "trainer.val_before_train=false",
        "trainer.keep_workers=false",
    )
    with pytest.raises(RuntimeError, match="scorer bug"):
        train(overrides=overrides)
    store = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = failed_run_id(store)
    namespace = run_namespace(store, run_id)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
    assert not [
        g
        for g in ray.util.placement_group_table().values()
        if g["name"].startswith(namespace) and g["state"] != "REMOVED"
    ]
