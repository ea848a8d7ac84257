"""One persistent local Ray head for the whole test session (like the cluster a user keeps running)."""

import os
import socket
from pathlib import Path

import pytest
import ray

from infra.cluster import connect, start_local_head, stop_local_head

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def ray_address():
    """A head node on 127.0.0.1 with 8 logical CPUs (tests oversubscribe the 2 real cores), connected."""
    address = start_local_head(free_port(), num_cpus=8)
    connect(address, namespace="ppoflow-tests")
    yield address
    ray.shutdown()
    stop_local_head()


@pytest.fixture(scope="session")
def worker_env():
    """Workers import the test helpers too."""
    return {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
