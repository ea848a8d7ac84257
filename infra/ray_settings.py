"""The environment of every Ray process a run starts or joins, and the token file's permissions: what the embedded
cluster (infra/cluster.py), the stack's Ray head (infra/stack.py) and the Kubernetes manifests (infra/k8s) share,
without importing Ray (which takes a second)."""

from __future__ import annotations

import os
import subprocess

# the embedded cluster: on 127.0.0.1, with Ray's token authentication on (its token in ~/.ray/auth_token)
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
# clusters this module starts run workers at normal priority: Ray's default niceness (15) lets the controller's
# own threads preempt the training threads, which stalls every multi-threaded torch op (measured: step 1.38x -> 1.22x);
# and start no worker process before a run asks for one: the one Ray starts when the first driver connects stayed idle
# (the run's actor got a process of its own), ~0.5 CPU-s while a run starts on 2 cores; and a head run by `ray start
# --block` (the stack's) ends at once on SIGTERM: Ray drains it first for up to 30 s (for Ray Serve's replicas) while
# any actor lives, so `ppoflow down` with a standby group took 32 s; and a raylet that finds its own object store's
# socket not there yet (it starts the store in a thread just before) tries again after 0.1 s instead of a whole second
# (Ray's 10 tries 1 s apart: a 1-s stall in 3 starts of 5 here), with the same 10 s of patience in all
LOCAL_CLUSTER_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_prestart_worker_first_driver": "0",
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    "RAY_raylet_client_connect_timeout_milliseconds": "100",
    "RAY_raylet_client_num_connect_attempts": "100",
}
# every process of a run (the driver too, whichever cluster it joins) passes objects up to 4 MiB inside the call
# instead of through the shared-memory object store (Ray's default stops at 100 KiB): a step's batch and its
# results travel inline, measured 2.5-3 ms less per call at 150 KB and a batch-16 demo step 1.2-1.3x faster on Ray
INLINE_OBJECTS_ENV = {"RAY_max_direct_call_object_size": str(4 * 1024 * 1024)}


def secure_auth_token() -> None:
    """Ray writes its token file readable by everyone (0644): make it the owner's only."""
    path = os.path.expanduser(os.environ.get("RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token"))
    if os.path.isfile(path) and os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o600)


def ensure_auth_token(ray_cli: str, env: dict[str, str]) -> None:
    """Ray's token authentication needs a token before a head starts: ``ray get-auth-token --generate`` writes
    ~/.ray/auth_token when there is none (an existing one is kept), then it is made the owner's only. Its output, the
    token, is not printed. On a machine that never ran Ray, without this, the head exits at once."""
    subprocess.run([ray_cli, "get-auth-token", "--generate"], check=True, capture_output=True, env=env)
    secure_auth_token()
