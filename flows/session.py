"""A training run's session: everything between loading the inputs and returning the result, except the step itself.

``with TrainingSession(config, inputs) as session:`` takes the checkpoint folder (one run at a time), finds the
checkpoint to resume from (refusing a changed config, flows/resume.py), opens the MLflow run (the checkpoint's, or a
new one), connects to Ray and gets the workers: the run's live ones when a controller of the same run left them and
the config is unchanged (reattached), else a fresh group; then restores the checkpoint. Inside, the recipe calls
:meth:`step` (times it; a dead or hung worker makes it rebuild the group from the latest checkpoint, at most
``trainer.max_worker_restarts`` times), :meth:`validate`, :meth:`record` (metrics, samples, checkpoint, console line)
and :meth:`finish`. Leaving the block frees the workers (kept after a failure on a persistent cluster) and the folder;
a failure marks the MLflow run FAILED (KILLED when told to stop).

The workers live in a Ray namespace named after the checkpoint folder (the MLflow run id recorded beside it), so the
next controller of the same run — a flow retry, or the command run again after a crash — finds them, and reloads
their weights only when they moved past the checkpoint. A fresh run started by ``ppoflow train`` finds its inputs,
folder lock and workers made already, while Prefect's server booted (flows/prestart.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from prefect import runtime
from prefect.context import FlowRunContext
from prefect.exceptions import TerminationSignal

from flows import prestart
from flows.inputs import TrainingInputs, plan_steps
from flows.prefect_view import PrefectRunView, mlflow_run_url, prefect_ui_url
from flows.resume import (
    ResumePoint,
    already_finished,
    config_record,
    find_resume_point,
    finished_result,
    workers_config_digest,
)
from flows.stages import BackgroundRun, StageRunner, flush_reported_runs, run_phase
from flows.standby_workers import leave_standby, leaves_standby
from flows.step_report import console_line, samples_table, validation_images, validation_summary
from flows.tracking import (
    PREFECT_FLOW_RUN_TAG,
    PREFECT_UI_TAG,
    RunTracker,
    report_killed_controller,
    tracking_uri,
)
from flows.workers import (
    ROLLOUT_PREFIX,
    RUN_LABEL,
    WORKERS_NAMESPACE_TAG,
    build_fresh_workers,
    build_rollout_workers,
    has_separate_rollout,
    reattach_workers,
    step_workers,
    weight_transport,
    weights_at,
    workers_namespace,
)
from infra.cluster import connect, is_persistent
from infra.worker_group import WorkerDiedError, WorkerGroup, WorkerTimeoutError
from rl_core.algos.kl import get_kl_controller
from rl_core.batch import Batch
from rl_core.batch_fields import ATTENTION_MASK
from rl_core.data.sampler import ResumableSampler
from rl_core.ppo_step import StepWorkers, generation_on, retry_safe_stages, run_ppo_step, run_validation
from rl_core.rollout_schedule import GenerationWindow
from rl_core.separate_rollout import SeparateRollout
from rl_core.step_checkpoint import CheckpointError, FolderLock, run_checkpoints


@dataclass
class Progress:
    """What a step checkpoint restores besides the weights: the step, the data position, the KL controller."""

    global_step: int
    sampler: ResumableSampler
    kl_controller: Any

    @classmethod
    def fresh(cls, config: DictConfig, rows: int) -> Progress:
        sampler = ResumableSampler(rows, config.data.train_batch_size, config.data.shuffle, config.data.seed)
        return cls(0, sampler, get_kl_controller(config.algorithm.kl_ctrl))

    def state(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "sampler": self.sampler.state_dict(),
            "kl_controller": self.kl_controller.state_dict(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_controller.load_state_dict(state["kl_controller"])


WORKERS_CONFIG_TAG = "ppoflow.workers_config"  # the digest of the config the run's live workers were built from
CHECKPOINT_PARTS = {"actor_rollout_ref": "actor", "critic": "critic"}  # a role's folder in a step checkpoint
VALIDATION_IMAGES = 8  # a vision-language run's validation samples logged with their images, each validation


def every(step: int, freq: int, last: int) -> bool:
    """Due at multiples of ``freq`` and at the last step; never when ``freq`` <= 0."""
    return freq > 0 and (step % freq == 0 or step == last)


class TrainingSession:
    """One training run's folder lock, MLflow run, workers and progress (see the module doc)."""

    def __init__(self, config: DictConfig, inputs: TrainingInputs, tags: dict[str, str] | None = None):
        """``tags`` go on a new MLflow run (a sweep's child carries ``mlflow.parentRunId``)."""
        self.config, self.inputs, self.tags = config, inputs, tags
        self.progress = Progress.fresh(config, len(inputs.train_data))
        self.total_steps = plan_steps(config, len(inputs.train_data))
        self.checkpoints = run_checkpoints(config.trainer)
        self.view = PrefectRunView(config.trainer.prefect_history_steps)
        self.timeout = config.trainer.worker_timeout_s
        self.run_stage = StageRunner(config.trainer.stage_retries, retry_safe_stages(config))
        self.group: WorkerGroup | None = None
        self.rollout_groups: list[WorkerGroup] = []  # a rollout of its own (rollout.n_gpus_per_node > 0)
        self.workers: StepWorkers | None = None
        self.tracker: RunTracker | None = None
        self.finished_result: dict[str, Any] | None = None  # set when the run had finished already
        self.val_metrics: dict[str, float] = {}
        self.restarts = 0
        self.step_started = 0.0

    # ------------------------------------------------------------------ set-up and teardown
    def __enter__(self) -> TrainingSession:
        self.folder_lock: FolderLock = prestart.claim_lock(self.checkpoints.root) or self.checkpoints.lock(
            {"run": self.config.trainer.experiment_name}
        )
        try:
            point = find_resume_point(self.config, self.checkpoints, self.view.log)
            if point is not None and point.step > self.total_steps:
                raise CheckpointError(
                    f"{point.folder} is at step {point.step}, past this run's {self.total_steps} steps "
                    "(trainer.total_training_steps / total_epochs): raise them to continue, or set "
                    "trainer.resume_mode=disable (or another trainer.default_local_dir) to start over"
                )
            self.tracker = RunTracker(self.config, run_id=point.run_id if point else None, tags=self.tags)
        except BaseException:
            self.folder_lock.release()
            raise
        try:
            run_phase("set-up", self._start, point)  # a task run: the Prefect graph starts here, not at step 1
        except BaseException as error:
            self.__exit__(type(error), error, error.__traceback__)
            raise
        return self

    def _start(self, point: ResumePoint | None) -> None:
        tracker, config, log = self.tracker, self.config, self.view.log
        if point is not None:
            status = tracker.client.get_run(tracker.run_id).info.status
            if already_finished(point, config, status, self.total_steps):
                log(f"run {tracker.run_id} already finished at step {point.step} ({point.folder}): nothing to do")
                self.finished_result = finished_result(
                    point, tracker.uri, tracker.client.get_run(point.run_id).data.metrics
                )
                return
            if status == "FINISHED":
                log(f"run {tracker.run_id} finished at step {point.step}; continuing to step {self.total_steps}")
        self.folder_lock.describe(mlflow_run_id=tracker.run_id, tracking_uri=tracker.uri)
        if self.folder_lock.previous:
            report_killed_controller(self.folder_lock.previous, tracker.run_id, self.checkpoints.root, log)
        if runtime.flow_run.id:  # the inspector links the MLflow run to its Prefect flow run, and the flow run to it
            prefect_ui = prefect_ui_url()  # a link only where the server outlives the run
            tracker.set_tags(
                {PREFECT_FLOW_RUN_TAG: runtime.flow_run.id, **({PREFECT_UI_TAG: prefect_ui} if prefect_ui else {})}
            )
        self.view.link_run(
            mlflow_run_url(tracker.uri, tracker.experiment_id, tracker.run_id),
            tracker.uri,
            tracker.run_id,
            self.checkpoints.root,
        )
        started = time.perf_counter()
        connect(config.trainer.ray.address, num_cpus=config.trainer.ray.num_cpus)
        connected = time.perf_counter()
        reuse_weights, built_before = self._get_workers(point)
        built = (
            f"built while Prefect's server started ({built_before:.1f} s)"
            if built_before is not None
            else f"{time.perf_counter() - connected:.1f} s"
        )
        standby_note = "; started as standby workers" if self.group.adopted else ""
        log(
            f"set-up: Ray {connected - started:.1f} s (waited for), workers {built} "
            f"({self.group.world_size} rank(s): {', '.join(self.group.roles)}{standby_note})"
        )
        if point is not None:
            self._restore(point.folder, load_weights=not reuse_weights)
            if point.changes:
                tracker.log_config_change(point.step, point.changes, config)
                log(f"resumed under a changed config (trainer.resume_allow_config_change): {len(point.changes)} key(s)")
            tracker.mark_running()
            log(f"resumed from {point.folder} (step {point.step}), MLflow run {tracker.run_id}")

    def _get_workers(self, point: ResumePoint | None) -> tuple[bool, float | None]:
        """The workers: a fresh run's prestarted group (flows/prestart.py) when it was built from this config; for a
        resumed run, its live workers when the config is the checkpoint's and they were built from this config
        (``ppoflow.workers_config``); else a fresh group (what an earlier run of the folder left is killed first).
        Returns whether the workers hold the checkpoint's weights already, and the seconds a prestarted group took."""
        reuse_weights, built_before = False, None
        built_with = self.tracker.client.get_run(self.tracker.run_id).data.tags.get(WORKERS_CONFIG_TAG)
        same = point is not None and not point.changes and built_with == workers_config_digest(self.config)
        # the namespace is the folder's: the next controller of this run finds them
        self.group = reattach_workers(self.config, workers_namespace(self.config)) if same else None
        prestarted = prestart.claim_group(self.config) if point is None else None
        if self.group is not None:
            reuse_weights = weights_at(self.group, point.state, self.timeout)
            self.view.log(
                f"reattached to the run's {self.group.world_size} live worker(s): "
                + ("their weights are the checkpoint's" if reuse_weights else "reloading the checkpoint's weights")
            )
        elif prestarted is not None:
            self.group, notes, built_before = prestarted
            for note in notes:
                self.view.log(note)
            self._tag_group()
        else:
            self._build_group()
        self._use_group()
        return reuse_weights, built_before

    def _build_group(self) -> None:
        """A fresh worker group for the run, every model loaded (an earlier group in the folder's namespace ended)."""
        self.group = build_fresh_workers(self.config, log=self.view.log)
        self._tag_group()

    def _tag_group(self) -> None:
        """The run and its workers name each other: the run's tags say where the workers are and which config they
        were built from, the workers' label says which run they serve."""
        self.group.label({RUN_LABEL: self.tracker.run_id}, self.timeout)
        self.tracker.set_tags(
            {WORKERS_CONFIG_TAG: workers_config_digest(self.config), WORKERS_NAMESPACE_TAG: self.group.namespace}
        )

    def _use_group(self) -> None:
        reports = self.group.health(self.timeout)  # by rank: where the trainer's workers run
        self.tracker.set_tags(
            {
                "ppoflow.worker_pids": ",".join(str(r["pid"]) for r in reports),
                "ppoflow.worker_nodes": ",".join(r["node"] for r in reports),
            }
        )
        self.workers = step_workers(self.group, self.timeout, self.config.reward.timeout_s)
        if has_separate_rollout(self.config):  # a rollout of its own: its group beside the trainer's
            if not self.rollout_groups:
                started = time.perf_counter()
                self.rollout_groups = build_rollout_workers(self.config, self.group.namespace)
                count = len(self.rollout_groups)
                self.view.log(f"set-up: the rollout's own {count} worker(s) {time.perf_counter() - started:.1f} s")
                nodes = [node for group in self.rollout_groups for node in group.nodes.values()]  # seen at creation
                self.tracker.set_tags({"ppoflow.rollout_nodes": ",".join(nodes)})
            self.workers.separate_rollout = SeparateRollout(
                self.workers.actor,
                [group.role("actor_rollout_ref", self.timeout) for group in self.rollout_groups],
                GenerationWindow.from_config(self.config.async_training),
                generation_on(self.config, self.inputs.reward_manager),
                track=BackgroundRun,
                rendezvous=weight_transport(self.config).rendezvous,
                partial_rollout=bool(self.config.async_training.partial_rollout),
            )

    def _drop_rollout_groups(self) -> None:
        """End a rollout of its own: the generation in flight, then its workers."""
        if self.workers is not None and self.workers.separate_rollout is not None:
            self.workers.separate_rollout.close()
        for group in self.rollout_groups:
            group.kill()
        self.rollout_groups = []

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: Any) -> None:
        try:
            if error is not None and self.tracker is not None:
                self.tracker.fail(error, killed=told_to_stop(error))
            self._drop_rollout_groups()
            self._end_group(error)
            flush_reported_runs()  # the step's task runs reach Prefect before its flow run ends
            self.view.close(timeout_s=30 if error is None else 5)
        finally:
            self.folder_lock.release()

    def _end_group(self, error: BaseException | None) -> None:
        """The run's workers at its end: kept after a failure when a next controller may reattach to them
        (:func:`keeps_workers_on_failure`); on the stack, after a run that finished or was told to stop (a user's
        Ctrl-C before a changed run), ended and replaced by a standby group the next run adopts; else ended."""
        if self.group is None or (error is not None and keeps_workers_on_failure(self.config, error)):
            return
        if (error is None or told_to_stop(error)) and leaves_standby():
            self.view.log(leave_standby(self.group, self.config))
        else:
            self.group.kill()

    # ------------------------------------------------------------------ the loop's parts
    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Step ``step`` runs inside: timed, and a dead or hung worker rebuilds the worker group and rewinds to the
        latest checkpoint (the loop then runs the steps after it again); a dead rollout of its own is rebuilt alone
        and the step runs again."""
        self.view.step_started(step)
        self.run_stage.step = step  # names the step's task runs
        self.step_started = time.perf_counter()
        at_start = self.progress.state()
        try:
            yield
        except (WorkerDiedError, WorkerTimeoutError) as error:
            if self.restarts >= self.config.trainer.max_worker_restarts:
                raise
            self.restarts += 1
            self.tracker.set_tags({"ppoflow.worker_restarts": self.restarts})
            if getattr(error, "worker", "").startswith(f"{ROLLOUT_PREFIX}-"):
                # a rollout of its own is only called as a step starts (its samples, the next step's launch): the
                # trainer's weights and the step's progress are untouched, so only the rollout is rebuilt and the
                # step runs again from its start
                self.view.log(
                    f"{error} -> rebuilding the rollout's own worker, the trainer goes on; step {step} again "
                    f"(restart {self.restarts}/{self.config.trainer.max_worker_restarts})"
                )
                self._drop_rollout_groups()
                self._use_group()
                self.progress.load_state(at_start)
                return
            self.view.log(
                f"{error} -> rebuilding the worker group "
                f"(restart {self.restarts}/{self.config.trainer.max_worker_restarts})"
            )
            self._drop_rollout_groups()
            self.group.kill()
            self._build_group()
            self._use_group()
            self.progress = Progress.fresh(self.config, len(self.inputs.train_data))
            latest = self.checkpoints.latest_step()
            if latest is not None:
                self._restore(self.checkpoints.step_dir(latest))

    def ppo_step(self, step: int, run_stage: Any = None) -> tuple[Batch, dict[str, float]]:
        """Step ``step`` (:func:`rl_core.ppo_step.run_ppo_step`) on the session's workers, data, reward and KL
        controller; its stages run through ``run_stage`` (default: the session's flows.stages.StageRunner, which
        reports them as Prefect task runs)."""
        inputs, progress = self.inputs, self.progress
        return run_ppo_step(
            self.config,
            self.workers,
            inputs.train_data,
            progress.sampler,
            inputs.reward_manager,
            progress.kl_controller,
            step,
            run_stage or self.run_stage,
        )

    def validate(self) -> dict[str, float]:
        """Greedy validation on the validation set (``actor_rollout_ref.rollout.val_kwargs``), the task run
        ``step-<step>/validate``: its metrics and its seconds (verl's ``timing_s/testing``)."""
        inputs, started, step = self.inputs, time.perf_counter(), self.run_stage.step

        def log_images(batch: Batch) -> None:  # a vision-language run: a few samples with their images
            table = validation_images(batch, inputs.tokenizer, VALIDATION_IMAGES)
            if table is not None:
                self.tracker.log_validation_images(step, table)

        self.val_metrics = run_phase(
            "validate",
            functools.partial(run_validation, on_scored=log_images),
            self.config,
            self.workers,
            inputs.val_data,
            inputs.reward_manager,
            step=step,
        )
        return {**self.val_metrics, "timing_s/testing": time.perf_counter() - started}

    def validate_before_training(self) -> None:
        """Step 0's validation (``trainer.val_before_train``), for a run that starts from scratch."""
        if (
            self.config.trainer.val_before_train
            and self.progress.global_step == 0
            and self.config.trainer.test_freq > 0
        ):
            self.tracker.log_step(0, self.validate())
            self.view.log(console_line(0, self.total_steps, self.val_metrics, 0.0))

    def record(self, step: int, batch: Batch, metrics: dict[str, float]) -> None:
        """Step ``step`` is done: throughput metrics, MLflow (metrics, samples), the checkpoint when due, the console
        line and the progress artifact."""
        trainer, total = self.config.trainer, self.total_steps
        seconds = time.perf_counter() - self.step_started
        tokens = float(batch.tensors[ATTENTION_MASK].sum())
        metrics.update(
            {
                "perf/time_per_step": seconds,
                "perf/total_num_tokens": tokens,
                "perf/throughput": tokens / seconds / self.group.world_size,
                "training/epoch": float(self.progress.sampler.epoch),
            }
        )
        if "timing_s/generate_ahead" in metrics:  # a rollout of its own: how much of the step each side waited
            capacity = seconds * len(self.rollout_groups)  # the rollout workers' seconds during the step
            metrics["perf/trainer_idle_fraction"] = min(1.0, metrics["timing_s/gen"] / seconds)
            metrics["perf/rollout_idle_fraction"] = max(0.0, 1.0 - metrics["timing_s/generate_ahead"] / capacity)
        self.progress.global_step = step
        if self.tracker.log_step(step, metrics) and every(step, trainer.log_samples_freq, total):
            samples = samples_table(batch, self.inputs.tokenizer, trainer.num_logged_samples)
            self.tracker.log_samples(step, samples)
        if every(step, trainer.save_freq, total):
            self.save_checkpoint()
        self.view.log(console_line(step, total, metrics, seconds))
        latest_val = validation_summary(self.val_metrics)
        summary = f"score {metrics.get('critic/score/mean', 0):.3f}" + (f" | val {latest_val}" if latest_val else "")
        self.view.progress(step, total, summary, force=step in (1, total))

    def save_checkpoint(self) -> Path:
        """The step checkpoint of the current step (the task run ``step-<step>/save_checkpoint``)."""
        return run_phase("save_checkpoint", self._save_checkpoint, step=self.progress.global_step)

    def _save_checkpoint(self) -> Path:
        staging = self.checkpoints.staging_dir(self.progress.global_step)
        for role, part in CHECKPOINT_PARTS.items():
            if role in self.group.roles:
                self.group.role(role).save_checkpoint(
                    str(staging / part), timeout_s=self.timeout, stage="save_checkpoint"
                )
        state = {
            **self.progress.state(),
            "mlflow_run_id": self.tracker.run_id,
            "worker_steps": self.group.health(self.timeout)[0]["steps_trained"],  # a reattached group may skip a load
            "total_steps": self.total_steps,
            "config": config_record(self.config),  # a resume compares its config with this (flows/resume.py)
        }
        self.tracker.flush()  # every step the checkpoint holds is in MLflow before the checkpoint exists
        folder = self.checkpoints.commit(self.progress.global_step, state)
        address = self.checkpoints.address(self.progress.global_step)
        latest = {"checkpoint/latest": address, f"checkpoint/global_step_{self.progress.global_step}": address}
        self.tracker.set_tags(latest)
        return folder

    def _restore(self, folder: Path, load_weights: bool = True) -> None:
        """The data position and KL controller from the step checkpoint ``folder``, and (``load_weights``) the
        workers' weights, optimizers (under the config's settings) and RNG."""
        if load_weights:
            for role, part in CHECKPOINT_PARTS.items():
                if role in self.group.roles:
                    self.group.role(role).load_checkpoint(
                        str(folder / part), timeout_s=self.timeout, stage="load_checkpoint"
                    )
        self.progress.load_state(self.checkpoints.trainer_state(folder))

    def finish(self) -> None:
        """The final policy: the last step's checkpoint (written now unless it exists), its actor uploaded as the
        run's HF-format MLflow model; the run FINISHED."""
        if self.checkpoints.latest_step() != self.total_steps:
            self.save_checkpoint()
        final = self.checkpoints.step_dir(self.total_steps)
        self.tracker.log_final_model(final / "actor", self.config.trainer.register_model_name)
        self.tracker.finish()

    def result(self) -> dict[str, Any]:
        """The run's summary: what the command line prints as its last line."""
        if self.finished_result is not None:
            return self.finished_result
        return {
            "tracking_uri": tracking_uri(self.config),
            "run_id": self.tracker.run_id,
            "step": self.progress.global_step,
            "checkpoint_dir": self.checkpoints.address(self.total_steps),
            "val_metrics": self.val_metrics,
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
