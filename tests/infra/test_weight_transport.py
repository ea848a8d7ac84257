"""The collective weight transport (checkpoint_engine.backend=gloo; nccl is the same code on GPUs, which this machine
has not): where each tensor goes in its bucket, every tensor moved exactly over a real gloo channel, a receiver that
stops early leaves the sender unblocked, and a rollout worker that died ends the send at once with gloo's error (the
connection closed or reset by it)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch

from flows.config import compose_config
from flows.workers import weight_transport
from infra.weight_transport import CollectiveTransport, ObjectStoreTransport, bucket_layout
from rl_core.device import DeviceError


def test_each_tensor_has_an_aligned_place_in_a_bucket_of_at_most_the_size():
    tensors = [
        ("a", (3,), torch.float32),  # 12 bytes at 0
        ("b", (2, 2), torch.bfloat16),  # 8 bytes at 64 (aligned): the bucket ends at 72
        ("c", (100,), torch.float32),  # 400 bytes: past 128, so a bucket of its own, larger than the size
        ("d", (), torch.int64),  # 8 bytes: after c's 400 it would pass 128 -> a new bucket
        ("e", (4,), torch.int8),  # 4 bytes at 64
    ]
    assert bucket_layout(tensors, 128) == [
        {"bytes": 72, "tensors": [["a", [3], "float32", 0], ["b", [2, 2], "bfloat16", 64]]},
        {"bytes": 400, "tensors": [["c", [100], "float32", 0]]},
        {"bytes": 68, "tensors": [["d", [], "int64", 0], ["e", [4], "int8", 64]]},
    ]


def channel(bucket_bytes=256):
    """An actor's side and a rollout worker's side of one gloo channel, in this process."""
    actor, rollout = CollectiveTransport("gloo", bucket_bytes, 60), CollectiveTransport("gloo", bucket_bytes, 60)
    address = actor.open(0)
    with ThreadPoolExecutor(1) as other:
        joined = other.submit(rollout.connect, address)
        actor.connect(address, 0)
        joined.result(timeout=60)
    return actor, rollout


def transfer(actor, rollout, tensors, keep=None):
    """Send ``tensors`` to the rollout side while it receives; what it received (copies), or only the first
    ``keep``."""
    with ThreadPoolExecutor(1) as other:
        sent = other.submit(actor.send, tensors, 0)
        received = []
        for name, tensor in rollout.receive():
            received.append((name, tensor.clone()))
            if keep is not None and len(received) == keep:
                break
        sent.result(timeout=60)
    return received


def random_tensors(seed):
    generator = torch.Generator().manual_seed(seed)
    return [
        ("embed", torch.randn(40, 8, generator=generator)),  # 1280 bytes: a bucket of its own
        ("norm", torch.randn(8, generator=generator).to(torch.bfloat16)),
        ("bias", torch.randn(3, generator=generator).double()),
        ("step", torch.randint(0, 100, (), generator=generator)),
        ("lora_A", torch.randn(2, 8, generator=generator).half()),
        ("lm_head", torch.randn(10, 8, generator=generator)),
    ]


def test_a_gloo_channel_moves_every_tensor_exactly_in_buckets_and_stays_usable():
    actor, rollout = channel(bucket_bytes=256)
    for seed in (0, 1):  # the same channel, twice
        sent = random_tensors(seed)
        received = transfer(actor, rollout, sent)
        assert [name for name, _ in received] == [name for name, _ in sent]
        for (_, expected), (name, got) in zip(sent, received):
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            assert torch.equal(got, expected), name


def test_a_receiver_that_stops_early_still_takes_every_bucket():
    actor, rollout = channel(bucket_bytes=256)
    assert len(transfer(actor, rollout, random_tensors(0), keep=1)) == 1  # the sender finished all the same
    again = random_tensors(2)
    assert torch.equal(transfer(actor, rollout, again)[-1][1], again[-1][1])  # and the channel is still in step


@ray.remote(num_cpus=0)
class ChannelEnd:
    def __init__(self):
        self.transport = CollectiveTransport("gloo", 2**20, 120)

    def open(self):
        return self.transport.open(0)

    def connect(self, address, peer=None):
        self.transport.connect(address, *([] if peer is None else [peer]))

    def send(self):
        self.transport.send(random_tensors(0), 0)


def test_a_send_to_a_rollout_worker_that_died_fails_at_once_with_the_cause(ray_address, worker_env):
    end = ChannelEnd.options(runtime_env={"env_vars": worker_env})
    actor, rollout = end.remote(), end.remote()
    address = ray.get(actor.open.remote())
    ray.get([actor.connect.remote(address, 0), rollout.connect.remote(address)], timeout=60)
    ray.kill(rollout, no_restart=True)
    with pytest.raises(ray.exceptions.RayTaskError, match="Connection (closed|reset) by peer"):  # as gloo sees it
        ray.get(actor.send.remote(), timeout=60)  # not the channel's 120 s timeout
    ray.kill(actor, no_restart=True)


def test_a_missing_channel_is_named():
    with pytest.raises(RuntimeError, match="no weight channel to rollout worker 3"):
        CollectiveTransport("gloo", 1024, 10).send([("w", torch.zeros(1))], 3)
    with pytest.raises(ValueError, match="gloo or nccl, not 'mpi'"):
        CollectiveTransport("mpi", 1024, 10)


def test_the_config_picks_the_transport_and_nccl_needs_gpus_in_the_cluster(ray_address):
    engine = "actor_rollout_ref.rollout.checkpoint_engine"
    ahead = ["rollout.n_gpus_per_node=1", f"{engine}.update_weights_bucket_megabytes=3"]
    naive = weight_transport(compose_config(ahead))
    assert isinstance(naive, ObjectStoreTransport) and not naive.rendezvous and naive.bucket_bytes == 3 * 2**20
    gloo = weight_transport(compose_config([*ahead, f"{engine}.backend=gloo", "trainer.worker_timeout_s=77"]))
    assert (gloo.backend, gloo.rendezvous, gloo.bucket_bytes, gloo.timeout_s) == ("gloo", True, 3 * 2**20, 77)
    with pytest.raises(DeviceError, match="backend=nccl needs GPUs and the workers run on the CPU .* use gloo"):
        weight_transport(compose_config([*ahead, f"{engine}.backend=nccl"]))  # trainer.device=auto, no GPU here
