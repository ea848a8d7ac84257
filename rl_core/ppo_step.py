"""One PPO step: the stages in order, and the only implementation of that order.

The flow (Prefect tasks on a Ray worker group), the tests and the benchmark all run :func:`run_ppo_step`; what
differs is the *stage runner* and the *workers*:

* ``run_stage(name, fn, *args)`` calls the stage function ``fn`` — :func:`run_directly` calls it, the flow's runner
  calls it and reports it as a Prefect task run of the task ``name``;
* :class:`StepWorkers` holds the role objects the stages call (``actor.update_actor(batch)``...): in-process
  workers, or handles that dispatch to a Ray worker group.

Every stage function reads its inputs and returns what it produces (new tensors in a Batch, or metrics); it
never mutates its inputs, so a stage runner that records inputs (Prefect) sees the data dependencies. The step
merges the outputs into the batch. Stages are skipped by verl's rules: the critic only when the estimator needs
values (gae) or ``critic.enable``; the reference policy only with KL in the reward or a KL loss; the reward model
only when enabled; the actor update only after ``trainer.critic_warmup`` steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rl_core.agent.tools.registry import configured_tools
from rl_core.algos.advantage import call_adv_estimator
from rl_core.algos.kl import apply_kl_penalty
from rl_core.algos.masked import masked_mean
from rl_core.algos.rollout_correction import rollout_correction
from rl_core.batch import Batch
from rl_core.batch_fields import (
    ADVANTAGES,
    ATTENTION_MASK,
    ENTROPYS,
    GLOBAL_STEP,
    GREEDY,
    MULTI_MODAL_INPUTS,
    MULTI_TURN,
    NUM_TURNS,
    OLD_LOG_PROBS,
    REF_LOG_PROB,
    RESPONSE_MASK,
    RETURNS,
    REWARD_BASELINES,
    RM_SCORES,
    ROLLOUT_CORRECTION,
    ROLLOUT_IS_WEIGHTS,
    ROLLOUT_LOG_PROBS,
    SEQUENCE,
    TOKEN_LEVEL_REWARDS,
    TOKEN_LEVEL_SCORES,
    UID,
    VAL_KWARGS,
    VALIDATE,
    VALUES,
)
from rl_core.correction_settings import RolloutCorrection
from rl_core.data.dataset import RLDataset
from rl_core.data.sampler import ResumableSampler
from rl_core.metrics import compute_data_metrics, multi_turn_metrics, rollout_probs_diff_metrics, validation_metrics
from rl_core.reward.manager import RewardManager
from rl_core.run_roles import recomputes_old_log_prob, use_critic, use_reference

Metrics = dict[str, float]
# stage name (the Prefect task) -> its verl timing name (``timing_s/<name>``)
TIMING_NAMES = {
    "generate": "gen",
    "reward": "reward",
    "old_log_prob": "old_log_prob",
    "ref_log_prob": "ref",
    "values": "values",
    "advantage": "adv",
    "update_critic": "update_critic",
    "update_actor": "update_actor",
}
# stages that give the same result when run again (seeded sampling; pure functions of the weights): retry-safe
IDEMPOTENT_STAGES = ("generate", "old_log_prob", "ref_log_prob", "values")


def retry_safe_stages(config: Any) -> tuple[str, ...]:
    """The stages a transient failure may re-run: ``IDEMPOTENT_STAGES``, less ``generate`` when a tool of a multi-turn
    rollout is not idempotent (a second rollout would call it again, with another effect)."""
    tools = configured_tools(config.actor_rollout_ref.rollout.multi_turn)
    if all(tool.idempotent for tool in tools.values()):
        return IDEMPOTENT_STAGES
    return tuple(name for name in IDEMPOTENT_STAGES if name != "generate")


@dataclass
class StepWorkers:
    """The role objects a step calls. ``actor`` has generate_sequences / compute_log_prob / compute_ref_log_prob /
    update_actor; ``critic`` compute_values / update_critic; ``reward_model`` compute_rm_score."""

    actor: Any
    critic: Any | None = None
    reward_model: Any | None = None
    world_size: int = 1
    separate_rollout: Any | None = None  # rl_core.separate_rollout.SeparateRollout: generation on workers of its own


def run_directly(name: str, fn: Callable, *args: Any) -> Any:
    """The plain stage runner: call the stage."""
    return fn(*args)


def _for_workers(batch: Batch, *inputs: Batch) -> Batch:
    """The sequence tensors of ``batch`` plus the tensors of ``inputs``, with the batch's meta info (temperature) and
    its images (a vision-language run's ``multi_modal_inputs``)."""
    tensors = {key: batch.tensors[key] for key in SEQUENCE}
    for extra in inputs:
        tensors.update(extra.tensors)
    images = batch.non_tensors.get(MULTI_MODAL_INPUTS)
    return Batch(tensors, None if images is None else {MULTI_MODAL_INPUTS: images}, meta_info=batch.meta_info)


def step_prompts(data: RLDataset, indices: list[int], step: int, generation_batch: int) -> Batch:
    """The prompts of a step's generation batch: their uids name the step and batch, and the batch seeds the sampling
    (a re-run step draws the same samples)."""
    prompts = data.collate(indices, uid_prefix=f"{step}-{generation_batch}-")
    prompts.meta_info[GLOBAL_STEP] = step * 1000 + generation_batch
    return prompts


# ---------------------------------------------------------------------------------------------- the stages
def generate(workers: StepWorkers, prompts: Batch, n: int, baseline_reward: RewardManager | None = None) -> Batch:
    """Stage 1: ``n`` sampled responses per prompt. Each prompt is repeated ``n`` times before the rollout (as verl
    does), so every worker gets one row per response it samples and data-parallel padding stays one row in, one row
    out. With ``baseline_reward`` (ReMax) also the greedy response's score per prompt, repeated over its samples as
    ``reward_baselines``."""
    sequences = workers.actor.generate_sequences(prompts.repeat_interleave(n))
    if baseline_reward is None:
        return sequences
    greedy = workers.actor.generate_sequences(
        Batch(prompts.tensors, prompts.non_tensors, {**prompts.meta_info, GREEDY: True})
    )
    scored, _ = reward(workers, baseline_reward, greedy)
    sequences.tensors[REWARD_BASELINES] = scored.tensors[TOKEN_LEVEL_SCORES].sum(-1).repeat_interleave(n)
    return sequences


def generation_on(config: Any, reward_manager: RewardManager) -> Callable[[Any, Batch], Batch]:
    """Stage 1 as a rollout of its own runs it (:class:`rl_core.separate_rollout.SeparateRollout`): ``fn(rollout,
    prompts)``; with a reference policy, stage 4 follows there (the rollout's workers hold it, the trainer's not)."""
    n = int(config.actor_rollout_ref.rollout.n)
    baseline_reward = reward_manager if config.algorithm.adv_estimator == "remax" else None
    with_ref = use_reference(config)

    def generate_on(rollout: Any, prompts: Batch) -> Batch:
        workers = StepWorkers(actor=rollout)
        batch = generate(workers, prompts, n, baseline_reward)
        return batch.union(ref_log_prob(workers, batch)) if with_ref else batch

    return generate_on


def launch_generations(
    rollout: Any, config: Any, data: RLDataset, sampler: ResumableSampler, prompts: Batch, step: int
) -> None:
    """As step ``step`` starts (``prompts`` drawn): launch on the rollout of its own (:class:`rl_core.separate_rollout.
    SeparateRollout`) every generation its window lets start, the later steps' prompts read ahead of the sampler."""
    steps = rollout.steps_to_launch(step, config.trainer.total_training_steps or step)
    upcoming = rollout.upcoming(sampler, steps[-1] - step) if steps else []
    for later in steps:
        later_prompts = prompts if later == step else step_prompts(data, upcoming[later - step - 1], later, 0)
        rollout.launch(later_prompts, later)


def take_generation(
    rollout: Any, config: Any, data: RLDataset, sampler: ResumableSampler, prompts: Batch, step: int, launch: bool
) -> tuple[Batch, Metrics]:
    """Stage 1 on a rollout of its own: with ``launch`` (the step's first batch) what the window lets start now (a
    rendezvous weight transport's sync included: the trainer waits for it), then this batch's generation."""
    if launch:
        launch_generations(rollout, config, data, sampler, prompts, step)
    return rollout.take(prompts, step)


def reward(workers: StepWorkers, reward_manager: RewardManager, batch: Batch) -> tuple[Batch, Metrics]:
    """Stage 2: ``token_level_scores`` (the score on each response's last token) and the scorer's per-sample
    extra values; the reward model's ``rm_scores`` when there is one."""
    rm_scores = (
        workers.reward_model.compute_rm_score(batch).tensors[RM_SCORES] if workers.reward_model is not None else None
    )
    result = reward_manager(batch, rm_scores)
    tensors = {TOKEN_LEVEL_SCORES: result.token_level_scores}
    if rm_scores is not None:
        tensors[RM_SCORES] = rm_scores
    return Batch(tensors, result.extra_info), result.metrics


def old_log_prob(workers: StepWorkers, batch: Batch) -> tuple[Batch, Metrics]:
    """Stage 3: ``old_log_probs`` and ``entropys`` of the responses under the current actor; ``actor/entropy`` (over
    every response token of the batch), and with the sampler's own log-probs verl's ``training/rollout_probs_diff_*``
    (how far the samples are from the policy that is trained)."""
    old = workers.actor.compute_log_prob(_for_workers(batch))
    mask = batch.tensors[RESPONSE_MASK]
    metrics = {"actor/entropy": float(masked_mean(old.tensors[ENTROPYS], mask))}
    if ROLLOUT_LOG_PROBS in batch.tensors:
        metrics |= rollout_probs_diff_metrics(batch.tensors[ROLLOUT_LOG_PROBS], old.tensors[OLD_LOG_PROBS], mask)
    return old, metrics


def ref_log_prob(workers: StepWorkers, batch: Batch) -> Batch:
    """Stage 4: ``ref_log_prob`` under the reference policy."""
    return workers.actor.compute_ref_log_prob(_for_workers(batch))


def values(workers: StepWorkers, batch: Batch) -> Batch:
    """Stage 5: the critic's ``values``."""
    return workers.critic.compute_values(_for_workers(batch))


def advantage(
    config: Any, kl_controller: Any, batch: Batch, old: Batch | None, ref: Batch | None, value: Batch | None
) -> tuple[Batch, Metrics]:
    """Stage 6 (cheap maths, in the controller): KL in the reward (optional), rollout correction in its decoupled
    mode (with the rollout's and the old log-probs: importance weights ``rollout_is_weights`` and a
    ``response_mask`` without the rejected tokens, which then replaces the batch's), then the configured estimator
    -> ``token_level_rewards``, ``advantages``, ``returns``; the KL and ``rollout_corr/*`` metrics."""
    algorithm = config.algorithm
    scores, response_mask = batch.tensors[TOKEN_LEVEL_SCORES], batch.tensors[RESPONSE_MASK]
    metrics: Metrics = {}
    corrected: dict = {}
    correction = RolloutCorrection.from_config(algorithm.rollout_correction)
    if old is not None and ROLLOUT_LOG_PROBS in batch.tensors and not correction.bypass_mode:
        weights, kept, metrics = rollout_correction(
            old.tensors[OLD_LOG_PROBS], batch.tensors[ROLLOUT_LOG_PROBS], response_mask, correction
        )
        if weights is not None:
            corrected[ROLLOUT_IS_WEIGHTS] = weights
        if correction.rejections:
            corrected[RESPONSE_MASK] = response_mask = kept
    if algorithm.use_kl_in_reward:
        rewards, kl_metrics = apply_kl_penalty(
            scores,
            old.tensors[OLD_LOG_PROBS],
            ref.tensors[REF_LOG_PROB],
            response_mask,
            kl_controller,
            algorithm.kl_penalty,
        )
        metrics |= kl_metrics
    else:
        rewards = scores
    inputs = {
        "token_level_rewards": rewards,
        "response_mask": response_mask.float(),
        "config": algorithm,
        "index": batch.non_tensors[UID],
        "gamma": algorithm.gamma,
        "lam": algorithm.lam,
        "norm_adv_by_std_in_grpo": algorithm.norm_adv_by_std_in_grpo,
    }
    if value is not None:
        inputs["values"] = value.tensors[VALUES]
    if REWARD_BASELINES in batch.tensors:
        inputs["reward_baselines"] = batch.tensors[REWARD_BASELINES]
    advantages, returns = call_adv_estimator(algorithm.adv_estimator, **inputs)
    return Batch({TOKEN_LEVEL_REWARDS: rewards, ADVANTAGES: advantages, RETURNS: returns, **corrected}), metrics


def update_critic(workers: StepWorkers, batch: Batch, value: Batch, adv: Batch) -> Metrics:
    """Stage 7: value-loss updates of the critic; its metrics."""
    returns = Batch({RETURNS: adv.tensors[RETURNS]})
    return workers.critic.update_critic(_for_workers(batch, value, returns))


def update_actor(workers: StepWorkers, batch: Batch, old: Batch | None, ref: Batch | None, adv: Batch) -> Metrics:
    """Stage 8: PPO updates of the actor (the rollout shares its weights: no sync needed); its metrics. ``old`` is
    None when the update computes the old log-probs itself (``recompute_old_log_prob=false``) or takes the
    rollout's (rollout correction's bypass mode)."""
    inputs = [adv.select([k for k in (ADVANTAGES, ROLLOUT_IS_WEIGHTS) if k in adv.tensors])]
    if old is not None:
        inputs.append(Batch({OLD_LOG_PROBS: old.tensors[OLD_LOG_PROBS]}))
    elif ROLLOUT_LOG_PROBS in batch.tensors:
        inputs.append(batch.select([ROLLOUT_LOG_PROBS]))
    if ref is not None:
        inputs.append(Batch({REF_LOG_PROB: ref.tensors[REF_LOG_PROB]}))
    return workers.actor.update_actor(_for_workers(batch, *inputs))


# ---------------------------------------------------------------------------------------------- one step
def rollout_and_score(
    config: Any,
    workers: StepWorkers,
    data: RLDataset,
    sampler: ResumableSampler,
    reward_manager: RewardManager,
    step: int,
    stage: Callable,
) -> tuple[Batch, Metrics]:
    """Stages 1-2 of step ``step`` through ``stage(name, fn, *args)`` (the step's runner: it reports, times and keeps
    the metrics): a generation batch of prompts from ``sampler``, sampled and scored; with DAPO's dynamic sampling
    (``algorithm.filter_groups``) repeated, keeping only the groups whose responses differ in the filter's metric, until
    ``train_batch_size`` groups are kept. Returns the batch and, when filtering, ``train/num_gen_batches``."""
    filter_groups = config.algorithm.filter_groups
    n = int(config.actor_rollout_ref.rollout.n)
    wanted = config.data.train_batch_size * n
    baseline_reward = reward_manager if config.algorithm.adv_estimator == "remax" else None
    kept: list[Batch] = []
    generation_batches = 0
    while True:
        prompts = step_prompts(data, sampler.next_batch(), step, generation_batches)
        generation_batches += 1
        if workers.separate_rollout is None:
            batch = stage("generate", generate, workers, prompts, n, baseline_reward)
        else:  # on the rollout's own workers: launch what the window lets start (this step's, later steps'), take
            first = generation_batches == 1
            batch = stage(
                "generate", take_generation, workers.separate_rollout, config, data, sampler, prompts, step, first
            )
        batch.union(stage("reward", reward, workers, reward_manager, batch))
        if not filter_groups.enable:
            return batch, {}
        kept.append(batch[informative_groups(batch, filter_groups.metric)])
        if sum(len(b) for b in kept) >= wanted:
            return Batch.concat(kept)[:wanted], {"train/num_gen_batches": float(generation_batches)}
        if 0 < filter_groups.max_num_gen_batches <= generation_batches:
            raise RuntimeError(
                f"dynamic sampling found fewer than {config.data.train_batch_size} prompts whose responses differ in "
                f"{filter_groups.metric!r} in {generation_batches} generation batches; raise "
                "algorithm.filter_groups.max_num_gen_batches or check the data (are all responses scored alike?)"
            )


def run_ppo_step(
    config: Any,
    workers: StepWorkers,
    data: RLDataset,
    sampler: ResumableSampler,
    reward_manager: RewardManager,
    kl_controller: Any,
    step: int,
    run_stage: Callable = run_directly,
) -> tuple[Batch, Metrics]:
    """Step ``step``: prompts from ``sampler``, stages 1-8; returns (the finished batch, the step's metrics with
    verl's names, ``timing_s/<stage>`` included)."""
    metrics: Metrics = {}
    timing: Metrics = {}

    def stage(name: str, fn: Callable, *args: Any) -> Any:
        """Run stage ``name``; a (batch, metrics) result adds its metrics to the step's and gives the batch."""
        start = time.perf_counter()
        result = run_stage(name, fn, *args)
        key = f"timing_s/{TIMING_NAMES[name]}"
        timing[key] = timing.get(key, 0.0) + time.perf_counter() - start
        if isinstance(result, tuple):
            result, stage_metrics = result
            metrics.update(stage_metrics)
        return result

    # Stages 1-2: rollout and reward, repeated (DAPO dynamic sampling) until enough groups have differing scores
    batch, rollout_metrics = rollout_and_score(config, workers, data, sampler, reward_manager, step, stage)
    metrics.update(rollout_metrics)
    if config.trainer.balance_batch and workers.world_size > 1:
        batch = batch[balanced_order(batch.tensors[ATTENTION_MASK].sum(-1).tolist(), workers.world_size)]

    # Stages 3-5: log-probs of the current and the reference policy, values (the first skipped when the update's
    # own forward pass serves as the old log-probs, actor.recompute_old_log_prob=false, or the rollout's do:
    # algorithm.rollout_correction.bypass_mode)
    old = stage("old_log_prob", old_log_prob, workers, batch) if recomputes_old_log_prob(config) else None
    if config.algorithm.rollout_correction.bypass_mode:
        batch.meta_info[ROLLOUT_CORRECTION] = RolloutCorrection.from_config(config.algorithm.rollout_correction)
    if REF_LOG_PROB in batch.tensors:  # a rollout of its own computed them after generating
        ref = batch.select([REF_LOG_PROB])
    else:
        ref = stage("ref_log_prob", ref_log_prob, workers, batch) if use_reference(config) else None
    value = stage("values", values, workers, batch) if use_critic(config) else None

    # Stage 6: advantage (and rollout correction: a mask without the rejected tokens replaces the batch's)
    adv = stage("advantage", advantage, config, kl_controller, batch, old, ref, value)
    if RESPONSE_MASK in adv.tensors:
        batch.tensors[RESPONSE_MASK] = adv.tensors[RESPONSE_MASK]

    # Stages 7-8: critic and actor updates
    if value is not None:
        metrics.update(stage("update_critic", update_critic, workers, batch, value, adv))
    if step >= config.trainer.critic_warmup:  # verl's rule: steps are counted from 1
        metrics.update(stage("update_actor", update_actor, workers, batch, old, ref, adv))

    for output in (old, ref, value, adv):
        if output is not None:
            batch.union(output)
    return batch, {**metrics, **compute_data_metrics(batch), **timing}


def run_validation(
    config: Any,
    workers: StepWorkers,
    data: RLDataset,
    reward_manager: RewardManager,
    run_stage: Callable = run_directly,
    val_kwargs: dict[str, Any] | None = None,
    on_scored: Callable[[Batch], None] | None = None,
) -> Metrics:
    """Rollouts with ``val_kwargs`` (the config's ``rollout.val_kwargs`` unless an evaluation gives its own; greedy by
    default) on the validation set, scored like training (reward model included): ``val-core/<data_source>/acc/mean@n``
    and pass@k. ``on_scored`` is given the scored samples (the run logs a few with their images)."""
    val_kwargs = dict(val_kwargs or config.actor_rollout_ref.rollout.val_kwargs)
    n = int(val_kwargs["n"])
    size = config.data.val_batch_size or len(data)
    scored = []
    for start in range(0, len(data), size):
        prompts = data.collate(list(range(start, min(start + size, len(data)))), uid_prefix="val-")
        prompts.meta_info.update({VALIDATE: True, GLOBAL_STEP: 0, VAL_KWARGS: val_kwargs})
        batch = run_stage("generate", generate, workers, prompts, n)
        batch_scores, _ = run_stage("reward", reward, workers, reward_manager, batch)
        scored.append(batch.union(batch_scores))
    batch = Batch.concat(scored)
    if on_scored is not None:
        on_scored(batch)
    scores = batch.tensors[TOKEN_LEVEL_SCORES].sum(-1).tolist()
    metrics = validation_metrics(
        list(batch.non_tensors[config.data.reward_fn_key]), list(batch.non_tensors[UID]), scores, n
    )
    if NUM_TURNS in batch.non_tensors:  # multi-turn: how the policy used its tools (verl's val-aux/num_turns/mean)
        turns = multi_turn_metrics(list(batch.non_tensors[NUM_TURNS]), list(batch.non_tensors[MULTI_TURN]))
        metrics |= {f"val-aux/{key}": turns[key] for key in ("num_turns/mean", "tool/call_rate")}
    return metrics


# ---------------------------------------------------------------------------------------------- batch shaping
def informative_groups(batch: Batch, metric: str) -> list[int]:
    """Rows of the groups (same uid) whose ``metric`` is not the same for every sample: DAPO dynamic sampling keeps
    only those, since a group with one value gives every sample a zero advantage. ``metric`` as in verl: ``reward``
    (verl 0.9's name for the summed score before any KL penalty; earlier verl called it ``seq_reward`` and
    ``seq_final_reward``, also accepted: the KL penalty is never in the reward when filtering, see check_config), or a
    per-sample value the scorer returned (``acc``)."""
    if metric in ("reward", "seq_reward", "seq_final_reward"):
        values = batch.tensors[TOKEN_LEVEL_SCORES].sum(-1).tolist()
    elif metric in batch.non_tensors:
        values = list(batch.non_tensors[metric])
    else:
        raise KeyError(
            f"algorithm.filter_groups.metric={metric!r}: the reward function reported no per-sample {metric!r}; use "
            f"seq_reward or seq_final_reward, or return {{'score': ..., '{metric}': ...}} from compute_score"
        )
    by_uid: dict[str, list[int]] = {}
    for row, uid in enumerate(batch.non_tensors[UID]):
        by_uid.setdefault(uid, []).append(row)
    return [row for rows in by_uid.values() if len({values[r] for r in rows}) > 1 for row in rows]


def balanced_order(lengths: list[int], world_size: int) -> list[int]:
    """A permutation giving each of ``world_size`` equal, contiguous shards a similar token count (``balance_batch``):
    longest sequences first, each to the shard with the fewest tokens that still has room."""
    per_shard = len(lengths) // world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    totals = [0] * world_size
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        open_shards = [s for s in range(world_size) if len(shards[s]) < per_shard] or list(range(world_size))
        target = min(open_shards, key=lambda s: totals[s])
        shards[target].append(row)
        totals[target] += lengths[row]
    return [row for shard in shards for row in sorted(shard)]


def resolved_total_steps(config: Any, batches_per_epoch: int) -> int:
    """The step count training runs: ``trainer.total_training_steps`` or ``trainer.total_epochs`` passes over the
    data, whichever ends first (as verl; null steps = epochs only)."""
    by_epochs = config.trainer.total_epochs * batches_per_epoch
    steps = config.trainer.total_training_steps
    return by_epochs if steps is None else min(steps, by_epochs)
