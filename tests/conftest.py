"""Shared fixtures: the project's config tree and a tiny local HF checkpoint built once per test session."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rl_core.models.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """A tiny Qwen2 checkpoint folder, exactly what `ppoflow make-tiny-model` writes."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2-tiny", seed=0)


@pytest.fixture()
def config(tiny_model_path):
    """The root config with the tiny model as the policy, small batches for fast tests."""
    cfg = OmegaConf.load(ROOT / "configs" / "ppo_trainer.yaml")
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
