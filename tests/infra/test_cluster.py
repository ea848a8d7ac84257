"""Ray cluster connection, resource pools and worker groups on a real local Ray cluster (cheap echo workers)."""

import json
import subprocess
import sys
import textwrap
import time

import pytest
import ray
import torch

from infra.resource_pool import InsufficientResourcesError, ResourcePool, ResourcePoolManager
from infra.worker_group import WorkerDiedError, WorkerGroup, WorkerTimeoutError
from rl_core.batch import Batch
from tests.conftest import ROOT
from tests.infra.helpers import EchoWorker

ECHO = {"echo": (EchoWorker, ("a",), {}), "other": (EchoWorker, ("b",), {})}


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_an_unreachable_address_fails_within_seconds():
    start = time.monotonic()
    result = run_python("""
        from infra.cluster import connect
        connect("127.0.0.1:1", timeout_s=2)
    """)
    assert result.returncode != 0
    assert "ray address 127.0.0.1:1 did not answer within 2s" in result.stderr
    assert time.monotonic() - start < 30


def test_the_local_cluster_s_node_parameters_leave_out_ray_s_monitors_while_it_starts():
    """connect() starts a local cluster inside `_without_monitors`: Ray's node parameters built then say no
    autoscaler monitor and no log monitor (an explicit value still wins); built after, Ray's defaults again."""
    from ray._private.parameter import RayParams

    from infra import cluster

    with cluster._without_monitors():
        inside, explicit = RayParams(), RayParams(include_log_monitor=True)
    after = RayParams()
    assert (inside.no_monitor, inside.include_log_monitor) == (True, False)
    assert explicit.include_log_monitor is True
    assert (after.no_monitor, after.include_log_monitor) == (False, None)


def test_a_starting_cluster_s_raylet_is_looked_up_in_ray_s_gcs_and_then_by_ray(ray_address):
    """Inside `_raylet_looked_up_often`, Ray's lookup of a new raylet first asks the GCS itself, often: a live raylet
    is found registered, a made-up one is not; the lookup then gives Ray's own answer, and Ray's is back after."""
    import ray._private.services as services
    from ray._raylet import GcsClient

    from infra import cluster

    context = ray.get_runtime_context()
    gcs, node = context.gcs_address, context.get_node_id()
    client = GcsClient(address=gcs)
    assert cluster._registered(client, node)
    assert not cluster._registered(client, "ab" * 28)
    original = services.get_node
    with cluster._raylet_looked_up_often():
        assert services.get_node is not original
        found = services.get_node(gcs, node)
    assert services.get_node is original
    assert found["node_id"] == original(gcs, node)["node_id"]


def test_a_connection_begun_in_the_background_is_the_one_connect_waits_for(ray_address):
    """`ppoflow train` starts connecting at once, in a thread; the flow's connect() then waits for that connection, or
    reports why it failed."""
    result = run_python(f"""
        import sys
        import ray
        from infra import cluster
        cluster.connect_in_background("127.0.0.1:1")
        try:
            cluster.connect("127.0.0.1:1", timeout_s=2)
        except cluster.ClusterUnreachableError as error:
            print("foreground:", error)
        cluster._background = None  # a new command
        cluster.connect_in_background("{ray_address}")
        address = cluster.connect("{ray_address}")
        assert cluster._background.thread.is_alive()  # the thread that connected outlives the connection's start
        before = set(sys.modules)
        print("connected to", address, "in", cluster._background.thread.name, ray.get(ray.put(41)) + 1)
        # the first call imports no library (the flow's threads import them: connect_in_background made Ray's
        # serialization context, which imports them, in the thread that called it)
        print("imported by the first call:", sorted({{name.split(".")[0] for name in set(sys.modules) - before}}))
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "foreground: ray address 127.0.0.1:1 did not answer within 2s" in result.stdout
    assert f"connected to {ray_address} in ppoflow-ray-connect 42" in result.stdout
    assert "imported by the first call: []" in result.stdout
    # Ray's warning about connecting from a thread: not for users
    assert "SIGTERM handler is not set" not in result.stderr


def test_pool_precheck_names_what_is_missing(ray_address):
    with pytest.raises(
        InsufficientResourcesError, match=r"needs 1 node\(s\) with 8 GPU; the cluster's nodes have GPU: 0"
    ):
        ResourcePool("actor_pool", [8], accelerator="GPU").check_fits()
    with pytest.raises(InsufficientResourcesError, match="needs 2 node"):
        ResourcePool("two_nodes", [1, 1]).check_fits()


def test_a_pool_waiting_for_room_calls_make_room_until_it_is_placed(ray_address):
    holder = ResourcePool("holder", [1], cpus_per_worker=8)  # the session head's 8 CPUs, as a standby group holds them
    holder.create("make-room-test", timeout_s=30)
    calls = []

    def make_room() -> None:  # gives the room up on the second call, as a standby group ended meanwhile would
        calls.append(time.monotonic())
        if len(calls) == 2:
            holder.remove()

    waiting = ResourcePool("waiting", [1], cpus_per_worker=8, make_room=make_room)
    began = time.monotonic()
    try:
        waiting.create("make-room-test", timeout_s=30)
        # placed only once the second call freed the room: Ray may take another second or two to place it under load
        assert len(waiting.placement_groups) == 1 and len(calls) >= 2
        assert 1.5 < time.monotonic() - began < 10  # about a second between calls, placed once the room is free
    finally:
        waiting.remove()
        holder.remove()


def test_pool_manager_maps_roles_to_pools():
    manager = ResourcePoolManager(
        [ResourcePool("global_pool", [2]), ResourcePool("reward_pool", [1])],
        {"actor_rollout_ref": "global_pool", "critic": "global_pool", "reward_model": "reward_pool"},
    )
    assert manager.pool_for("critic") is manager.pool_for("actor_rollout_ref")
    assert manager.pool_for("reward_model").world_size == 1
    with pytest.raises(KeyError, match="role 'ref' has no resource pool"):
        manager.pool_for("ref")
    with pytest.raises(ValueError, match=r"undefined resource pools \['gpu_pool'\]"):
        ResourcePoolManager([ResourcePool("global_pool", [1])], {"actor_rollout_ref": "gpu_pool"})


@pytest.fixture(scope="module")
def echo_group(ray_address, worker_env):
    group = WorkerGroup.create(
        ResourcePool("echo", [3]), ECHO, prefix="echo-test", namespace="ppoflow-tests", env_vars=worker_env
    )
    yield group
    group.kill()


def test_fused_roles_share_one_process_per_rank(echo_group):
    a = echo_group.role("echo").whoami()
    b = echo_group.role("other").whoami()
    assert (a["tag"], b["tag"]) == ("a", "b") and a["pid"] == b["pid"]  # both roles in rank 0's process
    reports = echo_group.health()
    assert [r["rank"] for r in reports] == [0, 1, 2] and len({r["pid"] for r in reports}) == 3
    assert echo_group.role("echo").rank_zero_only() == 0
    assert hasattr(echo_group.fused_class, "echo_double") and hasattr(echo_group.fused_class, "other_double")


def test_a_started_group_takes_new_role_arguments_not_new_roles(echo_group):
    try:
        echo_group.set_roles({"echo": (EchoWorker, ("c",), {}), "other": (EchoWorker, ("d",), {})})
        assert [echo_group.role(r).whoami()["tag"] for r in ("echo", "other")] == ["c", "d"]
        with pytest.raises(ValueError, match=r"this worker holds roles \['echo', 'other'\], not \['echo'\]"):
            echo_group.set_roles({"echo": (EchoWorker, ("c",), {})})
    finally:
        echo_group.set_roles(ECHO)
    assert echo_group.role("echo").whoami()["tag"] == "a"


@pytest.mark.parametrize("size", [7, 3, 1, 9])
def test_dp_dispatch_with_sizes_not_divisible_by_the_world(echo_group, size):
    out = echo_group.role("echo").double(Batch({"x": torch.arange(size)}))
    assert out.tensors["doubled"].tolist() == [2 * i for i in range(size)]
    per_rank = -(-size // 3)
    assert out.tensors["rank"].tolist() == [i // per_rank for i in range(size)]  # contiguous shards in rank order


def test_a_slow_call_times_out_naming_the_stage_and_workers(echo_group):
    with pytest.raises(
        WorkerTimeoutError,
        match=r"stage 'slow': workers \['echo-test-rank0', 'echo-test-rank1', 'echo-test-rank2'\] did not answer "
        r"within 1s",
    ):
        echo_group.role("echo").sleep(3, timeout_s=1, stage="slow")
    time.sleep(2.5)  # let the sleeps finish before the next test


def test_a_second_driver_reattaches_to_the_detached_workers(echo_group, ray_address):
    echo_group.role("echo").sleep(0.0)
    result = run_python(f"""
        import json
        from infra.cluster import connect
        from infra.worker_group import WorkerGroup
        from tests.infra.helpers import EchoWorker
        connect("{ray_address}", namespace="ppoflow-tests")
        group = WorkerGroup.reattach("echo-test", "ppoflow-tests", {{"echo": (EchoWorker, ("a",), {{}}), "other":
        (EchoWorker, ("b",), {{}})}})
        print(json.dumps([r["steps_trained"]["echo"] for r in group.health()]))
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    steps = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(steps) == 3 and steps == [r["steps_trained"]["echo"] for r in echo_group.health()] and min(steps) >= 1


def test_killing_a_worker_mid_call_is_a_quick_clear_error(ray_address, worker_env):
    group = WorkerGroup.create(
        ResourcePool("doomed", [2]),
        {"echo": (EchoWorker, (), {})},
        prefix="doomed",
        namespace="ppoflow-tests",
        env_vars=worker_env,
    )
    try:
        ref_holder = []

        def kill_rank1_soon():
            time.sleep(1.0)
            ray.kill(group.actors[1], no_restart=True)
            ref_holder.append(time.monotonic())

        import threading

        killer = threading.Thread(target=kill_rank1_soon)
        group.health()  # where each worker runs: a death names its node (this one stays: only the process dies)
        killer.start()
        with pytest.raises(WorkerDiedError, match=r"stage 'update': worker doomed-rank1 on node \w{12} died") as caught:
            group.role("echo").sleep(60, timeout_s=120, stage="update")
        killer.join()
        assert caught.value.worker == "doomed-rank1"
        assert time.monotonic() - ref_holder[0] < 10  # never waits for the 60 s call of the live rank
        with pytest.raises(WorkerDiedError, match="health check: worker doomed-rank1 died|doomed-rank1"):
            group.health(timeout_s=10)
    finally:
        group.kill()
    with pytest.raises(ValueError, match="no worker group 'doomed'"):
        WorkerGroup.reattach("doomed", "ppoflow-tests", {"echo": (EchoWorker, (), {})})


def test_a_simulated_two_node_cluster_places_pools_per_node_and_names_a_node_lost_at_set_up():
    # a separate driver: ray.cluster_utils.Cluster starts its own head, which this session's driver cannot join
    result = run_python(
        """
        import os
        import time
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray
        from ray.cluster_utils import Cluster
        from infra.resource_pool import ResourcePool, InsufficientResourcesError
        from infra.worker_group import WorkerGroup
        from tests.infra.helpers import EchoWorker
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"fake_gpu": 0}})
        node_a = cluster.add_node(num_cpus=2, resources={"fake_gpu": 2})
        node_b = cluster.add_node(num_cpus=2, resources={"fake_gpu": 2})
        ray.init(address=cluster.address)
        try:
            ResourcePool("too_big", [3], accelerator="fake_gpu").check_fits()
        except InsufficientResourcesError as error:
            print("PRECHECK", error)
        pool = ResourcePool("global_pool", [2, 2], accelerator="fake_gpu")
        group = WorkerGroup.create(pool, {"echo": (EchoWorker, (), {})}, prefix="two-nodes", namespace="t",
                                   env_vars={"PYTHONPATH": os.getcwd()})
        nodes = ray.get([a.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for a in
        group.actors])
        print("NODES", nodes[0] == nodes[1], nodes[2] == nodes[3], nodes[0] != nodes[2], sorted(set(nodes)) ==
        sorted({node_a.node_id, node_b.node_id}))
        group.kill()
        # placed, then a node leaves before the workers start: Ray re-places its bundles, for which there is no room
        pool = ResourcePool("global_pool", [2, 2], accelerator="fake_gpu")
        pool.create("lost", timeout_s=60)
        cluster.remove_node(node_b)
        while any(node["NodeID"] == node_b.node_id and node["Alive"] for node in ray.nodes()):
            time.sleep(0.2)
        try:
            WorkerGroup.create(pool, {"echo": (EchoWorker, (), {})}, prefix="lost", namespace="t", timeout_s=5,
                               env_vars={"PYTHONPATH": os.getcwd()})
        except InsufficientResourcesError as error:
            print("LOST", error, error.__notes__)
        ray.shutdown()
        cluster.shutdown()
    """,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "NODES True True True True" in result.stdout
    assert "needs 1 node(s) with 3 fake_gpu; the cluster's nodes have fake_gpu: 2, 2, 0" in result.stdout
    # not "did not answer within 5s; raise trainer.worker_timeout_s": waiting longer would not help
    assert (
        "LOST resource pool 'global_pool' needs 2 node(s) with 2 fake_gpu, 2 fake_gpu; the cluster's nodes have "
        in (result.stdout)
    )
    assert "a node left after the workers were placed; they waited 5 s for room: trainer.worker_timeout_s" in (
        result.stdout
    )
