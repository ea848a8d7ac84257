"""What a run needs, derived from its configuration by verl's rules: which roles (critic, reference) its workers
hold and whether a step runs the old-log-prob pass. The controller (which workers to build), the step (which stages
to run) and the config checks ask here; none decides it on its own."""

from __future__ import annotations

from typing import Any


def use_critic(config: Any) -> bool:
    """A critic when ``critic.enable`` says so, else when the estimator needs values (GAE), as verl."""
    enable = config.critic.enable
    return bool(enable) if enable is not None else config.algorithm.adv_estimator == "gae"


def update_pass_gives_old_log_probs(config: Any) -> bool:
    """Whether the update's own forward pass, detached, can serve as the old log-probs: one epoch and one mini-batch
    (the policy has not moved before it), and no KL penalty in the reward (which needs them before the update)."""
    actor = config.actor_rollout_ref.actor
    return bool(
        actor.ppo_epochs == 1
        and actor.ppo_mini_batch_size == config.data.train_batch_size
        and not config.algorithm.use_kl_in_reward
    )


def recomputes_old_log_prob(config: Any) -> bool:
    """Whether a step runs the old-log-prob pass: not in rollout correction's bypass mode (the rollout's are used),
    nor with ``actor.recompute_old_log_prob=false`` (the update's own forward pass gives them); when it is null
    (the default), only where the update's pass cannot serve (:func:`update_pass_gives_old_log_probs`) or something
    else needs them: rollout correction's decoupled mode, or a critic warm-up (steps without an update)."""
    actor, algorithm = config.actor_rollout_ref.actor, config.algorithm
    if algorithm.rollout_correction.bypass_mode:
        return False
    if actor.recompute_old_log_prob is not None:
        return bool(actor.recompute_old_log_prob)
    from rl_core.correction_settings import RolloutCorrection

    return bool(
        not update_pass_gives_old_log_probs(config)
        or RolloutCorrection.from_config(algorithm.rollout_correction).corrects
        or config.trainer.critic_warmup > 0
    )


def use_reference(config: Any) -> bool:
    """A reference policy with a KL penalty in the reward or a KL loss, as verl."""
    return bool(config.algorithm.use_kl_in_reward) or bool(config.actor_rollout_ref.actor.use_kl_loss)
