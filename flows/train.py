"""The PPO training flow: Prefect is the single controller, Ray workers do the work, MLflow records it.

One flow run = one training run. Each step is :func:`rl_core.ppo_step.run_ppo_step` with one Prefect task per
stage (flows/stages.py): generate -> reward -> old_log_prob -> ref_log_prob -> values -> advantage ->
update_critic -> update_actor; then validation, metrics (one MLflow call) and the checkpoint.

Recovery: the unit of resumption is the step checkpoint. ``trainer.resume_mode=auto`` continues from the
latest one in the same MLflow run; a dead or timed-out worker makes the flow rebuild the worker group and re-run
from the latest checkpoint (at most ``trainer.max_worker_restarts`` times). The workers live in a Ray namespace
named after the MLflow run, so the next controller of the same run — a flow retry, or the controller started again
after a crash — reattaches to them when they are alive, and reloads their weights from the checkpoint only when
they moved past it.
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
from prefect.exceptions import TerminationSignal
from prefect.states import Failed

from flows.config import compose_config
from flows.demo import apply_embedded_defaults
from flows.parameters import TrainSettings
from flows.prefect_view import PrefectRunView, mlflow_run_url, one_line
from flows.secrets import secret_overrides
from flows.stages import prefect_stage_runner
from flows.tracking import RunTracker, mark_killed, tracking_uri
from flows.workers import build_workers, reattach_workers, run_namespace, step_workers, weights_at
from infra.cluster import connect, is_persistent
from infra.worker_group import WorkerDiedError, WorkerGroup, WorkerTimeoutError
from rl_core.algos.kl import get_kl_controller
from rl_core.batch import Batch
from rl_core.batch_fields import (
    ADVANTAGES,
    ATTENTION_MASK,
    OLD_LOG_PROBS,
    PROMPTS,
    REF_LOG_PROB,
    RESPONSE_MASK,
    RESPONSES,
    TOKEN_LEVEL_SCORES,
)
from rl_core.data.dataset import RLDataset
from rl_core.data.sampler import ResumableSampler
from rl_core.input_checks import check_run_inputs
from rl_core.models.loading import load_policy_tokenizer
from rl_core.ppo_step import resolved_total_steps, run_ppo_step, run_validation
from rl_core.reward.custom import load_custom_reward_function
from rl_core.reward.manager import build_reward_manager
from rl_core.step_checkpoint import CheckpointError, StepCheckpoints


@dataclass
class Progress:
    """What a step checkpoint restores besides the weights."""

    global_step: int
    sampler: ResumableSampler
    kl_controller: Any

    def state(self, run_id: str, worker_steps: dict[str, int]) -> dict[str, Any]:
        """``worker_steps``: each role's update count at the checkpoint (a reattached worker still there needs no
        reload)."""
        return {
            "global_step": self.global_step,
            "sampler": self.sampler.state_dict(),
            "kl_controller": self.kl_controller.state_dict(),
            "mlflow_run_id": run_id,
            "worker_steps": worker_steps,
        }


def every(step: int, freq: int, last: int) -> bool:
    """Due at multiples of ``freq`` and at the last step; never when ``freq`` <= 0."""
    return freq > 0 and (step % freq == 0 or step == last)


def resume_folder(config: DictConfig, checkpoints: StepCheckpoints, log=print) -> Path | None:
    """The checkpoint to resume from: the named one (checked intact), or the latest intact one (a damaged latest
    checkpoint is reported and skipped), or None."""
    mode = config.trainer.resume_mode
    if mode == "disable":
        earlier = checkpoints.steps()
        if earlier:
            runs = sorted({str(checkpoints.run_of(step)) for step in earlier})
            log(
                f"trainer.resume_mode=disable: {checkpoints.root} holds checkpoints of MLflow run(s) {', '.join(runs)} "
                f"(steps {earlier[0]}-{earlier[-1]}); this run's global_step_N folders replace theirs of the same "
                "step, the others stay (a run prunes only its own); another trainer.default_local_dir keeps the runs "
                "apart"
            )
        return None
    if mode == "resume_path":
        if not config.trainer.resume_from_path:
            raise CheckpointError(
                "trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N folder)"
            )
        folder = Path(config.trainer.resume_from_path)
        checkpoints.check_intact(folder)
        return folder
    step, damaged = checkpoints.latest_intact()
    for bad_step, problem in damaged:
        log(f"checkpoint {checkpoints.step_dir(bad_step)} is damaged ({problem}): skipped")
    return None if step is None else checkpoints.step_dir(step)


def samples_table(batch: Batch, tokenizer: Any, count: int) -> dict[str, list]:
    """``count`` rollout samples spread over the batch: prompt, response, score, advantage, and per response token its
    text, advantage and (with a reference policy) KL estimate ``old_log_prob - ref_log_prob`` (the inspector colours
    tokens by them)."""
    rows = list(range(0, len(batch), max(1, len(batch) // count)))[:count]
    tensors = batch.tensors
    lengths = tensors[RESPONSE_MASK].sum(-1).tolist()
    prompt_width = tensors[PROMPTS].shape[1]
    table = {
        "prompt": [
            tokenizer.decode(
                tensors[PROMPTS][r][tensors[ATTENTION_MASK][r, :prompt_width].bool()], skip_special_tokens=False
            )
            for r in rows
        ],
        "response": [tokenizer.decode(tensors[RESPONSES][r, : lengths[r]], skip_special_tokens=False) for r in rows],
        "score": [float(tensors[TOKEN_LEVEL_SCORES][r].sum()) for r in rows],
        "advantage": [float(tensors[ADVANTAGES][r, 0]) for r in rows],
        "response_tokens": [
            [tokenizer.decode([token]) for token in tensors[RESPONSES][r, : lengths[r]].tolist()] for r in rows
        ],
        "token_advantages": [tensors[ADVANTAGES][r, : lengths[r]].tolist() for r in rows],
    }
    if REF_LOG_PROB in tensors and OLD_LOG_PROBS in tensors:
        kl = tensors[OLD_LOG_PROBS] - tensors[REF_LOG_PROB]
        table["token_kl"] = [kl[r, : lengths[r]].tolist() for r in rows]
    return table


def save_checkpoint(
    workers: WorkerGroup, checkpoints: StepCheckpoints, progress: Progress, tracker: RunTracker, timeout: float
) -> Path:
    staging = checkpoints.staging_dir(progress.global_step)
    workers.role("actor_rollout_ref").save_checkpoint(
        str(staging / "actor"), timeout_s=timeout, stage="save_checkpoint"
    )
    if "critic" in workers.roles:
        workers.role("critic").save_checkpoint(str(staging / "critic"), timeout_s=timeout, stage="save_checkpoint")
    worker_steps = workers.health(timeout)[0]["steps_trained"]
    tracker.flush()  # every step the checkpoint holds is in MLflow before the checkpoint exists
    folder = checkpoints.commit(progress.global_step, progress.state(tracker.run_id, worker_steps))
    tracker.set_tags(
        {"checkpoint/latest": folder.resolve(), f"checkpoint/global_step_{progress.global_step}": folder.resolve()}
    )
    return folder


def restore(
    workers: WorkerGroup,
    folder: Path,
    progress: Progress,
    checkpoints: StepCheckpoints,
    timeout: float,
    load_weights: bool = True,
) -> None:
    """Data position and KL controller from the step checkpoint ``folder``, and (``load_weights``) the workers' weights,
    optimizers and RNG."""
    state = checkpoints.trainer_state(folder)
    if load_weights:
        workers.role("actor_rollout_ref").load_checkpoint(
            str(folder / "actor"), timeout_s=timeout, stage="load_checkpoint"
        )
        if "critic" in workers.roles:
            workers.role("critic").load_checkpoint(str(folder / "critic"), timeout_s=timeout, stage="load_checkpoint")
    progress.global_step = int(state["global_step"])
    progress.sampler.load_state_dict(state["sampler"])
    progress.kl_controller.load_state_dict(state["kl_controller"])


def validation_summary(metrics: dict[str, float]) -> str:
    """``<data source> <mean@n>, ...`` of the validation metrics among ``metrics`` ('' when there are none)."""
    return ", ".join(
        f"{k[len('val-core/') : k.rindex('/acc/')]} {v:.3f}"
        for k, v in metrics.items()
        if k.startswith("val-core/") and "/mean@" in k
    )


def console_line(step: int, total: int, metrics: dict[str, float], seconds: float) -> str:
    kl = metrics.get("actor/kl_loss", metrics.get("actor/reward_kl_penalty", 0.0))
    line = (
        f"step {step}/{total} | score {metrics.get('critic/score/mean', 0):.3f} | kl {kl:.4f} | entropy "
        f"{metrics.get('actor/entropy', 0):.3f} | response_len {metrics.get('response_length/mean', 0):.1f} | "
        f"{seconds:.1f}s"
    )
    val = validation_summary(metrics)
    return line + (" | val " + val if val else "")


# ---------------------------------------------------------------------------------------------- the flow
def run_training(config: DictConfig, tags: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything the flow does after composing the config (callable without Prefect's decorator for tests);
    ``tags`` go on a new MLflow run (a sweep's child carries ``mlflow.parentRunId``)."""
    # --- set-up that cannot leave anything behind: assets, data, reward (a bad input fails here, before any run exists)
    apply_embedded_defaults(config)
    check_run_inputs(
        config, tokenize=False
    )  # every problem at once, in a second (the datasets below check each prompt)
    tokenizer = load_policy_tokenizer(config.actor_rollout_ref.model)
    train_data = RLDataset(config.data.train_files, tokenizer, config.data, config.data.train_max_samples)
    val_data = RLDataset(config.data.val_files, tokenizer, config.data, config.data.val_max_samples)
    reward_manager = build_reward_manager(
        config, tokenizer, load_custom_reward_function(**config.custom_reward_function)
    )

    def fresh_progress() -> Progress:
        return Progress(
            0,
            ResumableSampler(len(train_data), config.data.train_batch_size, config.data.shuffle, config.data.seed),
            get_kl_controller(config.algorithm.kl_ctrl),
        )

    progress = fresh_progress()
    total = resolved_total_steps(config, progress.sampler.batches_per_epoch)
    config.actor_rollout_ref.actor.optim.total_training_steps = total
    config.critic.optim.total_training_steps = total
    checkpoints = StepCheckpoints(config.trainer.default_local_dir, config.trainer.max_ckpt_to_keep)
    view = PrefectRunView(config.trainer.prefect_history_steps)
    with checkpoints.locked(
        {"run": config.trainer.experiment_name}
    ) as folder_lock:  # one run at a time in a checkpoint folder
        folder = resume_folder(config, checkpoints, view.log)
        resumed_state = checkpoints.trainer_state(folder) if folder else None
        if resumed_state is not None and resumed_state["global_step"] > total:
            raise CheckpointError(
                f"{folder} is at step {resumed_state['global_step']}, past this run's {total} steps "
                "(trainer.total_training_steps / total_epochs): raise them to continue, or set "
                "trainer.resume_mode=disable (or another trainer.default_local_dir) to start over"
            )

        # --- from here on the MLflow run exists: any failure marks it FAILED and frees what this run started
        tracker = RunTracker(config, run_id=resumed_state["mlflow_run_id"] if resumed_state else None, tags=tags)
        folder_lock.describe(mlflow_run_id=tracker.run_id, tracking_uri=tracker.uri)
        if folder_lock.previous:
            report_killed_controller(folder_lock.previous, tracker.run_id, checkpoints.root, view.log)
        timeout = config.trainer.worker_timeout_s
        run_stage = prefect_stage_runner(config.trainer.stage_retries)
        workers: WorkerGroup | None = None
        restarts = 0
        try:
            if (
                runtime.flow_run.id
            ):  # the inspector links the MLflow run to its Prefect flow run, and the flow run to it
                tracker.set_tags({"ppoflow.prefect_flow_run_id": runtime.flow_run.id})
            view.link_run(
                mlflow_run_url(tracker.uri, tracker.experiment_id, tracker.run_id),
                tracker.run_id,
                config.trainer.default_local_dir,
            )
            connect(config.trainer.ray.address, num_cpus=config.trainer.ray.num_cpus)
            namespace = run_namespace(
                tracker.run_id
            )  # keyed by the training run: the next controller of this run finds them
            workers = reattach_workers(config, namespace) if folder else None
            reuse_weights = workers is not None and weights_at(workers, resumed_state, timeout)
            if workers is not None:
                view.log(
                    f"reattached to the run's {workers.world_size} live worker(s): "
                    + (
                        "their weights are the checkpoint's, nothing to reload"
                        if reuse_weights
                        else "reloading their weights from the checkpoint"
                    )
                )
            else:
                workers = build_workers(config, namespace, log=view.log)
            tracker.set_tags({"ppoflow.worker_pids": ",".join(str(r["pid"]) for r in workers.health(timeout))})
            stage_workers = step_workers(workers, timeout, config.reward.timeout_s)
            if folder:
                restore(workers, folder, progress, checkpoints, timeout, load_weights=not reuse_weights)
                tracker.mark_running()
                view.log(f"resumed from {folder} (step {progress.global_step}), MLflow run {tracker.run_id}")
            if config.trainer.val_before_train and progress.global_step == 0 and config.trainer.test_freq > 0:
                start_metrics = run_validation(config, stage_workers, val_data, reward_manager)
                tracker.log_step(0, start_metrics)
                view.log(console_line(0, total, start_metrics, 0.0))
            val_metrics: dict[str, float] = {}
            # --- the training loop
            while progress.global_step < total:
                step = progress.global_step + 1
                started = time.perf_counter()
                view.step_started(step)
                try:
                    batch, metrics = run_ppo_step(
                        config,
                        stage_workers,
                        train_data,
                        progress.sampler,
                        reward_manager,
                        progress.kl_controller,
                        step,
                        run_stage,
                    )
                    if every(step, config.trainer.test_freq, total):
                        val_metrics = run_validation(config, stage_workers, val_data, reward_manager)
                        metrics.update(val_metrics)
                    seconds = time.perf_counter() - started
                    tokens = float(batch.tensors[ATTENTION_MASK].sum())
                    metrics.update(
                        {
                            "perf/time_per_step": seconds,
                            "perf/total_num_tokens": tokens,
                            "perf/throughput": tokens / seconds / workers.world_size,
                            "training/epoch": float(progress.sampler.epoch),
                        }
                    )
                    progress.global_step = step
                    if tracker.log_step(step, metrics) and every(step, config.trainer.log_samples_freq, total):
                        tracker.log_samples(step, samples_table(batch, tokenizer, config.trainer.num_logged_samples))
                    if every(step, config.trainer.save_freq, total):
                        save_checkpoint(workers, checkpoints, progress, tracker, timeout)
                    view.log(console_line(step, total, metrics, seconds))
                    latest_val = validation_summary(val_metrics)
                    view.progress(
                        step,
                        total,
                        f"score {metrics.get('critic/score/mean', 0):.3f}"
                        + (f" | val {latest_val}" if latest_val else ""),
                        force=step == total or step == 1,
                    )
                except (WorkerDiedError, WorkerTimeoutError) as error:  # the group is unusable: rebuild it
                    if restarts >= config.trainer.max_worker_restarts:
                        raise
                    restarts += 1
                    view.log(
                        f"{error} -> rebuilding the worker group (restart "
                        f"{restarts}/{config.trainer.max_worker_restarts})"
                    )
                    tracker.set_tags({"ppoflow.worker_restarts": restarts})
                    workers.kill()
                    workers = build_workers(config, namespace, log=view.log)
                    tracker.set_tags({"ppoflow.worker_pids": ",".join(str(r["pid"]) for r in workers.health(timeout))})
                    stage_workers = step_workers(workers, timeout, config.reward.timeout_s)
                    progress = fresh_progress()
                    latest = checkpoints.latest_step()
                    if latest is not None:
                        restore(workers, checkpoints.step_dir(latest), progress, checkpoints, timeout)

            # --- the final policy: the last checkpoint's actor as an HF-format MLflow model
            if checkpoints.latest_step() != total:
                save_checkpoint(workers, checkpoints, progress, tracker, timeout)
            final_dir = checkpoints.step_dir(total)
            tracker.log_final_model(final_dir / "actor", config.trainer.register_model_name)
            tracker.finish()
        except BaseException as error:
            tracker.fail(error, killed=told_to_stop(error))
            if workers is not None and not keeps_workers_on_failure(config, error):
                workers.kill()
            view.close(timeout_s=5)
            raise
        workers.kill()
        view.close()
        return {
            "tracking_uri": tracking_uri(config),
            "run_id": tracker.run_id,
            "step": progress.global_step,
            "checkpoint_dir": str(final_dir.resolve()),
            "val_metrics": val_metrics,
        }


def keeps_workers_on_failure(config: DictConfig, error: BaseException | None) -> bool:
    """``trainer.keep_workers`` (unset: yes on a persistent cluster, no on the embedded one, which ends with this
    process anyway, nor after an interrupt: the user asked to stop), or a Prefect retry of this flow run is still to
    come (it reattaches to them)."""
    context = FlowRunContext.get()
    retry_pending = context is not None and (runtime.flow_run.run_count or 1) <= (context.flow.retries or 0)
    keep = config.trainer.keep_workers
    if keep is None:
        keep = is_persistent() and not told_to_stop(error)
    return bool(keep) or retry_pending


def told_to_stop(error: BaseException | None) -> bool:
    """SIGINT (KeyboardInterrupt) or SIGTERM (Prefect turns it into TerminationSignal inside a flow run; a cancelled
    deployment run gets one too): the run was stopped on purpose."""
    return isinstance(error, (KeyboardInterrupt, TerminationSignal))


def report_killed_controller(holder: dict[str, Any], run_id: str, folder: Path, log=print) -> None:
    """The checkpoint folder's lock still named ``holder``: its controller was killed before it let go. Its MLflow run
    is marked KILLED, unless it is ``run_id``, the run this controller continues."""
    killed_run = holder.get("mlflow_run_id")
    if killed_run == run_id:
        log(
            f"the previous controller of MLflow run {run_id} (pid {holder.get('pid')}, started "
            f"{holder.get('started')}) was killed; continuing the run"
        )
    elif killed_run and mark_killed(
        holder.get("tracking_uri") or "",
        killed_run,
        f"its controller (pid {holder.get('pid')}, started {holder.get('started')}) was killed; found by the next run "
        f"in {folder}",
    ):
        log(
            f"MLflow run {killed_run} in {folder} was left RUNNING by a killed controller (pid {holder.get('pid')}): "
            "marked KILLED"
        )


def training_overrides(settings: TrainSettings | None, overrides: list[str] | None) -> list[str]:
    """The Hydra overrides a run composes its config from: the form's fields, then the free list (which wins), then
    the secret ones the command line kept out of the flow run's parameters (flows/secrets.py)."""
    return (settings.to_overrides() if settings else []) + list(overrides or []) + secret_overrides()


@flow(name="ppoflow-train")
def train(
    settings: TrainSettings = TrainSettings(),  # noqa: B008 (a Prefect parameter default)
    overrides: list[str] | None = None,
    tags: dict[str, str] | None = None,
) -> Any:
    """Train with the form's ``settings`` and the Hydra ``overrides`` after them (e.g.
    ``["algorithm.adv_estimator=gae"]``;
    ``ppoflow config`` lists every key); ``tags`` go on the MLflow run. Returns the run summary.

    A failed run's state message is the cause in one line (the full traceback is in the flow run's logs)."""
    config = compose_config(
        training_overrides(settings, overrides)
    )  # a wrong key or type fails here, before any worker starts
    view = PrefectRunView()
    view.log(
        f"ppoflow: {config.algorithm.adv_estimator} on "
        f"{config.actor_rollout_ref.model.path or 'the embedded tiny model'}, "
        f"{config.trainer.total_training_steps or 'all'} steps (at most {config.trainer.total_epochs} epochs)"
    )
    try:
        return run_training(config, tags)
    except Exception as error:
        view.failure(error)
        return Failed(message=one_line(error), data=error)


def summary_line(result: dict[str, Any]) -> str:
    return json.dumps(result, default=str)
