"""Resuming a run: which checkpoint, whether the config still matches it, and whether the run has finished.

Every step checkpoint records the config it was trained under (resolved, secrets redacted) and the run's step count.
A resume compares that record with the new config, leaving out :data:`MAY_CHANGE_ON_RESUME` (how long and how often,
how to resume, timeouts, where the services are). Any other difference refuses the resume before anything changes,
naming the keys, unless ``trainer.resume_allow_config_change=true``: then the run continues under the new config (its
workers rebuilt, the new optimizer settings in force) and the change is recorded in its MLflow run.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from flows.config import flatten
from flows.secrets import redacted
from rl_core.step_checkpoint import CheckpointError, StepCheckpoints, run_checkpoints

# Keys (or key prefixes) a resumed run may change without trainer.resume_allow_config_change.
MAY_CHANGE_ON_RESUME = (
    # how long: more steps continue a run (the schedules follow the new step count)
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "actor_rollout_ref.actor.optim.total_training_steps",
    "critic.optim.total_training_steps",
    # how often: validation, checkpoints, samples, the registered model
    "trainer.test_freq",
    "trainer.val_before_train",
    "trainer.save_freq",
    "trainer.max_ckpt_to_keep",
    "trainer.log_samples_freq",
    "trainer.num_logged_samples",
    "trainer.register_model_name",
    # how to resume, recover and wait
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.resume_allow_config_change",
    "trainer.keep_workers",
    "trainer.max_worker_restarts",
    "trainer.stage_retries",
    "trainer.worker_timeout_s",
    "trainer.capacity_wait_s",
    "reward.timeout_s",
    # where things are: the services, the folders, the CPUs a worker gets
    "trainer.ray",
    "trainer.tracking_uri",
    "trainer.artifact_location",
    "trainer.cache_dir",
    "trainer.default_local_dir",
    "trainer.cpus_per_worker",
    "trainer.prefect_history_steps",
)
WORKER_KEYS = (
    "actor_rollout_ref.",
    "critic.",
    "reward_model.",
    "trainer.device",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "trainer.cpus_per_worker",
)
STEP_COUNT_KEYS = ("trainer.total_epochs", "trainer.total_training_steps")
MAX_LISTED_CHANGES = 12


class ResumeRefused(CheckpointError):
    """The checkpoint to resume from was trained under another config."""


def config_record(config: DictConfig) -> dict[str, Any]:
    """The resolved config as flat ``{key: value}``, secrets redacted: what a checkpoint records (JSON-safe)."""
    return json.loads(json.dumps(flatten(redacted(config)), default=str))


def may_change(key: str) -> bool:
    return any(key == allowed or key.startswith(f"{allowed}.") for allowed in MAY_CHANGE_ON_RESUME)


def config_fingerprint(record: dict[str, Any]) -> str:
    """SHA-256 of the record without the keys that may change on resume."""
    kept = {key: value for key, value in record.items() if not may_change(key)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def workers_config_digest(config: DictConfig) -> str:
    """SHA-256 of everything the workers are built from (their roles' configs, devices and sizes, step counts
    included: the LR schedules' length): live workers are reused only by a controller whose digest is the same."""
    kept = {key: value for key, value in config_record(config).items() if key.startswith(WORKER_KEYS)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, old value, new value)`` for every key outside :data:`MAY_CHANGE_ON_RESUME` whose value differs (a key
    only one side has: ``<unset>`` on the other)."""
    unset = "<unset>"
    return [
        (key, old.get(key, unset), new.get(key, unset))
        for key in sorted(set(old) | set(new))
        if not may_change(key) and old.get(key, unset) != new.get(key, unset)
    ]


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    listed = [f"{key}: {old} -> {new}" for key, old, new in changes[:MAX_LISTED_CHANGES]]
    more = len(changes) - len(listed)
    return "; ".join(listed) + (f"; and {more} more" if more > 0 else "")


@dataclass
class ResumePoint:
    """The checkpoint a run continues from, and how the new config differs from the one it was trained under."""

    folder: Path
    state: dict[str, Any]
    changes: list[tuple[str, Any, Any]]

    @property
    def step(self) -> int:
        return int(self.state["global_step"])

    @property
    def run_id(self) -> str:
        return self.state["mlflow_run_id"]

    def same_step_count(self, config: DictConfig) -> bool:
        """The step count was asked for the same way as when the checkpoint was written."""
        old, new = self.state.get("config", {}), config_record(config)
        return all(old.get(key) == new.get(key) for key in STEP_COUNT_KEYS)


def resume_folder(config: DictConfig, checkpoints: StepCheckpoints, log: Callable[[str], None] = print) -> Path | None:
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
        folder = checkpoints.local_folder(config.trainer.resume_from_path)
        checkpoints.check_intact(folder)
        return folder
    step, damaged = checkpoints.latest_intact()
    for bad_step, problem in damaged:
        log(f"checkpoint {checkpoints.step_dir(bad_step)} is damaged ({problem}): skipped")
    return None if step is None else checkpoints.step_dir(step)


def find_resume_point(
    config: DictConfig, checkpoints: StepCheckpoints, log: Callable[[str], None] = print
) -> ResumePoint | None:
    """The checkpoint this run continues from (None: a fresh run). A :class:`ResumeRefused` names the changed keys
    when the config differs from the checkpoint's and ``trainer.resume_allow_config_change`` is off. A checkpoint
    written before configs were recorded is resumed unchecked (said in ``log``)."""
    folder = resume_folder(config, checkpoints, log)
    if folder is None:
        return None
    state = checkpoints.trainer_state(folder)
    if "config" not in state:
        log(f"{folder} records no config (written by an older ppoflow): resumed without comparing configs")
        return ResumePoint(folder, state, [])
    changes = config_changes(state["config"], config_record(config))
    if changes and not config.trainer.resume_allow_config_change:
        raise ResumeRefused(
            f"{folder} (MLflow run {state['mlflow_run_id']}, step {state['global_step']}) was trained under another "
            f"config: {describe_changes(changes)}. Start a new run (another trainer.experiment_name or "
            "trainer.default_local_dir, or trainer.resume_mode=disable), or continue this one under the new config "
            "with trainer.resume_allow_config_change=true"
        )
    return ResumePoint(folder, state, changes)


def already_finished(point: ResumePoint, config: DictConfig, run_status: str, total_steps: int | None = None) -> bool:
    """The run of ``point`` ended FINISHED at the step this config asks for: ``total_steps`` when known, else (asked
    the same way) the step count it finished with."""
    if run_status != "FINISHED":
        return False
    target = total_steps
    if target is None and point.same_step_count(config):
        target = point.state.get("total_steps")
    return target is not None and point.step >= target


def finished_result(point: ResumePoint, tracking_uri: str, metrics: dict[str, float]) -> dict[str, Any]:
    """What a run that finished earlier returns again: its id, step, last checkpoint and last validation metrics (in
    MLflow's names)."""
    return {
        "tracking_uri": tracking_uri,
        "run_id": point.run_id,
        "step": point.step,
        "checkpoint_dir": str(point.folder.resolve()),
        "val_metrics": {key: value for key, value in metrics.items() if key.startswith("val-core/")},
        "already_finished": True,
    }


def starts_fresh(config: DictConfig) -> bool:
    """A run with no checkpoint to resume from (``resume_mode=disable``, or no ``latest`` pointer in its folder)."""
    mode = config.trainer.resume_mode
    return mode == "disable" or (mode == "auto" and run_checkpoints(config.trainer).pointer_step() is None)


def check_resume(config: DictConfig) -> dict[str, Any] | None:
    """The resume decision before anything starts (the command line's input checks): a :class:`ResumeRefused` for a
    changed config, the earlier result for a run that already finished, else None (the flow decides again, under the
    folder's lock)."""
    if starts_fresh(config):
        return None
    # a run to resume: MLflow's client and the checkpoint code (torch) are worth their seconds only now
    from flows.demo import apply_embedded_defaults
    from flows.tracking import open_store, tracking_uri

    config = copy.deepcopy(config)
    apply_embedded_defaults(config, log=lambda line: None)  # the demo's paths, as the run will record them
    point = find_resume_point(config, run_checkpoints(config.trainer), log=lambda line: None)
    if point is None:
        return None
    uri = tracking_uri(config)
    run = open_store(uri).get_run(point.run_id)
    if not already_finished(point, config, run.info.status):
        return None
    return finished_result(point, uri, run.data.metrics)
