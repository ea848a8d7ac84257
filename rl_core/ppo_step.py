"""One PPO step as plain function calls on in-process workers: the seed's stages in order.

This is the reference the Prefect flow mirrors stage by stage (one task per stage, on Ray workers); it also
serves single-process runs, tests and the overhead benchmark. Stage skipping follows verl: the critic runs only
when the estimator needs values (gae) or ``critic.enable``; the reference policy only with KL in the reward or a
KL loss.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rl_core.algos.advantage import call_adv_estimator
from rl_core.algos.config_access import config_get
from rl_core.algos.kl import apply_kl_penalty
from rl_core.batch import Batch
from rl_core.metrics import compute_data_metrics
from rl_core.reward.manager import RewardResult


def use_critic(config: Any) -> bool:
    enable = config_get(config_get(config, "critic"), "enable")
    return bool(enable) if enable is not None else config_get(config_get(config, "algorithm"), "adv_estimator") == "gae"


def use_reference(config: Any) -> bool:
    return bool(config_get(config_get(config, "algorithm"), "use_kl_in_reward", False)) or bool(
        config_get(config_get(config_get(config, "actor_rollout_ref"), "actor"), "use_kl_loss", False))


def add_reward(batch: Batch, result: RewardResult) -> None:
    """Store the reward manager's output in the batch (``token_level_scores`` + per-sample extra info)."""
    batch.tensors["token_level_scores"] = result.token_level_scores
    for key, values in result.extra_info.items():
        batch.non_tensors[key] = values


def compute_advantage(batch: Batch, config: Any, kl_controller: Any) -> dict[str, float]:
    """KL-in-reward (optional) then the configured estimator; writes token_level_rewards, advantages, returns."""
    algorithm = config_get(config, "algorithm")
    metrics: dict[str, float] = {}
    if config_get(algorithm, "use_kl_in_reward", False):
        rewards, metrics = apply_kl_penalty(batch.tensors["token_level_scores"], batch.tensors["old_log_probs"], batch.tensors["ref_log_prob"],
                                            batch.tensors["response_mask"], kl_controller, config_get(algorithm, "kl_penalty", "kl"))
    else:
        rewards = batch.tensors["token_level_scores"]
    batch.tensors["token_level_rewards"] = rewards
    available = {"token_level_rewards": rewards, "response_mask": batch.tensors["response_mask"].float(), "config": algorithm,
                 "index": batch.non_tensors["uid"], "gamma": config_get(algorithm, "gamma", 1.0), "lam": config_get(algorithm, "lam", 1.0),
                 "norm_adv_by_std_in_grpo": config_get(algorithm, "norm_adv_by_std_in_grpo", True)}
    for optional in ("values", "reward_baselines"):
        if optional in batch.tensors:
            available[optional] = batch.tensors[optional]
    advantages, returns = call_adv_estimator(config_get(algorithm, "adv_estimator"), **available)
    batch.tensors["advantages"], batch.tensors["returns"] = advantages, returns
    return metrics


def merge_stage(batch: Batch, output: Batch, metrics: dict[str, float]) -> Batch:
    """Add a stage's output tensors to the batch and its ``meta_info['metrics']`` to ``metrics``."""
    metrics.update(output.meta_info.pop("metrics", {}))
    if output.tensors or output.non_tensors:
        batch.union(Batch(output.tensors, output.non_tensors))
    return batch


def run_ppo_step(prompts: Batch, actor: Any, critic: Any | None, reward_fn: Callable[[Batch], RewardResult], config: Any,
                 kl_controller: Any, global_step: int) -> tuple[Batch, dict[str, float]]:
    """Stages 1-8 on ``prompts``; returns the finished batch and the step's metrics (verl's names)."""
    metrics: dict[str, float] = {}
    timing: dict[str, float] = {}

    def timed(stage: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = fn()
        timing[f"timing_s/{stage}"] = time.perf_counter() - start
        return result

    prompts.meta_info["global_step"] = global_step
    batch = timed("gen", lambda: actor.generate_sequences(prompts))                                  # 1. rollout
    timed("reward", lambda: add_reward(batch, reward_fn(batch)))                                     # 2. reward
    merge_stage(batch, timed("old_log_prob", lambda: actor.compute_log_prob(batch)), metrics)         # 3. old log-prob
    if use_reference(config):
        merge_stage(batch, timed("ref", lambda: actor.compute_ref_log_prob(batch)), metrics)          # 4. ref log-prob
    if use_critic(config):
        merge_stage(batch, timed("values", lambda: critic.compute_values(batch)), metrics)            # 5. values
    metrics.update(timed("adv", lambda: compute_advantage(batch, config, kl_controller)))            # 6. advantage
    if use_critic(config):
        merge_stage(batch, timed("update_critic", lambda: critic.update_critic(batch)), metrics)      # 7. critic update
    if global_step >= int(config_get(config_get(config, "trainer"), "critic_warmup", 0)):
        merge_stage(batch, timed("update_actor", lambda: actor.update_actor(batch)), metrics)         # 8. actor update
    return batch, {**metrics, **compute_data_metrics(batch), **timing}


def informative_groups(batch: Batch, metric: str = "seq_reward") -> list[int]:
    """Rows of the groups (same uid) whose sequence scores are not all equal: DAPO dynamic sampling keeps only
    those, since a group with one score gives every sample a zero advantage. ``metric``: ``seq_reward`` (the
    score) or ``seq_final_reward`` (after KL in the reward)."""
    key = "token_level_rewards" if metric == "seq_final_reward" and "token_level_rewards" in batch else "token_level_scores"
    scores = batch.tensors[key].sum(-1).tolist()
    by_uid: dict[str, list[int]] = {}
    for row, uid in enumerate(batch.non_tensors["uid"]):
        by_uid.setdefault(uid, []).append(row)
    return [row for rows in by_uid.values() if len({scores[r] for r in rows}) > 1 for row in rows]


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
