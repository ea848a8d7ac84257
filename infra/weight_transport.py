"""The weight transports between Ray worker processes for a rollout on workers of its own (rl_core.weight_sync's
``WeightTransport``; ``actor_rollout_ref.rollout.checkpoint_engine.backend`` picks one):

* :class:`ObjectStoreTransport` (``naive``): the actor's process puts the tensors in Ray's object store, any rollout
  worker fetches them whenever it next generates: the actor never waits for a rollout worker.
* :class:`CollectiveTransport` (``gloo`` on CPUs, ``nccl`` on GPUs: verl's ``nccl`` checkpoint engine): the actor's
  rank 0 broadcasts the tensors over a two-process ``torch.distributed`` group of its own with each rollout worker (a
  *channel*, separate from the trainer's FSDP group); sender and receiver are in the call together (``rendezvous``:
  the actor waits until the rollout worker is free to receive), and the tensors go device to device on GPUs.

Both move the tensors in buckets of at most ``bucket_bytes`` (a larger tensor travels alone in a bucket of its size),
so neither side holds a second copy of a large model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch

ALIGNMENT = 64  # bytes: every tensor starts at a multiple of it in its bucket (any dtype's view stays aligned)
RECEIVER = "actor"  # the channel a rollout worker receives on (its only one)
OFFERED = "offered"  # the channel store's key: the version being (or last) sent


class ObjectStoreTransport:
    """Buckets as objects in Ray's object store (tensors as numpy arrays: their buffers go to the store without
    pickling); the handle is the list of references, owned by the actor's process until the next export replaces
    them. The rollout fetches one bucket at a time."""

    rendezvous = False

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.sent: list[Any] = []  # the last export's references, alive until the next one

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]], to: int | None = None, version: int = 0) -> list[Any]:
        """``to`` and ``version`` play no part: every rollout worker reads the same handle, whenever it next
        generates."""
        import ray

        self.sent, bucket, size = [], {}, 0
        for name, tensor in tensors:
            array = _as_array(tensor)
            if bucket and size + array.nbytes > self.bucket_bytes:
                self.sent.append(ray.put(bucket))
                bucket, size = {}, 0
            bucket[name], size = array, size + array.nbytes
        if bucket:
            self.sent.append(ray.put(bucket))
        return self.sent

    def receive(self, handle: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
        import ray

        for reference in handle:
            for name, array in ray.get(reference).items():  # read-only views of the store for large arrays
                yield name, torch.from_numpy(array if array.flags.writeable else array.copy())

    def __getstate__(self) -> dict:  # a transport travels to its worker empty
        return {"bucket_bytes": self.bucket_bytes, "sent": []}


def _as_array(tensor: torch.Tensor) -> Any:
    """The tensor on the CPU as numpy holds it (bfloat16, which numpy lacks, as float32: exact; the receiver casts it
    to its parameter's dtype)."""
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


class CollectiveTransport:
    """Broadcasts over one channel per rollout worker (see the module docstring). Set-up, per channel: the actor's
    rank 0 :meth:`open`\\ s it (a rendezvous store on its node), then both sides :meth:`connect` at once (each call
    waits for the other). A send is: the version offered in the channel's store (the receiver can see it coming:
    :meth:`offered`, partial rollout polls it between tokens), the layout (the version, each tensor's name, shape,
    dtype, bucket and offset) as JSON, then each bucket as one flat byte tensor; the receiver yields each tensor as a
    view of its bucket, valid until the next bucket arrives (``load_tensors`` copies it at once). A peer that dies
    mid-way ends the call with gloo's / NCCL's error at once; a peer that never comes ends it after ``timeout_s``."""

    rendezvous = True

    def __init__(self, backend: str, bucket_bytes: int, timeout_s: float) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"a collective weight transport is gloo or nccl, not {backend!r}")
        self.backend, self.bucket_bytes, self.timeout_s = backend, bucket_bytes, timeout_s
        self.stores: dict[Any, Any] = {}  # the channels' rendezvous stores, by peer (hosted by the actor's side)
        self.channels: dict[Any, Any] = {}  # the process groups, by peer (a rollout worker's only one: RECEIVER)
        self.received_version = 0  # a rollout worker: the version of the last weights received

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    # ------------------------------------------------------------------ set-up
    def open(self, peer: int) -> tuple[str, int]:
        """The actor's side: a rendezvous store for rollout worker ``peer`` (replacing an earlier channel to it: a
        rebuilt worker) on this node's address and a free port, returned for the worker's :meth:`connect`."""
        from torch.distributed import TCPStore

        self.channels.pop(peer, None)
        host = _node_address()
        store = TCPStore(host, 0, 2, True, timedelta(seconds=self.timeout_s), wait_for_workers=False)
        self.stores[peer] = store
        return host, store.port

    def connect(self, address: tuple[str, int], peer: Any = RECEIVER) -> None:
        """Join the channel: the actor's side (``peer``: the rollout worker it opened it for) is rank 0, a rollout
        worker's (``peer`` left out) rank 1. Waits until the other side joins too."""
        import torch.distributed as dist

        timeout = timedelta(seconds=self.timeout_s)
        rank = 1 if peer == RECEIVER else 0
        if rank == 1:
            self.stores[peer] = dist.TCPStore(address[0], address[1], 2, False, timeout)
        store = self.stores[peer]
        if self.backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=_node_address())]
            options._timeout = timeout
            self.channels[peer] = dist.ProcessGroupGloo(store, rank, 2, options)
        else:  # CUDA builds of torch only
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.channels[peer] = dist.ProcessGroupNCCL(store, rank, 2, options)

    # ------------------------------------------------------------------ moving the weights
    def send(self, tensors: Iterable[tuple[str, torch.Tensor]], to: int | None = None, version: int = 0) -> None:
        """Broadcast the named tensors, the weights of ``version``, to rollout worker ``to`` (it must be receiving, or
        come to: see :meth:`receive`, :meth:`offered`)."""
        channel = self._channel(to)
        self.stores[to].set(OFFERED, str(version))
        tensors = [(name, tensor.detach()) for name, tensor in tensors]
        buckets = bucket_layout([(name, tuple(t.shape), t.dtype) for name, t in tensors], self.bucket_bytes)
        header = json.dumps({"version": version, "buckets": buckets}).encode()
        self._broadcast(channel, torch.tensor([len(header)], dtype=torch.int64))
        self._broadcast(channel, torch.frombuffer(bytearray(header), dtype=torch.uint8))
        by_name = dict(tensors)
        for bucket in buckets:
            flat = torch.empty(bucket["bytes"], dtype=torch.uint8, device=self.device)
            for name, _, _, offset in bucket["tensors"]:
                data = by_name[name].contiguous().reshape(-1).view(torch.uint8)
                flat[offset : offset + data.numel()].copy_(data)
            self._broadcast(channel, flat)

    def receive(self, handle: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors the actor broadcasts now (``handle`` plays no part). Left before the end (the receiver found a
        tensor it has not), it still takes the remaining buckets, so the sender is not left waiting."""
        channel = self._channel(RECEIVER)
        length = torch.zeros(1, dtype=torch.int64)
        self._broadcast(channel, length)
        header = torch.empty(int(length.item()), dtype=torch.uint8)
        self._broadcast(channel, header)
        layout = json.loads(header.cpu().numpy().tobytes())
        buckets, self.received_version = layout["buckets"], layout["version"]
        received = 0
        try:
            for bucket in buckets:
                flat = torch.empty(bucket["bytes"], dtype=torch.uint8, device=self.device)
                self._broadcast(channel, flat)
                received += 1
                for name, shape, dtype, offset in bucket["tensors"]:
                    dtype = _dtype(dtype)
                    size = torch.Size(shape).numel() * dtype.itemsize
                    yield name, flat[offset : offset + size].view(dtype).view(shape)
        finally:
            for bucket in buckets[received:]:
                self._broadcast(channel, torch.empty(bucket["bytes"], dtype=torch.uint8, device=self.device))

    def offered(self) -> int:
        """A rollout worker: the version of the weights the actor sends or last sent on the channel (0 before any)."""
        return self.stores[RECEIVER].add(OFFERED, 0)

    def _channel(self, peer: Any) -> Any:
        if peer not in self.channels:
            raise RuntimeError(
                f"no weight channel to {'the actor' if peer == RECEIVER else f'rollout worker {peer}'}: the actor and "
                "the rollout connect theirs as the rollout's workers start (rl_core.separate_rollout)"
            )
        return self.channels[peer]

    def _broadcast(self, channel: Any, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` into the other rank's (on the transport's device)."""
        import torch.distributed as dist

        on_device = tensor.to(self.device)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        channel.broadcast([on_device], options).wait()
        if on_device is not tensor:
            tensor.copy_(on_device)

    def __getstate__(self) -> dict:  # a transport travels to its worker without channels
        return {"backend": self.backend, "bucket_bytes": self.bucket_bytes, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)


def bucket_layout(tensors: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> list[dict]:
    """Where each tensor goes: ``[{"bytes": size, "tensors": [[name, shape, dtype, offset], ...]}, ...]``, in order;
    a bucket closes when the next tensor would take it past ``bucket_bytes``, offsets are multiples of
    :data:`ALIGNMENT`."""
    buckets: list[dict] = []
    current: list[list] = []
    end = 0
    for name, shape, dtype in tensors:
        size = torch.Size(shape).numel() * dtype.itemsize
        offset = -(-end // ALIGNMENT) * ALIGNMENT
        if current and offset + size > bucket_bytes:
            buckets.append({"bytes": end, "tensors": current})
            current, offset = [], 0
        current.append([name, list(shape), str(dtype).removeprefix("torch."), offset])
        end = offset + size
    if current:
        buckets.append({"bytes": end, "tensors": current})
    return buckets


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight channel: {name!r} is not a torch dtype")
    return dtype


def _node_address() -> str:
    """This process's node address as Ray knows it (what other nodes reach it at); 127.0.0.1 outside Ray."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
