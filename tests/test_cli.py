"""The ppoflow command line: listing, and a bad training config rejected in one line before anything starts."""

import subprocess
import sys

from tests.conftest import ROOT


def ppoflow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_algos_lists_the_registries():
    result = ppoflow("algos")
    assert result.returncode == 0 and "grpo" in result.stdout and "cispo" in result.stdout and "k3+" in result.stdout


def test_train_rejects_a_bad_key_and_a_bad_type():
    result = ppoflow("train", "algorithm.adv_estimatr=gae")
    assert result.returncode == 2
    assert result.stderr.strip() == ("ppoflow train: unknown config key 'algorithm.adv_estimatr': check the spelling "
                                     "(see configs/ppo_trainer.yaml), or write +algorithm.adv_estimatr=... to add a key of your own")
    result = ppoflow("train", "trainer.total_training_steps=ten")
    assert result.returncode == 2 and "trainer.total_training_steps: expected int" in result.stderr
