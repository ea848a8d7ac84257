"""What the Prefect UI shows of a training run besides its stage graph: the per-step console lines in the flow run's
Logs tab (through Prefect's run logger), a link artifact to the MLflow run and the checkpoint folder, and a progress
artifact (step / total, the latest score and validation metric), updated as the run goes.

Outside a flow run (tests calling :func:`flows.train.run_training` directly) the lines are printed and no
artifact is made.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from prefect import runtime
from prefect.artifacts import create_link_artifact, create_progress_artifact, update_progress_artifact
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger

DEFAULT_MLFLOW_UI_URL = "http://127.0.0.1:5000"
PROGRESS_EVERY_S = 5.0  # the progress artifact is updated at most this often (each update is an API call)


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI: the tracking server itself when it is one, else ``PPOFLOW_MLFLOW_UI_URL``
    (default http://127.0.0.1:5000, where ``mlflow ui --backend-store-uri <store>`` serves a local store)."""
    base = tracking_uri if tracking_uri.startswith(("http://", "https://")) else os.environ.get("PPOFLOW_MLFLOW_UI_URL", DEFAULT_MLFLOW_UI_URL)
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def one_line(error: BaseException) -> str:
    """``Type: first line of the message`` (Ray and torch errors run over many lines; a state message should not)."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first}"[:500]


class PrefectRunView:
    """The training run as its Prefect flow run shows it."""

    def __init__(self) -> None:
        try:
            self.logger = get_run_logger()
        except MissingContextError:
            self.logger = None
        self.in_flow_run = self.logger is not None and runtime.flow_run.id is not None
        self.progress_id = None
        self.last_progress = 0.0

    def log(self, line: str) -> None:
        if self.logger is None:
            print(line, flush=True)
        else:
            self.logger.info(line)

    def link_run(self, mlflow_url: str, run_id: str, checkpoint_dir: str | Path) -> None:
        if not self.in_flow_run:
            return
        create_link_artifact(mlflow_url, link_text=f"MLflow run {run_id}", key="mlflow-run",
                             description="The training run in MLflow: metrics, config, samples, checkpoints.")
        folder = Path(checkpoint_dir).expanduser().resolve()
        create_link_artifact(folder.as_uri(), link_text=str(folder), key="checkpoints",
                             description="The run's step checkpoints (global_step_N, safetensors).")

    def progress(self, step: int, total: int, summary: str, force: bool = False) -> None:
        """Step ``step`` of ``total`` done; ``summary`` (the latest score, validation metric) is the description.
        Updated at most every PROGRESS_EVERY_S seconds unless ``force``."""
        if not self.in_flow_run or not (force or time.monotonic() - self.last_progress >= PROGRESS_EVERY_S):
            return
        percent = 100.0 * step / max(total, 1)
        description = f"step {step}/{total} | {summary}"
        if self.progress_id is None:
            self.progress_id = create_progress_artifact(percent, key="training-progress", description=description)
        else:
            update_progress_artifact(self.progress_id, percent, description=description)
        self.last_progress = time.monotonic()
