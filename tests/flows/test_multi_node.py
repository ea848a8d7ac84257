"""Training on several Ray nodes: Ray's own multi-node harness (``ray.cluster_utils.Cluster``: a head and three
raylets on 127.0.0.1, each node with its own resources), one module-scoped cluster. Each node has one CPU and a
worker takes one, so a worker group of two ranks has to span two nodes and a rollout of its own a third; the runs are
``ppoflow train`` processes pointed at the cluster (this test process stays on the session's head)."""

import json
import os
import sqlite3
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from infra.ray_settings import INLINE_OBJECTS_ENV, LOCAL_CLUSTER_ENV, LOOPBACK_ENV
from tests.conftest import ROOT
from tests.flows.conftest import metric_history

NODES = 3  # besides the head, which has no CPU: nothing of a run lands there


@pytest.fixture(scope="module")
def cluster(ray_address):
    """A head without CPUs and three one-CPU nodes, with the environment of every cluster ppoflow starts (loopback,
    token authentication: the session's head made the token)."""
    from ray.cluster_utils import Cluster

    environment = {**LOOPBACK_ENV, **LOCAL_CLUSTER_ENV, **INLINE_OBJECTS_ENV}
    saved = {key: os.environ.get(key) for key in environment}
    os.environ.update(environment)
    try:
        nodes = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False},
        )
        for _ in range(NODES):
            nodes.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        nodes.wait_for_nodes()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    yield nodes
    nodes.shutdown()


def train_on(address: str, overrides: list[str]) -> dict:
    """``ppoflow train`` on the Ray cluster at ``address``; its result line."""
    command = [sys.executable, "-m", "flows.cli", "train", f"trainer.ray.address={address}", *overrides]
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return json.loads(finished.stdout.strip().splitlines()[-1])


def worker_nodes(result: dict, tag: str = "ppoflow.worker_nodes") -> list[str]:
    return MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).data.tags[tag].split(",")


def two_ranks(run_overrides, folder, nnodes: int = 2, *extra: str, steps: int = 2) -> list[str]:
    """``steps`` steps of two ranks: on ``nnodes`` nodes (2: one each; 1: both on one)."""
    return run_overrides(
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.nnodes={nnodes}",
        f"trainer.n_gpus_per_node={2 // nnodes}",
        *extra,
        folder=folder,
    )


def test_two_ranks_on_two_nodes_train_as_on_one(cluster, run_overrides, ray_address, tmp_path):
    """trainer.nnodes=2 places one rank per node (each worker's Ray node id), and the 2-rank FSDP2 run over gloo
    gives the same metrics as both ranks on one node."""
    spread = train_on(cluster.address, two_ranks(run_overrides, tmp_path / "two-nodes"))
    nodes = worker_nodes(spread)
    cluster_nodes = {node.node_id for node in cluster.list_all_nodes()}
    assert len(set(nodes)) == 2 and set(nodes) <= cluster_nodes - {cluster.head_node.node_id}
    together = train_on(ray_address, two_ranks(run_overrides, tmp_path / "one-node", 1))
    assert len(set(worker_nodes(together))) == 1
    timed = ("timing_s/", "perf/")
    spread_history = metric_history(spread["tracking_uri"], spread["run_id"])
    together_history = metric_history(together["tracking_uri"], together["run_id"])
    compared = sorted(key for key in spread_history if not key.startswith(timed))
    assert "actor/pg_loss" in compared and "actor/grad_norm" in compared
    assert {key: spread_history[key] for key in compared} == {key: together_history[key] for key in compared}


def test_a_rollout_of_its_own_lands_on_a_node_of_its_own(cluster, run_overrides, tmp_path):
    result = train_on(
        cluster.address,
        two_ranks(run_overrides, tmp_path, 2, "rollout.n_gpus_per_node=1", "async_training.mode=one_step_off"),
    )
    trainer, [rollout] = worker_nodes(result), worker_nodes(result, "ppoflow.rollout_nodes")
    assert len({*trainer, rollout}) == NODES
    history = metric_history(result["tracking_uri"], result["run_id"])
    assert history["training/staleness_max"] == {1: [0.0], 2: [1.0]}


def test_a_node_lost_mid_run_is_replaced_and_every_step_trains_once(cluster, run_overrides, tmp_path):
    """The node of rank 1 leaves the cluster (its raylet and every process on it end) after step 2: the run says which
    worker, node and stage were lost, rebuilds its workers from the latest checkpoint on the nodes left (the spare one
    takes the lost one's place) and finishes with every step once."""
    steps = 30
    command = [sys.executable, "-m", "flows.cli", "train", f"trainer.ray.address={cluster.address}"]
    command += two_ranks(run_overrides, tmp_path, 2, steps=steps)
    run = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    database = tmp_path / "mlflow.db"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and run.poll() is None:
            if database.exists():
                with sqlite3.connect(database) as db:
                    trained = db.execute("select max(step) from metrics where key = 'actor/pg_loss'").fetchone()[0]
                    nodes = db.execute("select value from tags where key = 'ppoflow.worker_nodes'").fetchone()
                if trained is not None and trained >= 2 and nodes:
                    break
            time.sleep(0.2)
        assert run.poll() is None and trained < steps, "the run ended before a node could be lost"
        lost = nodes[0].split(",")[1]
        [node] = [node for node in cluster.list_all_nodes() if node.node_id == lost]
        cluster.remove_node(node)
        lost_at = time.time()
        output, log = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")  # the other tests' spare
    assert run.returncode == 0, output[-3000:] + log[-3000:]
    assert f"worker workers-rank1 on node {lost[:12]}, which has left the cluster died" in output + log
    result = json.loads(output.strip().splitlines()[-1])
    history = metric_history(result["tracking_uri"], result["run_id"])
    assert {step: len(values) for step, values in history["actor/pg_loss"].items()} == dict.fromkeys(
        range(1, steps + 1), 1
    )
    tags = MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).data.tags
    assert tags["ppoflow.worker_restarts"] == "1" and lost not in tags["ppoflow.worker_nodes"].split(",")
    resumed = min(
        point.timestamp
        for point in MlflowClient(result["tracking_uri"]).get_metric_history(result["run_id"], "actor/pg_loss")
        if point.timestamp / 1000 > lost_at
    )
    print(f"a node lost -> the next step trained: {resumed / 1000 - lost_at:.1f} s")
