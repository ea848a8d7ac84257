"""MLflow tracking of one training run, through an explicit client and run id (the fluent API is thread-local).

* one run per training run: experiment = ``trainer.project_name``, run name = ``trainer.experiment_name``;
* params = the flattened config (once; secrets redacted, see flows/secrets.py), the composed YAML (redacted too)
  as an artifact;
* each step's metrics (names as :func:`metric_key` makes them) sent by ``log_batch`` in a background thread, the steps
  of the last ``METRICS_INTERVAL_S`` together (flushed before a checkpoint, a tag and the end), with
  ``training/global_step`` as the step's marker: a resumed run asks MLflow which steps are already there and does
  not log them again (no duplicated, no missing step);
* rollout samples as an MLflow table, checkpoint paths as tags, the final actor as an HF-format artifact,
  optionally registered as a model version.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from flows.config import SQLITE, flatten
from flows.secrets import REDACTED, redact_text, redacted, split_secret_overrides
from rl_core.checkpoint import TRAINING_STATE_FILE
from rl_core.config import TrainerConfig

STEP_MARKER = "training/global_step"
CONFIG_ARTIFACT = "config/ppo_trainer.yaml"  # the config the run trains under (redacted)
INVALID_METRIC_CHARS = re.compile(r"[^A-Za-z0-9_\-. :/]")
# MLflow 3's UI opens an experiment without this tag in its GenAI view when the runs log tables (our samples)
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
PREFECT_FLOW_RUN_TAG = "ppoflow.prefect_flow_run_id"  # the run's Prefect flow run
PREFECT_UI_TAG = "ppoflow.prefect_ui_url"  # the Prefect UI that shows it, when its server outlives the run
CODE_ROOT = Path(__file__).resolve().parent.parent  # ppoflow's code: its git commit is recorded on each run
# Steps logged within this many seconds of the last send go to MLflow together: a SQLite store spends ~15-18 ms of CPU
# on a log_batch of one step's ~90 metrics, ~7.6 ms a step on 5-10 steps' (bench/mlflow_logging.py; bench/README.md)
METRICS_INTERVAL_S = 1.0
MAX_METRICS_PER_CALL = 1000  # MLflow's limit for one log_batch


def metric_key(name: str) -> str:
    """MLflow's form of a verl metric name: ``@`` (not allowed in MLflow) becomes ``_at_`` as in verl's MLflow
    logger, so ``val-core/<ds>/acc/mean@4`` is logged as ``val-core/<ds>/acc/mean_at_4``."""
    return INVALID_METRIC_CHARS.sub("_", name.replace("@", "_at_"))


DEFAULT_TRACKING_URI = TrainerConfig.tracking_uri


def tracking_uri(config: DictConfig) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or config.trainer.tracking_uri


def open_store(uri: str) -> MlflowClient:
    """A client of the store at ``uri``. A SQLite store is opened (created and its schema migrated, when new) under a
    file lock taken before MLflow touches it, so that processes starting at once on a fresh ``mlflow.db`` do not
    migrate it together (alembic then fails: "Online migration expected to match one row")."""
    if not uri.startswith("sqlite:///"):
        return MlflowClient(uri)
    lock_path = Path(uri.removeprefix("sqlite:///")).expanduser().resolve().with_suffix(".db.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        client = MlflowClient(uri)
        client.search_experiments(max_results=1)  # creates and migrates the store now, while the lock is held
    return client


def experiment_id(client: MlflowClient, config: DictConfig) -> str:
    """The id of the experiment ``trainer.project_name``, created if new (its artifacts under
    ``trainer.artifact_location``, else where its store keeps them: a tracking server's artifact store, ``mlartifacts/``
    beside a SQLite file), and marked as model training (:data:`EXPERIMENT_KIND`)."""
    experiment = client.get_experiment_by_name(config.trainer.project_name)
    if experiment is None:
        folder = config.trainer.artifact_location
        uri = client.tracking_uri
        if folder is None and uri.startswith(SQLITE):
            folder = Path(uri.removeprefix(SQLITE)).expanduser().resolve().parent / "mlartifacts"
        location = Path(folder).expanduser().resolve().as_uri() if folder is not None else None
        return client.create_experiment(
            config.trainer.project_name, artifact_location=location, tags=dict([EXPERIMENT_KIND])
        )
    if EXPERIMENT_KIND[0] not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, *EXPERIMENT_KIND)
    return experiment.experiment_id


def provenance_tags(overrides: list[str]) -> dict[str, str]:
    """What a run was made from, as tags: the command line (``ppoflow.command``), the Hydra overrides
    (``ppoflow.overrides``, one per line), secrets redacted in both, and the git commit of ppoflow's code
    (``mlflow.source.git.commit``, with ``ppoflow.git_dirty`` when it has uncommitted changes) where it is a git
    checkout."""
    public, secret = split_secret_overrides(list(overrides))
    tags = {
        "ppoflow.command": redact_text(shlex.join(sys.argv), set(secret))[:5000],
        "ppoflow.overrides": "\n".join([*public, *(REDACTED for _ in secret)])[:5000],
    }
    try:
        commit = subprocess.run(
            ["git", "-C", str(CODE_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "-C", str(CODE_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an installed wheel), or no git
        return tags
    tags["mlflow.source.git.commit"] = commit
    if changes.strip():
        tags["ppoflow.git_dirty"] = "true"
    return tags


def mark_killed(uri: str, run_id: str, reason: str) -> bool:
    """A run left RUNNING by a controller that was killed: KILLED, with ``reason`` in ``ppoflow.error``; False when
    the run is not RUNNING (it ended, or was never made)."""
    client = open_store(uri)
    try:
        if client.get_run(run_id).info.status != "RUNNING":
            return False
    except MlflowException:
        return False
    client.log_batch(run_id, tags=[RunTag("ppoflow.error", reason), RunTag("ppoflow.status", "killed")])
    client.set_terminated(run_id, status="KILLED")
    return True


class RunTracker:
    """A new run (with the config as params and ``tags`` besides ``ppoflow.status``), or the existing ``run_id``."""

    def __init__(
        self,
        config: DictConfig,
        run_id: str | None = None,
        tags: dict[str, str] | None = None,
        run_name: str | None = None,
    ):
        self.uri = tracking_uri(config)
        self.client = open_store(self.uri)
        # one: calls stay in order
        self.background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppoflow-mlflow")
        self.pending: list[Future] = []
        self.unsent: list[Metric] = []  # steps' metrics not yet handed to the background thread
        self.last_sent = time.monotonic()
        if run_id is None:
            run = self.client.create_run(
                experiment_id(self.client, config),
                run_name=run_name or config.trainer.experiment_name,
                tags={**(tags or {}), "ppoflow.status": "running"},
            )
            self.run_id = run.info.run_id
            self._log_config(config)
            self.active = True
        else:
            self.run_id = run_id
            run = self.client.get_run(run_id)  # fails clearly when the run does not exist
            self.active = False  # a resumed run's status changes only once the restore succeeded: mark_running()
        self.experiment_id = run.info.experiment_id
        self.last_logged_step = max(
            (m.step for m in self.client.get_metric_history(self.run_id, STEP_MARKER)), default=-1
        )

    def _log_config(self, config: DictConfig) -> None:
        safe = redacted(config)  # no secret in params or in the YAML (flows/secrets.py)
        params = [Param(key, str(value)[:6000]) for key, value in flatten(safe).items()]
        for start in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        self.client.log_text(self.run_id, OmegaConf.to_yaml(safe), CONFIG_ARTIFACT)

    def log_config_change(self, step: int, changes: list[tuple[str, Any, Any]], config: DictConfig) -> None:
        """A resume at ``step`` under a changed config (``trainer.resume_allow_config_change``): the changes in
        ``config/resume_<step>.yaml`` and the ``ppoflow.config_changed_at_<step>`` tag, and the new config as
        ``config/ppo_trainer.yaml`` (what an evaluation of a later checkpoint starts from). The params keep the
        values the run started with: MLflow params cannot change."""
        self.flush()
        diff = OmegaConf.create({key: {"from": old, "to": new} for key, old, new in changes})
        self.client.log_text(self.run_id, OmegaConf.to_yaml(diff), f"config/resume_{step}.yaml")
        self.client.log_text(self.run_id, OmegaConf.to_yaml(redacted(config)), CONFIG_ARTIFACT)
        self.set_tags({f"ppoflow.config_changed_at_{step}": ", ".join(key for key, _, _ in changes)[:5000]})

    def log_step(self, step: int, metrics: dict[str, float]) -> bool:
        """Log a step's metrics in the background (off the step's path), with the steps logged since the last send once
        ``METRICS_INTERVAL_S`` has passed (:meth:`flush` sends them and waits); False (and nothing logged) when MLflow
        has the step already."""
        if step <= self.last_logged_step:
            return False
        now = int(time.time() * 1000)
        self.unsent += [
            Metric(metric_key(key), float(value), now, step) for key, value in metrics.items() if value is not None
        ]
        self.unsent.append(Metric(STEP_MARKER, float(step), now, step))
        self._raise_background_error()
        if time.monotonic() - self.last_sent >= METRICS_INTERVAL_S:
            self._send()
        self.last_logged_step = step
        return True

    def _send(self) -> None:
        """Hand the unsent metrics to the background thread, in calls of at most MLflow's limit."""
        for start in range(0, len(self.unsent), MAX_METRICS_PER_CALL):
            chunk = self.unsent[start : start + MAX_METRICS_PER_CALL]
            self.pending.append(self.background.submit(self.client.log_batch, self.run_id, metrics=chunk))
        self.unsent, self.last_sent = [], time.monotonic()

    def _raise_background_error(self) -> None:
        """An earlier background call that failed raises here (a store that went away fails the run, no step is lost
        silently); finished calls are forgotten."""
        done = [future for future in self.pending if future.done()]
        self.pending = [future for future in self.pending if not future.done()]
        for future in done:
            future.result()

    def flush(self) -> None:
        """Send the metrics not yet sent and wait for them (before a checkpoint: a step it holds is in MLflow)."""
        self._send()
        for future in self.pending:
            future.result()
        self.pending = []

    def log_samples(self, step: int, samples: dict[str, list]) -> None:
        self.flush()
        self.client.log_table(self.run_id, data=samples, artifact_file=f"samples/step_{step:06d}.json")

    def log_validation_images(self, step: int, table: dict[str, list]) -> None:
        """A few validation samples with their images (:func:`flows.step_report.validation_images`): MLflow's
        artifact view shows the table with the images."""
        self.client.log_table(self.run_id, data=table, artifact_file=f"validation/step_{step:06d}.json")

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.flush()
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_final_model(self, actor_folder: Path, register_as: str | None) -> str:
        """Upload the actor's HF folder (weights or LoRA adapter, config, tokenizer; not the optimizer state, which only
        a resume needs and which is 2-3x the weights) as the ``model`` artifact; register a version when ``register_as``
        is set."""
        self.flush()
        for path in sorted(Path(actor_folder).iterdir()):
            if path.name == TRAINING_STATE_FILE:
                continue
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path=f"model/{path.name}")
            else:
                self.client.log_artifact(self.run_id, str(path), artifact_path="model")
        source = f"{self.client.get_run(self.run_id).info.artifact_uri}/model"
        if register_as:
            try:
                self.client.create_registered_model(register_as)
            except Exception:  # already registered: add a version
                pass
            self.client.create_model_version(register_as, source=source, run_id=self.run_id)
        return source

    def mark_running(self) -> None:
        """A resumed run continues (its checkpoint restored): RUNNING again."""
        self.client.update_run(self.run_id, status="RUNNING")
        self.active = True

    def fail(self, error: BaseException, killed: bool = False) -> None:
        """The run ended by ``error``: FAILED, or KILLED (``killed``: it was told to stop), with the error in the
        ``ppoflow.error`` tag. A resumed run whose restore failed is left as it was."""
        try:
            self.flush()
        except Exception:  # the store failed already: the tags below say why the run ended, if it can take them
            self.pending = []
        if self.active:
            # Prefect's TerminationSignal has no message
            detail = str(error) or (f"signal {error.signal}" if hasattr(error, "signal") else "")
            self.set_tags({"ppoflow.error": f"{type(error).__name__}: {detail}"[:5000]})
            self.finish("KILLED" if killed else "FAILED")

    def finish(self, status: str = "FINISHED") -> None:
        self.set_tags({"ppoflow.status": status.lower()})  # after the background calls (set_tags flushes)
        self.client.set_terminated(self.run_id, status=status)
        self.background.shutdown()


def report_killed_controller(holder: dict[str, Any], run_id: str, folder: Path, log=print) -> None:
    """The checkpoint folder's lock still named ``holder``: its controller was killed before it let go. Its MLflow run
    is marked KILLED, unless it is ``run_id``, the run this controller continues."""
    killed_run = holder.get("mlflow_run_id")
    who = f"pid {holder.get('pid')}, started {holder.get('started')}"
    if killed_run == run_id:
        log(f"the previous controller of MLflow run {run_id} ({who}) was killed; continuing the run")
    elif killed_run and mark_killed(
        holder.get("tracking_uri") or "",
        killed_run,
        f"its controller ({who}) was killed; found by the next run in {folder}",
    ):
        log(f"MLflow run {killed_run} in {folder} was left RUNNING by a killed controller ({who}): marked KILLED")
