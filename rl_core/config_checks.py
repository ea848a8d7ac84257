"""The config's values that its types cannot refuse (choices, ranges, combinations), refused with the key and the fix
(:func:`check_config`; the types and the key set are OmegaConf's, :mod:`rl_core.config`). Torch-free: ``ppoflow train``
runs it before anything heavy imports."""

from __future__ import annotations

import math
from typing import Any

from rl_core.config import COMPUTE_DTYPE_NAMES, DEVICES
from rl_core.data.synthetic import TASKS
from rl_core.rollout_schedule import AGENT_BATCHING, SCHEDULES, check_async_training
from rl_core.run_roles import update_pass_gives_old_log_probs

CHOICES = {
    "data.truncation": ("error", "left", "right"),
    "data.synthetic.task": TASKS,
    "actor_rollout_ref.model.dtype": tuple(name for name, dtype in COMPUTE_DTYPE_NAMES.items() if dtype),
    "actor_rollout_ref.actor.strategy": ("fsdp", "fsdp2"),
    "actor_rollout_ref.actor.optim.lr_scheduler_type": ("constant", "cosine"),
    "critic.strategy": ("fsdp", "fsdp2"),
    "critic.optim.lr_scheduler_type": ("constant", "cosine"),
    "reward.reward_manager": ("naive", "batch"),
    "reward.on_error": ("raise", "zero"),
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "trainer.device": DEVICES,
    "actor_rollout_ref.actor.fsdp_config.dtype": tuple(COMPUTE_DTYPE_NAMES),
    "critic.fsdp.dtype": tuple(COMPUTE_DTYPE_NAMES),
    "actor_rollout_ref.rollout.dtype": tuple(COMPUTE_DTYPE_NAMES),
    "trainer.resume_mode": ("auto", "disable", "resume_path"),
    "actor_rollout_ref.rollout.multi_turn.format": ("hermes", "tag"),
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": ("left", "middle", "right"),
    "actor_rollout_ref.rollout.multi_turn.on_parse_error": ("feedback", "stop"),
    "async_training.mode": SCHEDULES,
    "actor_rollout_ref.rollout.agent.batching": AGENT_BATCHING,
    "actor_rollout_ref.rollout.checkpoint_engine.backend": ("naive", "gloo", "nccl"),
}
POSITIVE = (
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls",
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length",
    "actor_rollout_ref.rollout.multi_turn.tool_timeout_s",
    "actor_rollout_ref.rollout.agent.endpoint.timeout_s",
    "actor_rollout_ref.rollout.multi_turn.max_concurrent_tools",
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_tokens",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.train_batch_size",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.generation_batch_size",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.val_kwargs.n",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.max_num_seqs",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",
    "critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size_per_gpu",
    "reward_model.micro_batch_size_per_gpu",
    "trainer.total_epochs",
    "trainer.n_gpus_per_node",
    "trainer.nnodes",
    "trainer.worker_timeout_s",
)


# micro-batch sizes whose null means micro-batches packed by a token budget: key -> (the budget, its dynamic switch)
NULL_IS_A_TOKEN_BUDGET = {
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.actor.use_dynamic_bsz",
    ),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": (
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
    ),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": (
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    ),
    "critic.ppo_micro_batch_size_per_gpu": ("critic.ppo_max_token_len_per_gpu", "critic.use_dynamic_bsz"),
    "critic.forward_micro_batch_size_per_gpu": ("critic.forward_max_token_len_per_gpu", "critic.use_dynamic_bsz"),
}


class ConfigValueError(ValueError):
    """A value of the right type that cannot work (a bad choice, a non-positive size, ...)."""


def check_algorithm_names(config: Any) -> None:
    """Refuse an estimator, policy loss, aggregation or KL penalty that is not registered
    (:func:`rl_core.algo_names.algorithm_choices`: read without importing torch until the registries are imported)."""
    from omegaconf import OmegaConf

    from rl_core.algo_names import algorithm_choices

    for key, allowed in algorithm_choices().items():
        value = OmegaConf.select(config, key)
        if value not in allowed:
            raise ConfigValueError(f"{key}={value!r}: choose one of {', '.join(sorted(allowed))}")


def check_token_budgets(config: Any) -> None:
    """Refuse a token budget shorter than the longest sequence where it packs micro-batches (a null micro-batch size,
    or ``use_dynamic_bsz``): the first long sequence would fail mid-run."""
    from omegaconf import OmegaConf

    longest = config.data.max_prompt_length + config.data.max_response_length
    for key, (budget_key, dynamic_key) in NULL_IS_A_TOKEN_BUDGET.items():
        budget = OmegaConf.select(config, budget_key)
        by_tokens = OmegaConf.select(config, key) is None or OmegaConf.select(config, dynamic_key)
        if by_tokens and budget < longest:
            raise ConfigValueError(
                f"{budget_key}={budget} is shorter than the longest sequence (data.max_prompt_length + "
                f"data.max_response_length = {longest}), and {key} packs micro-batches by it; raise it, or set {key}"
            )


def check_config(config: Any) -> None:
    """Refuse values that the types allow but the run cannot use, naming the key and the fix (the algorithm names:
    :func:`check_algorithm_names`)."""
    check_values(config)
    check_training(config)
    check_rollout(config)
    check_algorithm_names(config)


def check_values(config: Any) -> None:
    """Each key on its own: a choice, a size > 0, a token budget, a limit, a learning rate, a dtype."""
    from omegaconf import OmegaConf

    for key, allowed in CHOICES.items():
        value = OmegaConf.select(config, key)
        if value not in allowed:
            raise ConfigValueError(f"{key}={value!r}: choose one of {', '.join(sorted(allowed))}")
    for key in POSITIVE:
        value = OmegaConf.select(config, key)
        if not (value is None and key in NULL_IS_A_TOKEN_BUDGET) and not value > 0:
            raise ConfigValueError(f"{key}={value!r}: must be > 0")
    check_token_budgets(config)
    if config.reward.timeout_s is not None and not config.reward.timeout_s > 0:
        raise ConfigValueError(f"reward.timeout_s={config.reward.timeout_s}: must be > 0 (or null for no limit)")
    steps = config.trainer.total_training_steps
    if steps is not None and steps <= 0:
        raise ConfigValueError(
            f"trainer.total_training_steps={steps}: must be > 0 (or null to train for trainer.total_epochs)"
        )
    for key in ("actor_rollout_ref.actor.optim.lr", "critic.optim.lr"):
        lr = OmegaConf.select(config, key)
        if not (math.isfinite(lr) and lr > 0):
            raise ConfigValueError(f"{key}={lr!r}: must be a finite number > 0")
    for key in (
        "actor_rollout_ref.model.dtype",
        "actor_rollout_ref.actor.fsdp_config.dtype",
        "critic.model.dtype",
        "critic.fsdp.dtype",
    ):
        if OmegaConf.select(config, key) in ("float16", "fp16"):
            raise ConfigValueError(
                f"{key}=float16: training in float16 needs loss scaling, which ppoflow does not do (its gradients "
                "would underflow silently); use bfloat16 (any GPU since Ampere) or float32"
            )


def check_training(config: Any) -> None:
    """The actor's update and the algorithm's settings together."""
    actor = config.actor_rollout_ref.actor
    if not actor.clip_ratio_c > 1:
        raise ConfigValueError(
            f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c}: the dual-clip bound must be greater than 1"
        )
    if actor.ppo_mini_batch_size > config.data.train_batch_size:
        raise ConfigValueError(
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} > "
            f"data.train_batch_size={config.data.train_batch_size}: a mini-batch cannot be larger than the step's batch"
        )
    if config.algorithm.filter_groups.enable and config.algorithm.use_kl_in_reward:
        raise ConfigValueError(
            "algorithm.filter_groups.enable=true with algorithm.use_kl_in_reward=true: groups are filtered before the "
            "log-probs that the KL penalty needs exist; use actor_rollout_ref.actor.use_kl_loss instead"
        )
    if actor.recompute_old_log_prob is False and not update_pass_gives_old_log_probs(config):
        raise ConfigValueError(
            "actor_rollout_ref.actor.recompute_old_log_prob=false needs ppo_epochs=1, ppo_mini_batch_size = "
            "data.train_batch_size (one update of the policy the responses came from) and no "
            "algorithm.use_kl_in_reward (it needs the old log-probs before the advantage)"
        )
    from rl_core.correction_settings import check_rollout_correction

    check_rollout_correction(config)


def check_rollout(config: Any) -> None:
    """The rollout: its schedule, its engine, its agents."""
    check_async_training(config, ConfigValueError)
    rollout = config.actor_rollout_ref.rollout
    if not 0 < rollout.gpu_memory_utilization <= 1:
        raise ConfigValueError(
            f"actor_rollout_ref.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization}: a share of the GPU in "
            "(0, 1]"
        )
    tp = rollout.tensor_model_parallel_size
    if tp > 1 and (rollout.name != "vllm" or config.trainer.n_gpus_per_node % tp):
        raise ConfigValueError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: tensor parallelism needs rollout.name=vllm "
            f"and a divisor of trainer.n_gpus_per_node={config.trainer.n_gpus_per_node}"
        )
    backend = rollout.checkpoint_engine.backend
    if backend != "naive" and config.rollout.n_gpus_per_node == 0:
        raise ConfigValueError(
            f"actor_rollout_ref.rollout.checkpoint_engine.backend={backend}: moves weights to a rollout on workers of "
            "its own, and this run's rollout shares the actor's (rollout.n_gpus_per_node=0); set "
            "rollout.n_gpus_per_node, or leave the backend naive"
        )
    if backend == "nccl" and config.trainer.device == "cpu":
        raise ConfigValueError(
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl needs GPUs (trainer.device=cpu): use gloo"
        )
    if not config.actor_rollout_ref.hybrid_engine:
        raise ConfigValueError(
            "actor_rollout_ref.hybrid_engine=false: only the hybrid engine (rollout in the actor's worker, sharing its "
            "weights) is built; set it to true"
        )
    from rl_core.agent.checks import check_multi_turn  # the agent package imports this module

    check_multi_turn(config.actor_rollout_ref.rollout)
