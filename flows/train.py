"""The PPO training flow: Prefect is the single controller, Ray workers do the work, MLflow records it.

One flow run = one training run. Per step, one Prefect task per stage (see flows/stages.py), in the seed's
order: generate -> reward -> old_log_prob -> ref_log_prob -> values -> advantage -> update_critic ->
update_actor; then validation, metrics (one MLflow call) and the checkpoint. Stages are skipped as in verl.

Recovery: the unit of resumption is the step checkpoint. ``trainer.resume_mode=auto`` continues from the
latest one in the same MLflow run; a dead worker makes the flow rebuild the worker group and re-run from the
latest checkpoint (at most ``trainer.max_worker_restarts`` times); a flow retry re-enters through the same
resume path and reattaches to the run's workers when they are alive.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from prefect import flow, runtime
from prefect.context import FlowRunContext

from flows import stages
from flows.config import compose_config
from flows.demo import apply_embedded_defaults
from flows.tracking import RunTracker, tracking_uri
from flows.workers import build_workers, reattach_workers
from infra.cluster import connect
from infra.worker_group import WorkerDiedError, WorkerGroup
from rl_core.algos.kl import get_kl_controller
from rl_core.batch import Batch
from rl_core.data.dataset import RLDataset
from rl_core.data.sampler import ResumableSampler
from rl_core.metrics import compute_data_metrics, validation_metrics
from rl_core.models.loading import load_tokenizer
from rl_core.ppo_step import balanced_order, informative_groups, use_critic, use_reference
from rl_core.reward.custom import load_custom_reward_function
from rl_core.reward.manager import RewardManager, build_reward_manager
from rl_core.step_checkpoint import CheckpointError, StepCheckpoints


@dataclass
class Progress:
    """What a step checkpoint restores besides the weights."""

    global_step: int
    sampler: ResumableSampler
    kl_controller: Any

    def state(self, run_id: str) -> dict[str, Any]:
        return {"global_step": self.global_step, "sampler": self.sampler.state_dict(),
                "kl_controller": self.kl_controller.state_dict(), "mlflow_run_id": run_id}


def every(step: int, freq: int, last: int) -> bool:
    """Due at multiples of ``freq`` and at the last step; never when ``freq`` <= 0."""
    return freq > 0 and (step % freq == 0 or step == last)


def resume_folder(config: DictConfig, checkpoints: StepCheckpoints) -> Path | None:
    mode = config.trainer.resume_mode
    if mode == "disable":
        return None
    if mode == "resume_path":
        if not config.trainer.resume_from_path:
            raise CheckpointError("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N folder)")
        folder = Path(config.trainer.resume_from_path)
        checkpoints.check_complete(folder)
        return folder
    if mode != "auto":
        raise ValueError(f"trainer.resume_mode={mode!r}; choose auto, disable or resume_path")
    step = checkpoints.latest_step()
    return None if step is None else checkpoints.step_dir(step)


# ---------------------------------------------------------------------------------------------- one step
def run_step(config: DictConfig, workers: WorkerGroup, train_data: RLDataset, reward_manager: RewardManager,
             progress: Progress, step: int) -> tuple[Batch, dict[str, float]]:
    """Stages 1-8 of step ``step`` (with DAPO's dynamic sampling when enabled); returns (batch, metrics)."""
    timeout, n = config.trainer.worker_timeout_s, config.actor_rollout_ref.rollout.n
    retrying = {"retries": config.trainer.stage_retries, "retry_delay_seconds": 1}
    metrics: dict[str, float] = {}
    timing: dict[str, float] = {}

    def timed(name: str, call):
        start = time.perf_counter()
        result = call()
        timing[f"timing_s/{name}"] = timing.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start
        return result

    # Stages 1-2: rollout and reward (repeated for dynamic sampling until enough informative groups)
    filter_groups = config.algorithm.filter_groups
    kept: list[Batch] = []
    gen_batches = 0
    while True:
        prompts = train_data.collate(progress.sampler.next_batch(), uid_prefix=f"{step}-{gen_batches}-")
        prompts.meta_info["global_step"] = step * 1000 + gen_batches  # seeds sampling: a re-run step draws the same
        gen_batches += 1
        batch = timed("gen", lambda: stages.generate.with_options(**retrying)(workers, prompts, timeout))
        metrics.update(timed("reward", lambda: stages.reward(workers, batch, reward_manager, timeout)))
        if not filter_groups.enable:
            kept = [batch]
            break
        kept.append(batch[informative_groups(batch, filter_groups.metric)])
        if sum(len(b) for b in kept) >= config.data.train_batch_size * n:
            break
        if 0 < filter_groups.max_num_gen_batches <= gen_batches:
            raise RuntimeError(f"dynamic sampling found fewer than {config.data.train_batch_size} prompts with differing scores in "
                               f"{gen_batches} generation batches; raise algorithm.filter_groups.max_num_gen_batches "
                               f"or check the data (are all responses scored alike?)")
    batch = Batch.concat(kept)[: config.data.train_batch_size * n] if filter_groups.enable else kept[0]
    if filter_groups.enable:
        metrics["train/num_gen_batches"] = float(gen_batches)
    if config.trainer.balance_batch and workers.world_size > 1:
        batch = batch[balanced_order(batch.tensors["attention_mask"].sum(-1).tolist(), workers.world_size)]

    # Stages 3-5: log-probs of the current and reference policies, values
    timed("old_log_prob", lambda: stages.old_log_prob.with_options(**retrying)(workers, batch, metrics, timeout))
    if use_reference(config):
        timed("ref", lambda: stages.ref_log_prob.with_options(**retrying)(workers, batch, metrics, timeout))
    if use_critic(config):
        timed("values", lambda: stages.values.with_options(**retrying)(workers, batch, metrics, timeout))

    # Stage 6: advantage (cheap maths, in the flow process)
    metrics.update(timed("adv", lambda: stages.advantage(batch, config, progress.kl_controller)))

    # Stages 7-8: critic and actor updates
    if use_critic(config):
        timed("update_critic", lambda: stages.update_critic(workers, batch, metrics, timeout))
    if step >= config.trainer.critic_warmup:
        timed("update_actor", lambda: stages.update_actor(workers, batch, metrics, timeout))
    return batch, {**metrics, **compute_data_metrics(batch), **timing}


def validate(config: DictConfig, workers: WorkerGroup, val_data: RLDataset, reward_manager: RewardManager) -> dict[str, float]:
    """Greedy (``val_kwargs``) rollouts on the validation set, scored: ``val-core/<data_source>/acc/mean@n``, pass@k."""
    size = config.data.val_batch_size or len(val_data)
    batches = []
    for start in range(0, len(val_data), size):
        prompts = val_data.collate(list(range(start, min(start + size, len(val_data)))), uid_prefix="val-")
        prompts.meta_info.update(validate=True, global_step=0)
        batch = workers.role("actor_rollout_ref").generate_sequences(prompts, timeout_s=config.trainer.worker_timeout_s, stage="validate")
        batch.tensors["token_level_scores"] = reward_manager(batch).token_level_scores
        batches.append(batch)
    batch = Batch.concat(batches)
    scores = batch.tensors["token_level_scores"].sum(-1).tolist()
    return validation_metrics(list(batch.non_tensors["data_source"]), list(batch.non_tensors["uid"]), scores,
                              config.actor_rollout_ref.rollout.val_kwargs.n)


def samples_table(batch: Batch, tokenizer: Any, count: int) -> dict[str, list]:
    rows = list(range(0, len(batch), max(1, len(batch) // count)))[:count]
    lengths = batch.tensors["response_mask"].sum(-1)
    return {
        "prompt": [tokenizer.decode(batch.tensors["prompts"][r][batch.tensors["attention_mask"][r, : batch.tensors["prompts"].shape[1]].bool()], skip_special_tokens=False) for r in rows],
        "response": [tokenizer.decode(batch.tensors["responses"][r, : lengths[r]], skip_special_tokens=False) for r in rows],
        "score": [float(batch.tensors["token_level_scores"][r].sum()) for r in rows],
        "advantage": [float(batch.tensors["advantages"][r, 0]) for r in rows],
    }


def save_checkpoint(workers: WorkerGroup, checkpoints: StepCheckpoints, progress: Progress, tracker: RunTracker, timeout: float) -> Path:
    staging = checkpoints.staging_dir(progress.global_step)
    workers.role("actor_rollout_ref").save_checkpoint(str(staging / "actor"), timeout_s=timeout, stage="save_checkpoint")
    if "critic" in workers.roles:
        workers.role("critic").save_checkpoint(str(staging / "critic"), timeout_s=timeout, stage="save_checkpoint")
    folder = checkpoints.commit(progress.global_step, progress.state(tracker.run_id))
    tracker.set_tags({"checkpoint/latest": folder.resolve(), f"checkpoint/global_step_{progress.global_step}": folder.resolve()})
    return folder


def restore(workers: WorkerGroup, folder: Path, progress: Progress, checkpoints: StepCheckpoints, timeout: float) -> None:
    """Weights, optimizers, data position and KL controller from the step checkpoint ``folder``."""
    state = checkpoints.trainer_state(folder)
    workers.role("actor_rollout_ref").load_checkpoint(str(folder / "actor"), timeout_s=timeout, stage="load_checkpoint")
    if "critic" in workers.roles:
        workers.role("critic").load_checkpoint(str(folder / "critic"), timeout_s=timeout, stage="load_checkpoint")
    progress.global_step = int(state["global_step"])
    progress.sampler.load_state_dict(state["sampler"])
    progress.kl_controller.load_state_dict(state["kl_controller"])


def console_line(step: int, total: int, metrics: dict[str, float], seconds: float) -> str:
    kl = metrics.get("actor/kl_loss", metrics.get("actor/reward_kl_penalty", 0.0))
    line = (f"step {step}/{total} | score {metrics.get('critic/score/mean', 0):.3f} | kl {kl:.4f} | "
            f"entropy {metrics.get('actor/entropy', 0):.3f} | response_len {metrics.get('response_length/mean', 0):.1f} | {seconds:.1f}s")
    val = [f"{k[len('val-core/'):k.rindex('/acc/')]} {v:.3f}" for k, v in metrics.items() if k.startswith("val-core/") and "/mean@" in k]
    return line + (" | val " + ", ".join(val) if val else "")


# ---------------------------------------------------------------------------------------------- the flow
def run_training(config: DictConfig) -> dict[str, Any]:
    """Everything the flow does after composing the config (callable without Prefect's decorator for tests)."""
    # --- set-up: assets, data, reward, checkpoints, tracking, Ray, workers
    apply_embedded_defaults(config)
    total = config.trainer.total_training_steps
    config.actor_rollout_ref.actor.optim.total_training_steps = total
    config.critic.optim.total_training_steps = total
    model_config = config.actor_rollout_ref.model
    tokenizer = load_tokenizer(model_config.tokenizer_path or model_config.path, model_config.trust_remote_code)
    train_data = RLDataset(config.data.train_files, tokenizer, config.data, config.data.train_max_samples)
    val_data = RLDataset(config.data.val_files, tokenizer, config.data, config.data.val_max_samples)
    reward_manager = build_reward_manager(config, tokenizer, load_custom_reward_function(config.custom_reward_function.path, config.custom_reward_function.name))
    checkpoints = StepCheckpoints(config.trainer.default_local_dir, config.trainer.max_ckpt_to_keep)
    folder = resume_folder(config, checkpoints)
    tracker = RunTracker(config, run_id=checkpoints.trainer_state(folder)["mlflow_run_id"] if folder else None)
    connect(config.trainer.ray.address, num_cpus=config.trainer.ray.num_cpus)
    namespace = f"ppoflow-{runtime.flow_run.id or tracker.run_id}"
    timeout = config.trainer.worker_timeout_s

    def fresh_progress() -> Progress:
        return Progress(0, ResumableSampler(len(train_data), config.data.train_batch_size, config.data.shuffle, config.data.seed),
                        get_kl_controller(config.algorithm.kl_ctrl))

    workers = reattach_workers(config, namespace) if folder else None
    if workers is None:
        workers = build_workers(config, namespace)
    progress = fresh_progress()
    if folder:
        restore(workers, folder, progress, checkpoints, timeout)
        print(f"resumed from {folder} (step {progress.global_step}), MLflow run {tracker.run_id}")
    restarts, succeeded = 0, False
    try:
        if config.trainer.val_before_train and progress.global_step == 0 and config.trainer.test_freq > 0:
            start_metrics = validate(config, workers, val_data, reward_manager)
            tracker.log_step(0, start_metrics)
            print(console_line(0, total, start_metrics, 0.0))
        val_metrics: dict[str, float] = {}
        # --- the training loop
        while progress.global_step < total:
            step = progress.global_step + 1
            started = time.perf_counter()
            try:
                batch, metrics = run_step(config, workers, train_data, reward_manager, progress, step)
                if every(step, config.trainer.test_freq, total):
                    val_metrics = validate(config, workers, val_data, reward_manager)
                    metrics.update(val_metrics)
                seconds = time.perf_counter() - started
                tokens = float(batch.tensors["attention_mask"].sum())
                metrics.update({"perf/time_per_step": seconds, "perf/total_num_tokens": tokens,
                                "perf/throughput": tokens / seconds / workers.world_size, "training/epoch": float(progress.sampler.epoch)})
                progress.global_step = step
                if tracker.log_step(step, metrics) and every(step, config.trainer.log_samples_freq, total):
                    tracker.log_samples(step, samples_table(batch, tokenizer, config.trainer.num_logged_samples))
                if every(step, config.trainer.save_freq, total):
                    save_checkpoint(workers, checkpoints, progress, tracker, timeout)
                print(console_line(step, total, metrics, seconds))
            except WorkerDiedError as error:
                if restarts >= config.trainer.max_worker_restarts:
                    raise
                restarts += 1
                print(f"{error} -> rebuilding the worker group (restart {restarts}/{config.trainer.max_worker_restarts})")
                tracker.set_tags({"ppoflow.worker_restarts": restarts})
                workers.kill()
                workers = build_workers(config, namespace)
                progress = fresh_progress()
                latest = checkpoints.latest_step()
                if latest is not None:
                    restore(workers, checkpoints.step_dir(latest), progress, checkpoints, timeout)

        # --- the final policy: the last checkpoint's actor as an HF-format MLflow model
        latest = checkpoints.latest_step()
        if latest != total:
            save_checkpoint(workers, checkpoints, progress, tracker, timeout)
        final_dir = checkpoints.step_dir(total)
        tracker.log_final_model(final_dir / "actor", config.trainer.register_model_name)
        tracker.finish()
        succeeded = True
        result = {"tracking_uri": tracking_uri(config), "run_id": tracker.run_id, "step": progress.global_step,
                  "checkpoint_dir": str(final_dir.resolve()), "val_metrics": val_metrics}
        return result
    finally:
        context = FlowRunContext.get()
        retries_left = context is not None and (runtime.flow_run.run_count or 1) <= (context.flow.retries or 0)
        if succeeded or not retries_left:
            workers.kill()
        if not succeeded:
            tracker.finish("FAILED")


@flow(name="ppoflow-train")
def train(overrides: list[str] | None = None) -> dict[str, Any]:
    """Train with the Hydra ``overrides`` (e.g. ``["algorithm.adv_estimator=gae"]``); returns the run summary."""
    config = compose_config(overrides)  # a wrong key or type fails here, before any worker starts
    print(f"ppoflow: {config.algorithm.adv_estimator} on {config.actor_rollout_ref.model.path or 'the embedded tiny model'}, "
          f"{config.trainer.total_training_steps} steps")
    return run_training(config)


def summary_line(result: dict[str, Any]) -> str:
    return json.dumps(result, default=str)
