"""Shared fixtures: the project's config tree and a tiny local HF checkpoint built once per test session."""

import os
import socket
from pathlib import Path

import pytest
import ray
import torch
from omegaconf import OmegaConf

from flows.config import compose_config, demo_profile
from flows.demo import ensure_demo_model
from infra.cluster import connect, start_local_head, stop_local_head
from rl_core.config import default_config
from rl_core.models.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent

# The suite runs in two pytest processes (pyproject.toml: `-n 2`), tests handed to whichever is free: each process
# starts its own Ray head and Prefect API (the session fixtures below) when its first test needs one. (Grouping those
# tests into one process with `--dist loadgroup` does nothing under pytest 9.2: xdist 3.8 renames the items' ids
# through an attribute pytest no longer reads.)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A tiny Qwen2 checkpoint folder, exactly what `ppoflow make-tiny-model` writes."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2-tiny", seed=0)


@pytest.fixture()
def config(tiny_model_path):
    """The embedded demo's config (the defaults under the demo profile) with the tiny model as the policy, small batches
    for fast tests."""
    cfg = OmegaConf.merge(default_config(), demo_profile())
    cfg.actor_rollout_ref.model.path = str(tiny_model_path)
    cfg.data.train_batch_size = 4
    cfg.actor_rollout_ref.rollout.n = 4
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 2
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 3
    cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 5
    cfg.critic.ppo_micro_batch_size_per_gpu = 3
    return cfg


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def ray_address():
    """One persistent head on 127.0.0.1 for the whole session (8 logical CPUs: tests oversubscribe the 2 cores)."""
    address = start_local_head(free_port(), num_cpus=8)
    connect(address, namespace="ppoflow-tests")
    yield address
    ray.shutdown()
    stop_local_head(address)


@pytest.fixture(scope="session")
def worker_env():
    """Workers import the test helpers too."""
    return {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API for the whole session (Prefect's test harness: a temporary server on SQLite)."""
    from prefect.testing.utilities import prefect_test_harness

    from flows.prefect_server import configure_prefect

    configure_prefect()  # the server settings a command's temporary server gets (task runs recorded in batches)

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
    """The embedded demo's SFT-warm-started model, built here once for all flow tests (so that no test's own time
    includes the warm start); each run writes the data files of its sizes beside it."""
    cache = tmp_path_factory.mktemp("demo-cache")
    ensure_demo_model(compose_config([f"trainer.cache_dir={cache}"]))
    return cache


def small_run_overrides(folder: Path, demo_cache: Path, *extra: str) -> list[str]:
    """A 3-step training run of the demo with small batches, everything written under ``folder``."""
    return [
        f"trainer.tracking_uri=sqlite:///{folder}/mlflow.db",
        f"trainer.artifact_location={folder}/mlartifacts",
        f"trainer.default_local_dir={folder}/checkpoints",
        f"trainer.cache_dir={demo_cache}",
        "data.synthetic.train_size=64",
        "data.synthetic.val_size=16",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        "trainer.test_freq=3",
        "trainer.log_samples_freq=1",
        "trainer.worker_timeout_s=120",
        "trainer.cpus_per_worker=1",
        *extra,
    ]
