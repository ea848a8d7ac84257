"""What the Prefect UI shows of a training run besides its stage graph: the per-step console lines in the flow run's
Logs tab (through Prefect's run logger), a link artifact to the MLflow run and the checkpoint folder, and a progress
artifact (step / total, the latest score and validation metric), updated as the run goes.

Outside a flow run (tests calling :func:`flows.train.run_training` directly) the lines are printed and no
artifact is made.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from prefect import runtime
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterStartTime
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger
from prefect.logging.loggers import PrefectLogAdapter

from flows.secrets import redact_text

PROGRESS_EVERY_S = 5.0  # the progress artifact is updated at most this often (each update is an API call)
PRUNE_EVERY_STEPS = 50  # old task runs are deleted in batches of this many steps
RECORDER_LAG_S = 2.0  # the server writes what it recorded at least every second (infra.stack settings), with margin
PRUNED = {"task_runs": 0}  # the task runs this process deleted from Prefect (:func:`delete_task_runs_before`)


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI: on the tracking server itself when it is one, else on
    ``PPOFLOW_MLFLOW_UI_URL`` when it is set (an ``mlflow ui --backend-store-uri <store>`` serving a local store);
    None when no UI serves the store (a link would not open). It opens MLflow's model-training view."""
    base = tracking_uri if tracking_uri.startswith(("http://", "https://")) else os.environ.get("PPOFLOW_MLFLOW_UI_URL")
    if not base:
        return None
    # the model-training view: without it a fresh browser opens MLflow 3's GenAI view, with no params or metrics
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def prefect_ui_url() -> str | None:
    """The Prefect UI of a server that outlives this process (``ppoflow up``, PREFECT_API_URL), for links to a flow
    run; None under the temporary server a command starts (gone when the command ends)."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    return (settings.ui_url or None) if settings.api.url else None  # "": the temporary server (flows/prefect_server.py)


def one_line(error: BaseException) -> str:
    """``Type: first line of the message (its notes)`` (Ray and torch errors run over many lines; a state message should
    not): a worker's error carries the stage and the worker that raised it as a note."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    notes = "; ".join(getattr(error, "__notes__", []))
    return f"{type(error).__name__}: {first}{f' ({notes})' if notes else ''}"[:500]


class PrefectRunView:
    """The training run as its Prefect flow run shows it."""

    def __init__(self, history_steps: int = -1) -> None:
        """``history_steps``: keep the task runs of the last this many steps (-1: all), see :meth:`step_started`."""
        self.history_steps = history_steps
        self.step_starts: dict[int, datetime] = {}
        self.pruned_before: datetime | None = None
        self.api_calls: ApiCalls | None = None
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

    def failure(self, error: BaseException) -> None:
        """The run failed: its cause in one line wherever the lines go, the traceback in the flow run's Logs tab only
        (``prefect.extra`` sends to the API, not to the console; the command line prints it with --verbose)."""
        if self.logger is None:
            return  # called without Prefect: the caller gets the exception itself
        self.logger.error(f"training failed: {one_line(error)}")
        PrefectLogAdapter(logging.getLogger("prefect.extra"), extra=self.logger.extra).error(
            "the failure's traceback", exc_info=error
        )

    def step_started(self, step: int) -> None:
        """Step ``step`` begins. Every PRUNE_EVERY_STEPS steps, the task runs that this flow run started before step
        ``step - history_steps`` are deleted from Prefect, off the step's path (:class:`ApiCalls`): ~6-8 task runs
        of ~3 states each per step would otherwise grow its database by tens of KB per step, without bound."""
        if not self.in_flow_run or self.history_steps < 0:
            return
        self.step_starts[step] = datetime.now(timezone.utc)
        oldest_kept = step - self.history_steps
        if oldest_kept <= 1 or oldest_kept % PRUNE_EVERY_STEPS or oldest_kept not in self.step_starts:
            return
        self.pruned_before = cutoff = self.step_starts[oldest_kept]
        flow_run_id = runtime.flow_run.id
        self._call_off_path("prune", lambda: delete_task_runs_before(flow_run_id, cutoff))
        self.step_starts = {s: t for s, t in self.step_starts.items() if s >= oldest_kept}

    def close(self, timeout_s: float = 30.0) -> None:
        """The run is over: let the calls off the step's path catch up (at most ``timeout_s``): the last progress, and
        the pruning once more after the server's recorder lag (a task run that started before the cutoff but was not
        recorded yet when its batch was deleted is deleted now that the recorder has written it)."""
        if self.api_calls is None:
            return
        if self.pruned_before is not None:
            flow_run_id, cutoff = runtime.flow_run.id, self.pruned_before
            self.api_calls.submit(
                "prune", lambda: (time.sleep(RECORDER_LAG_S), delete_task_runs_before(flow_run_id, cutoff))
            )
        self.api_calls.close(timeout_s)

    def _call_off_path(self, kind: str, call: Callable[[], object]) -> None:
        if self.api_calls is None:
            self.api_calls = ApiCalls()
        self.api_calls.submit(kind, call)

    def link_run(self, mlflow_url: str | None, tracking_uri: str, run_id: str, checkpoint_dir: str | Path) -> None:
        """The flow run's artifacts: a link to the MLflow run when a UI serves it (else its id, its store and how to
        open it), and the checkpoint folder as text (a browser does not open file:// links from a page)."""
        if not self.in_flow_run:
            return
        about = "The training run in MLflow: metrics, config, samples, checkpoints."
        if mlflow_url:
            create_link_artifact(mlflow_url, link_text=f"MLflow run {run_id}", key="mlflow-run", description=about)
        else:
            store = redact_text(tracking_uri)
            create_markdown_artifact(
                f"MLflow run `{run_id}` in `{store}`: no MLflow UI serves this store; open it with "
                f"`mlflow ui --backend-store-uri {store}` (or `ppoflow ui`).",
                key="mlflow-run",
                description=about,
            )
        folder = Path(checkpoint_dir).expanduser().resolve()
        create_markdown_artifact(
            f"`{folder}`", key="checkpoints", description="The run's step checkpoints (global_step_N, safetensors)."
        )

    def progress(self, step: int, total: int, summary: str, force: bool = False) -> None:
        """Step ``step`` of ``total`` done; ``summary`` (the latest score, validation metric) is the description.
        Updated at most every PROGRESS_EVERY_S seconds unless ``force``; the artifact is made at the first call, in
        the flow run's context, and updated off the step's path (an update waits for the server, which may be busy
        recording the steps' task runs: 0.3-1.3 s were measured on the controller's main thread)."""
        if not self.in_flow_run or not (force or time.monotonic() - self.last_progress >= PROGRESS_EVERY_S):
            return
        percent = 100.0 * step / max(total, 1)
        description = f"step {step}/{total} | {summary}"
        if self.progress_id is None:
            self.progress_id = create_progress_artifact(percent, key="training-progress", description=description)
        else:
            progress_id = self.progress_id
            self._call_off_path(
                "progress", lambda: update_progress_artifact(progress_id, percent, description=description)
            )
        self.last_progress = time.monotonic()


class ApiCalls(threading.Thread):
    """Calls to Prefect's API made in a thread of their own, so that no step waits for the server; in the order of
    their kinds' first submission, and of each kind only the latest not yet made (a newer progress replaces an older
    one, a later pruning cutoff an earlier). A call that raises is logged, never raised: the run goes on."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="ppoflow-prefect-api")
        self.pending: dict[str, Callable[[], object]] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = False
        self.start()

    def submit(self, kind: str, call: Callable[[], object]) -> None:
        with self.lock:
            self.pending[kind] = call
        self.wake.set()

    def close(self, timeout_s: float) -> None:
        """Make what is pending, then end (waits at most ``timeout_s``)."""
        self.stopping = True
        self.wake.set()
        self.join(timeout_s)

    def run(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            with self.lock:
                calls, self.pending = list(self.pending.items()), {}
            for kind, call in calls:
                try:
                    call()
                except Exception as error:  # the API is away or busy: the run does not fail for its view
                    logging.getLogger("ppoflow").warning("Prefect API call %r failed: %s", kind, error)
            with self.lock:
                if self.stopping and not self.pending:
                    return


def delete_task_runs_before(flow_run_id: str, cutoff: datetime) -> int:
    """Delete the task runs of ``flow_run_id`` that started before ``cutoff`` (their states go with them); returns
    how many. Errors are logged, not raised: pruning never fails a run."""
    deleted = 0
    try:
        with get_client(sync_client=True) as client:
            while True:
                task_runs = client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                    task_run_filter=TaskRunFilter(start_time=TaskRunFilterStartTime(before_=cutoff)),
                    limit=200,
                )
                for task_run in task_runs:
                    client.delete_task_run(task_run.id)
                    deleted += 1
                    PRUNED["task_runs"] += 1
                if len(task_runs) < 200:
                    return deleted
    except Exception as error:  # the API is away or busy: the next batch tries again
        logging.getLogger("ppoflow").warning("could not delete old task runs of flow run %s: %s", flow_run_id, error)
    return deleted
