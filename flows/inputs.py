"""What a training run reads before anything starts, and the step count it plans from it.

A bad input fails here, before any run exists (the datasets check every prompt; the prompts' token ids are checked
against the models' embedding rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from rl_core.agent.tools.registry import tool_schemas
from rl_core.data.dataset import RLDataset
from rl_core.data.sampler import ResumableSampler
from rl_core.input_checks import InputError, image_problems, vocabulary_problems
from rl_core.models.loading import load_policy_processor, load_policy_tokenizer
from rl_core.ppo_step import resolved_total_steps
from rl_core.reward.custom import load_custom_reward_function
from rl_core.reward.manager import RewardManager, build_reward_manager


@dataclass
class TrainingInputs:
    """What a run reads before anything starts: a bad input fails here, before any run exists."""

    tokenizer: Any
    train_data: RLDataset
    val_data: RLDataset
    reward_manager: RewardManager

    @classmethod
    def load(cls, config: DictConfig) -> TrainingInputs:
        tokenizer = load_policy_tokenizer(config.actor_rollout_ref.model)
        processor = load_policy_processor(config.actor_rollout_ref.model, tokenizer)
        tools = tool_schemas(config.actor_rollout_ref.rollout.multi_turn)
        data = config.data
        train_data = RLDataset(data.train_files, tokenizer, data, data.train_max_samples, tools, processor)
        val_data = RLDataset(data.val_files, tokenizer, data, data.val_max_samples, tools, processor)
        problems = vocabulary_problems(config, tokenizer, [train_data, val_data])
        problems += image_problems(config, [train_data, val_data])
        if problems:
            raise InputError("\n".join(problems))
        reward = load_custom_reward_function(**config.custom_reward_function)
        return cls(tokenizer, train_data, val_data, build_reward_manager(config, tokenizer, reward))


def plan_steps(config: DictConfig, rows: int) -> int:
    """The run's step count (``trainer.total_training_steps``, else its epochs over ``rows`` prompts), written into the
    optimizers' LR-schedule lengths (the workers are built with it); returns it."""
    sampler = ResumableSampler(rows, config.data.train_batch_size, config.data.shuffle, config.data.seed)
    total = resolved_total_steps(config, sampler.batches_per_epoch)
    config.actor_rollout_ref.actor.optim.total_training_steps = total
    config.critic.optim.total_training_steps = total
    return total
