"""Training on several Ray nodes: Ray's own multi-node harness (``ray.cluster_utils.Cluster``: a head and three
raylets on 127.0.0.1, each node with its own resources), one module-scoped cluster. Each node has one CPU and a
worker takes one, so a worker group of two ranks has to span two nodes and a rollout of its own a third; the runs are
``ppoflow train`` processes pointed at the cluster (this test process stays on the session's head)."""

import json
import os
import subprocess
import sys

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


def two_ranks(run_overrides, folder, nnodes: int = 2, *extra: str) -> list[str]:
    """Two steps of two ranks: on ``nnodes`` nodes (2: one each; 1: both on one)."""
    return run_overrides(
        "trainer.total_training_steps=2",
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
