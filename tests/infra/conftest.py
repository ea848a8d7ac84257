"""What the stack tests share: the ``ppoflow`` command run as a user runs it, in an environment of its own."""

import os
import subprocess
import sys

import pytest

from infra.watchdog import all_stats
from tests.conftest import ROOT

# the demo, small: what the stack tests train on the stack
SMALL_DEMO = [
    "data.synthetic.train_size=64",
    "data.synthetic.val_size=16",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
]


def ppoflow(env: dict, *args: str, timeout: float = 300, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def process_group_alive(pgid: int) -> bool:
    """A live (not zombie: an orphan's exit may not be reaped at once) process is in the group."""
    return any(group == pgid and state != "Z" for state, _, group, _ in all_stats().values())


@pytest.fixture()
def stack_env(tmp_path):
    """The environment of a ``ppoflow`` command with no stack of the caller's (PPOFLOW_HOME in ``tmp_path``); what the
    test started is stopped after it, whatever happened."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    env["PPOFLOW_HOME"] = str(tmp_path / "home")
    yield env
    ppoflow(env, "down", timeout=120)
