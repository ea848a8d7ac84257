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
import ray
from mlflow.tracking import MlflowClient
from ray.experimental.internal_kv import _initialize_internal_kv

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
    # the harness also resets this process's key-value store client, which the session's driver (still connected to
    # its own head) uses: the standby groups' records (infra/standby.py)
    _initialize_internal_kv(ray._private.worker.global_worker.gcs_client)


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


def run_losing_nodes(
    cluster, overrides: list[str], database, steps: int, spare: bool, back_after_s=None, lose=("worker_nodes", 1)
):
    """``ppoflow train`` of ``steps`` steps on the cluster; once step 2 has trained, the node of rank 1 leaves the
    cluster (its raylet and every process on it end; ``lose``: the tag ``ppoflow.<name>`` and the index of the node in
    it), and with ``spare`` the spare node too (no room left); with
    ``back_after_s`` a new node joins that much later. Returns (exit status, its result line or None, its output, the
    lost node's id, when it was lost, when a node joined); the cluster has its three nodes again afterwards."""
    command = [sys.executable, "-m", "flows.cli", "train", f"trainer.ray.address={cluster.address}", *overrides]
    run = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    removed, joined_at, trained, nodes = 0, None, None, None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and run.poll() is None:
            try:
                with sqlite3.connect(database) as db:
                    trained = db.execute("select max(step) from metrics where key = 'actor/pg_loss'").fetchone()[0]
                    nodes = db.execute(f"select value from tags where key = 'ppoflow.{lose[0]}'").fetchone()
            except sqlite3.OperationalError:  # MLflow has not made its tables yet
                trained, nodes = None, None
            if trained is not None and trained >= 2 and nodes:
                break
            time.sleep(0.2)
        assert run.poll() is None and trained is not None, "the run ended before a node could be lost"
        lost = nodes[0].split(",")[lose[1]]
        workers = set(nodes[0].split(","))
        doomed = [node for node in cluster.list_all_nodes() if node.node_id == lost]
        doomed += [node for node in cluster.list_all_nodes() if spare and node.node_id not in workers and not node.head]
        for node in doomed:
            cluster.remove_node(node)
            removed += 1
        lost_at = time.time()
        if back_after_s is not None:
            time.sleep(back_after_s)
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
            removed, joined_at = removed - 1, time.time()
        output, log = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
            subprocess.run([sys.executable, "-c", KILL_RUNS, cluster.address], cwd=ROOT, capture_output=True)
        for _ in range(removed):  # the other tests' nodes
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    result = json.loads(output.strip().splitlines()[-1]) if run.returncode == 0 else None
    return run.returncode, result, output + log, lost, lost_at, joined_at


def first_step_after(result: dict, moment: float) -> float:
    """When the first step after ``moment`` (a Unix time) logged its loss."""
    history = MlflowClient(result["tracking_uri"]).get_metric_history(result["run_id"], "actor/pg_loss")
    return min(point.timestamp / 1000 for point in history if point.timestamp / 1000 > moment)


def assert_every_step_once_after_one_rebuild(result: dict, output: str, lost: str, steps: int) -> None:
    assert f"worker workers-rank1 on node {lost[:12]}, which has left the cluster died" in output
    history = metric_history(result["tracking_uri"], result["run_id"])
    trained = {step: len(values) for step, values in history["actor/pg_loss"].items()}
    assert trained == dict.fromkeys(range(1, steps + 1), 1)
    tags = MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).data.tags
    assert tags["ppoflow.worker_restarts"] == "1" and lost not in tags["ppoflow.worker_nodes"].split(",")


def test_a_node_lost_mid_run_is_replaced_and_every_step_trains_once(cluster, run_overrides, tmp_path):
    """The node of rank 1 is lost after step 2: the run says which worker, node and stage were lost, rebuilds its
    workers from the latest checkpoint on the nodes left (the spare takes the lost one's place) and finishes with
    every step once."""
    steps = 20
    overrides = two_ranks(run_overrides, tmp_path, 2, steps=steps)
    status, result, output, lost, lost_at, _ = run_losing_nodes(
        cluster, overrides, tmp_path / "mlflow.db", steps, spare=False
    )
    assert status == 0, output[-3000:]
    assert_every_step_once_after_one_rebuild(result, output, lost, steps)
    print(f"a node lost -> the next step trained: {first_step_after(result, lost_at) - lost_at:.1f} s")


def test_the_rollouts_node_lost_in_an_asynchronous_run_is_replaced_and_the_trainer_goes_on(
    cluster, run_overrides, tmp_path
):
    """One step off, the rollout on a node of its own: that node is lost after step 2. Only the rollout's worker is
    rebuilt (on the spare node), the trainer's stays, and every step trains once."""
    steps = 12
    overrides = two_ranks(run_overrides, tmp_path, 1, "rollout.n_gpus_per_node=1", "async_training.mode=one_step_off")
    overrides = [*overrides, "trainer.n_gpus_per_node=1", f"trainer.total_training_steps={steps}"]
    status, result, output, lost, lost_at, _ = run_losing_nodes(
        cluster, overrides, tmp_path / "mlflow.db", steps, spare=False, lose=("rollout_nodes", 0)
    )
    assert status == 0, output[-3000:]
    assert f"on node {lost[:12]}, which has left the cluster died" in output
    assert "rebuilding the rollout's own worker, the trainer goes on" in output
    history = metric_history(result["tracking_uri"], result["run_id"])
    assert {step: len(values) for step, values in history["actor/pg_loss"].items()} == dict.fromkeys(
        range(1, steps + 1), 1
    )
    tags = MlflowClient(result["tracking_uri"]).get_run(result["run_id"]).data.tags
    assert lost not in tags["ppoflow.rollout_nodes"].split(",") + tags["ppoflow.worker_nodes"].split(",")
    print(f"the rollout's node lost -> the next step trained: {first_step_after(result, lost_at) - lost_at:.1f} s")


def test_with_no_room_left_the_rebuild_waits_for_a_node(cluster, run_overrides, tmp_path):
    """Rank 1's node and the spare are lost: the rebuild waits (trainer.capacity_wait_s) until a node joins, 4 s
    later, and the run finishes with every step once."""
    steps = 20
    overrides = two_ranks(run_overrides, tmp_path, 2, "trainer.capacity_wait_s=120", steps=steps)
    status, result, output, lost, _, joined_at = run_losing_nodes(
        cluster, overrides, tmp_path / "mlflow.db", steps, spare=True, back_after_s=4
    )
    assert status == 0, output[-3000:]
    assert_every_step_once_after_one_rebuild(result, output, lost, steps)
    assert first_step_after(result, joined_at - 4) > joined_at  # no step between the loss and the new node


def test_when_no_room_comes_back_the_run_fails_in_one_line_leaving_nothing(cluster, run_overrides, tmp_path):
    """The two nodes leave one after the other: the rebuild finds no room and waits trainer.capacity_wait_s, or (when
    it placed its workers between the two) they wait trainer.worker_timeout_s; either way the line names the
    shortfall."""
    steps = 20
    overrides = two_ranks(
        run_overrides, tmp_path, 2, "trainer.capacity_wait_s=3", "trainer.worker_timeout_s=40", steps=steps
    )
    status, _, output, _, _, _ = run_losing_nodes(cluster, overrides, tmp_path / "mlflow.db", steps, spare=True)
    assert status != 0
    failure = [line for line in output.splitlines() if line.startswith("ppoflow train: ")][-1]  # its last word
    assert (
        "resource pool 'global_pool' needs 2 node(s) with 1 CPU, 1 CPU; the cluster's nodes have CPU: 1, 0" in failure
    )
    assert (
        "(waited 3 s for room: trainer.capacity_wait_s)" in failure
        or "(a node left after the workers were placed; they waited 40 s for room: trainer.worker_timeout_s)" in failure
    )
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    [run] = client.search_runs([client.get_experiment_by_name("ppoflow").experiment_id])
    assert run.info.status == "FAILED"
    namespace = run.data.tags["ppoflow.workers_namespace"]
    listing = subprocess.run(
        [sys.executable, "-c", LIST_ACTORS, cluster.address, namespace], cwd=ROOT, capture_output=True, text=True
    )
    assert listing.returncode == 0 and json.loads(listing.stdout.strip().splitlines()[-1]) == []


LIST_ACTORS = """
import json, sys, ray
from infra.cluster import connect
connect(sys.argv[1])
print(json.dumps([a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == sys.argv[2]]))
"""
KILL_RUNS = """
import sys, ray
from infra.cluster import connect
from flows.workers import kill_worker_group
connect(sys.argv[1])
for namespace in {a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)}:
    kill_worker_group(namespace)
"""
