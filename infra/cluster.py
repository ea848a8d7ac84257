"""Connecting to a Ray cluster, or starting the embedded local one on 127.0.0.1.

What Ray 2.60 does on its own for a local cluster, and what the embedded default overrides or keeps deliberately:
  * it resolves "localhost" to the machine's network address and listens on every interface; setting
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (the switch Ray uses for laptops) keeps a local cluster on 127.0.0.1;
  * it enables token authentication for local clusters and writes the token to ~/.ray/auth_token; we keep
    that (secure by default): drivers on the same machine find the token there, remote ones need
    RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH;
  * it starts an autoscaler monitor and a log monitor with every local cluster; the embedded one, a single machine
    whose drivers take no workers' output, starts neither (:func:`_without_monitors`);
  * it waits for a new raylet a whole second at a time; the embedded one asks every 50 ms
    (:func:`_raylet_looked_up_often`).
An address that does not answer is an error within ``timeout_s`` seconds instead of Ray's long retry loop.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray

from infra.ray_settings import (
    INLINE_OBJECTS_ENV,
    LOCAL_CLUSTER_ENV,
    LOOPBACK_ENV,
    ensure_auth_token,
    secure_auth_token,
)


def _stay_on_loopback() -> None:
    """Keep this process and the Ray processes it starts on 127.0.0.1, with token authentication.

    Ray reads both switches once (at import, and into its cached config), so besides the environment (which
    child processes inherit) the already-loaded values are refreshed: the constant, and the config cache.
    """
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    import ray._private.ray_constants as ray_constants
    from ray._raylet import Config

    ray_constants.ENABLE_RAY_CLUSTER = False
    Config.initialize("")


_embedded = False  # whether connect() started the cluster in this process (it ends with the process)
# what `ray start` can leave out and ray.init cannot: the autoscaler's monitor (`--no-monitor`) and the log monitor
# (`--include-log-monitor=false`), as Ray's own parameters of a node
NO_MONITORS = {"no_monitor": True, "include_log_monitor": False}


@contextlib.contextmanager
def _without_monitors() -> Iterator[None]:
    """While it is open, a local cluster that ``ray.init`` starts has neither of Ray's two monitor processes: the
    autoscaler's (a one-machine cluster has no nodes to add) and the log monitor (it streams the workers' output to
    drivers, and ppoflow's connect with ``log_to_driver=False``). Two Python processes (~1.1 CPU-s) booting beside
    the run's own on a small machine: a run's start-up 13.3 -> 12.3 s on 2 cores (bench/README.md). ``ray start``
    has a switch for each (the stack's head keeps them: ``ray status`` reads the autoscaler's); ``ray.init`` has none,
    so the node parameters it builds get them for the call (no change where a Ray release lacks the fields)."""
    from ray._private.parameter import RayParams

    original = RayParams.__init__
    if not set(NO_MONITORS) <= set(inspect.signature(original).parameters):
        yield
        return

    def without(self: RayParams, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **{**NO_MONITORS, **kwargs})

    RayParams.__init__ = without
    try:
        yield
    finally:
        RayParams.__init__ = original


RAYLET_POLL_S = 0.05  # how often a local cluster's start asks Ray's GCS whether its raylet has registered
RAYLET_WAIT_S = 10.0  # for that long (it registers 1-3 s after its start here); then Ray's own lookup (up to 30 s)


@contextlib.contextmanager
def _raylet_looked_up_often() -> Iterator[None]:
    """While it is open, a local cluster that ``ray.init`` starts is found registered within ``RAYLET_POLL_S`` of its
    raylet registering. Ray looks the new raylet up in a loop that sleeps a whole second between tries
    (``GlobalStateAccessor::GetNode``), first 0.1 s after starting it, while the raylet registers ~1.1 s after its
    start (once its two agents answer): the cluster was up 1 or 2 s after the raylet, by the second's grain. Here
    Ray's GCS is asked every ``RAYLET_POLL_S`` first (its Python client), then Ray's lookup runs and finds it at once
    (a raylet not registered within ``RAYLET_WAIT_S`` is left to Ray's lookup, which reports it as it would have)."""
    import ray._private.services as services

    original = services.get_node

    def get_node(gcs_address: str, node_id: str) -> Any:
        from ray._raylet import GcsClient

        client, deadline = GcsClient(address=gcs_address), time.monotonic() + RAYLET_WAIT_S
        while not _registered(client, node_id) and time.monotonic() < deadline:
            time.sleep(RAYLET_POLL_S)
        return original(gcs_address, node_id)

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = original


def _registered(client: Any, node_id: str) -> bool:
    """Whether the raylet ``node_id`` (hex) is alive in the GCS of ``client`` (Ray's ``GcsClient``; False while the
    GCS does not answer)."""
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    try:
        nodes = client.get_all_node_info(timeout=5)
    except Exception:
        return False
    return any(key.hex() == node_id and info.state == GcsNodeInfo.ALIVE for key, info in nodes.items())


class ClusterUnreachableError(ConnectionError):
    """The configured Ray address does not answer."""


def _check_reachable(address: str, timeout_s: float) -> None:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ClusterUnreachableError(f"ray address {address!r} is not host:port (e.g. 127.0.0.1:6379)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise ClusterUnreachableError(
            f"ray address {address} did not answer within {timeout_s:.0f}s ({error}); start the cluster (`ray start "
            "--head`), fix trainer.ray.address / RAY_ADDRESS, or unset both to run a local cluster"
        ) from error


class _BackgroundConnect:
    """:func:`connect` running in a thread of its own, which then stays alive as long as the process: Ray ties the
    processes of a cluster it starts to the thread that started them (they are killed when that thread ends)."""

    def __init__(self, address: str | None, num_cpus: int | None):
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(address, num_cpus), name="ppoflow-ray-connect", daemon=True
        )
        self.thread.start()

    def _run(self, address: str | None, num_cpus: int | None) -> None:
        try:
            connect(address, num_cpus=num_cpus)
        except Exception:  # the next connect() tries again in its own thread and reports the error there
            pass
        finally:
            self.done.set()
        threading.Event().wait()


_background: _BackgroundConnect | None = None


def connect_in_background(address: str | None = None, num_cpus: int | None = None) -> None:
    """Begin :func:`connect` now, in a thread, so that the cluster boots while this process imports and starts its other
    services (a local cluster takes ~5 s to start, mostly waiting); the next :func:`connect` waits for it.

    Ray's serialization context is made first, in the calling thread: its set-up imports the libraries Ray has
    serializers for (pydantic with its v1 fields, pyarrow, starlette), which the process's first Ray call would
    otherwise import in whichever thread makes it (a worker group started in a thread) while this thread imports the
    same libraries (Prefect's flow decorator, MLflow's pandas). Modules that import each other, imported by two threads
    at once, fail: "cannot import name 'Field' from partially initialized module 'pydantic.v1.fields'" (seen)."""
    global _background
    if _background is None and not ray.is_initialized():
        from ray._private.worker import global_worker

        global_worker.get_serialization_context()  # kept for the job once connected (Ray moves it over)
        _background = _BackgroundConnect(address, num_cpus)


def connected() -> bool:
    """Whether this process is connected to Ray, once a connection begun by :func:`connect_in_background` is done
    (never connects itself: a local cluster lives as long as the thread that starts it)."""
    if _background is not None:
        _background.done.wait()
    return ray.is_initialized()


def _not_about_sigterm(record: logging.LogRecord) -> bool:
    return "SIGTERM handler is not set" not in record.getMessage()


def connect(
    address: str | None = None, namespace: str | None = None, num_cpus: int | None = None, timeout_s: float = 10.0
) -> str:
    """Join the cluster at ``address`` (else RAY_ADDRESS), or start a local one on 127.0.0.1; returns the GCS address.
    A connection begun by :func:`connect_in_background` is waited for (and made again here if it failed)."""
    global _embedded
    if _background is not None and threading.current_thread() is not _background.thread:
        _background.done.wait()
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    address = address or os.environ.get("RAY_ADDRESS") or None
    _embedded = not address or address == "local"
    for key, value in INLINE_OBJECTS_ENV.items():
        os.environ.setdefault(key, value)
    on_main_thread = threading.current_thread() is threading.main_thread()
    sigterm_handler = signal.getsignal(signal.SIGTERM) if on_main_thread else None
    if not on_main_thread:  # Ray warns that it cannot install its SIGTERM handler: the command keeps its own anyway
        logging.getLogger("ray._private.worker").addFilter(_not_about_sigterm)
    if address and address != "local":
        if address != "auto":
            _check_reachable(address, timeout_s)
            if address.removeprefix("ray://").split(":")[0] in ("127.0.0.1", "localhost", "::1"):
                _stay_on_loopback()  # else Ray swaps the loopback address for the machine's and misses the head
        ray.init(address=address, namespace=namespace, log_to_driver=False)
    else:
        _stay_on_loopback()
        for key, value in LOCAL_CLUSTER_ENV.items():
            os.environ.setdefault(key, value)
        # address="local": a cluster of this process's own, even when another one runs on the machine (ray.init()
        # without an address would join that one, and this run would take it for its own)
        with _without_monitors(), _raylet_looked_up_often():
            ray.init(
                address="local", num_cpus=num_cpus, namespace=namespace, include_dashboard=False, log_to_driver=False
            )
    if callable(sigterm_handler):  # ray.init replaces it with an immediate exit; the command's own stops cleanly
        signal.signal(signal.SIGTERM, sigterm_handler)
    secure_auth_token()
    return ray.get_runtime_context().gcs_address


def is_persistent() -> bool:
    """True when this process joined a cluster that outlives it (not the embedded one :func:`connect` started)."""
    return ray.is_initialized() and not _embedded


def start_local_head(port: int, num_cpus: int | None = None, resources: str | None = None) -> str:
    """Start a persistent head node on 127.0.0.1 (outlives drivers, like a real cluster); returns its address."""
    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    command = [
        ray_cli,
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        command.append(f"--num-cpus={num_cpus}")
    if resources:
        command.append(f"--resources={resources}")
    env = {**os.environ, **LOOPBACK_ENV, **LOCAL_CLUSTER_ENV, **INLINE_OBJECTS_ENV}
    ensure_auth_token(ray_cli, env)
    started = subprocess.run(command, capture_output=True, text=True, env=env)
    if started.returncode != 0:
        raise RuntimeError(
            f"`ray start --head` on 127.0.0.1:{port} failed: "
            f"{started.stderr.strip().splitlines()[-1] if started.stderr.strip() else started.returncode}"
        )
    return f"127.0.0.1:{port}"


def stop_local_head(address: str) -> None:
    """Kill the head :func:`start_local_head` started at ``address``: every process whose command line names its port
    (GCS, raylet, agents, workers), as ``ray stop --force`` does, and nothing else (``ray stop`` ends every Ray cluster
    of the user on the machine: another test session's, a user's own)."""
    port = address.rsplit(":", 1)[1]
    marks = (f"127.0.0.1:{port}", f"--gcs_server_port={port}")
    for entry in os.scandir("/proc"):
        try:
            command = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if entry.name.isdigit() and int(entry.name) != os.getpid() and any(mark in command for mark in marks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
