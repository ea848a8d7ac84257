"""The PPO step's stages as Prefect task runs: the stage runner the training flow gives
:func:`rl_core.ppo_step.run_ppo_step`.

A stage is called plainly, in the flow's thread, and *reported* to Prefect as a task run: its state changes
(Running, Completed; Failed with its error; AwaitingRetry and Retrying when retried; no Pending, which would last
microseconds), with their real timestamps, go on a queue that a background thread (:class:`TaskRunReporter`) turns
into the events Prefect's own task engine emits, from which the server records the task run. So the Prefect UI shows
what it showed when each stage ran as a Prefect task — one task run per stage per step, named by its step
(``step-12/generate``), its duration, what it produced (its Completed state's message: a batch's rows and fields,
metrics and their values), the data dependencies between the stages (a stage's argument that is an
earlier stage's output), a failed stage as Failed with its error, a retry as a retry — at ~0.03 ms of the step's
critical path per stage instead of Prefect's task engine's ~3-4.5 ms (bench/README.md, "step_overhead"). The run's
other phases are reported the same way (:func:`run_phase`: ``load-inputs``, ``set-up``, ``step-12/validate``,
``step-12/save_checkpoint``), so the graph covers the whole run. The batch never leaves the flow process and Ray's
object store.

Idempotent stages (generation is seeded by the step; log-probs and values are pure functions of the weights) are
retried here on transient errors; updates are not (the flow recovers those from the last checkpoint instead), and a
dead or timed-out worker is never retried here: the flow rebuilds the worker group.

The events are made by ``prefect.utilities.engine.emit_task_run_state_change_event``, the function Prefect's task
engine uses (same payload, whatever Prefect version is installed; pyproject pins the range a test reads runs back in).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

from prefect import states
from prefect.client.schemas.objects import TaskRun, TaskRunPolicy, TaskRunResult
from prefect.context import FlowRunContext

from infra.worker_group import WorkerDiedError, WorkerTimeoutError
from rl_core import ppo_step
from rl_core.batch import Batch

RETRY_DELAY_S = 1.0  # between a failed attempt of an idempotent stage and its retry
# A task run's Running state is sent once it has run this long; one that completes sooner is sent once, Completed,
# with its start time (half the events of a small run's steps: each event costs the controller and Prefect's server
# CPU the workers need, bench/README.md). Its Running state is then missing from its state history only.
HOLD_RUNNING_S = 1.0
TASK_RUNS = {"started": 0}  # the task runs this process reported (its Prefect server records as many)
LOG = logging.getLogger("ppoflow")


def retryable(error: BaseException) -> bool:
    """Transient errors are retried in place; a dead or timed-out worker needs the group rebuilt, which the flow does
    (a retry would reach a dead worker, or queue behind the stale call)."""
    return isinstance(error, Exception) and not isinstance(error, (WorkerDiedError, WorkerTimeoutError))


@dataclass
class ReportedRun:
    """One call of a stage or phase, as the task run it is reported as."""

    task_name: str
    run_name: str
    retries: int
    inputs: dict[str, list[UUID]]  # argument name -> the task runs whose outputs it is
    context: contextvars.Context  # the flow run's context: the events are related to its flow run
    id: UUID = field(default_factory=uuid4)
    task_run: TaskRun | None = None  # the reporter's record of it, made on its first state
    last_state: states.State | None = None
    last_event: Any = None


class TaskRunReporter(threading.Thread):
    """Turns the state changes the flow's thread queued into Prefect task-run events, in order, off its path."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="ppoflow-task-run-reporter")
        self.changes: queue.Queue[tuple[ReportedRun, str, datetime, str | None]] = queue.Queue()
        self.warned = False

    def report(self, run: ReportedRun, state_name: str, message: str | Callable[[], str | None] | None = None) -> None:
        """Queue a state change; a callable ``message`` is made in the reporter's thread, off the flow's path."""
        self.changes.put((run, state_name, datetime.now(timezone.utc), message))

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until every queued change was emitted; whether it was."""
        deadline = time.monotonic() + timeout_s
        while self.changes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.changes.unfinished_tasks

    def run(self) -> None:
        held: dict[UUID, tuple] = {}  # run id -> its Running change, not sent yet (HOLD_RUNNING_S)
        while True:
            first = min((when for _, _, when, _ in held.values()), default=None)  # the first held one is due first
            wait = None if first is None else (first - datetime.now(timezone.utc)).total_seconds() + HOLD_RUNNING_S
            try:
                change = self.changes.get(timeout=None if wait is None else max(0.0, wait))
            except queue.Empty:
                change = None
            now = datetime.now(timezone.utc)
            for run_id, running in list(held.items()):  # still running after HOLD_RUNNING_S: the UI shows it now
                if (now - running[2]).total_seconds() >= HOLD_RUNNING_S:
                    self.send(held.pop(run_id))
            if change is None:
                continue
            run, state_name = change[0], change[1]
            if state_name == "Running":
                held[run.id] = change
                continue
            running = held.pop(run.id, None)
            if running is not None:  # a run that completes within HOLD_RUNNING_S is reported once, when it ends
                self.send(running, emit=state_name != "Completed")
            self.send(change)

    def send(self, change: tuple, emit: bool = True) -> None:
        """Record one queued state change on its run and, with ``emit``, send its event; never raises."""
        run, state_name, when, message = change
        try:
            message = message() if callable(message) else message
            run.context.run(self.emit, run, state_name, when, message, emit)
        except Exception as error:  # reporting never fails a run; said once
            if not self.warned:
                LOG.warning("could not report task run %s to Prefect: %s", run.run_name, error)
                self.warned = True
        finally:
            self.changes.task_done()

    @staticmethod
    def emit(run: ReportedRun, state_name: str, when: datetime, message: str | None, send: bool = True) -> None:
        """What Prefect's task engine does on a state change (``TaskRunEngine.set_state``), at ``when``; without
        ``send`` the run's record changes (its start time, run count) and no event is sent."""
        from prefect.utilities.engine import emit_task_run_state_change_event

        state = make_state(state_name, when, message)
        if run.last_state is not None and state.timestamp <= run.last_state.timestamp:  # a unique, ordered timestamp
            state.timestamp = run.last_state.timestamp + timedelta(microseconds=1)
        if run.task_run is None:
            flow_run = FlowRunContext.get().flow_run
            run.task_run = TaskRun(
                id=run.id,
                name=run.run_name,
                flow_run_id=flow_run.id,
                flow_run_run_count=flow_run.run_count,
                task_key=run.task_name,
                dynamic_key=str(run.id),
                empirical_policy=TaskRunPolicy(retries=run.retries, retry_delay=RETRY_DELAY_S),
                task_inputs={name: [TaskRunResult(id=i) for i in ids] for name, ids in run.inputs.items()},
                expected_start_time=when,
            )
        task_run, last = run.task_run, run.last_state
        state.state_details.task_run_id, state.state_details.flow_run_id = task_run.id, task_run.flow_run_id
        task_run.state, task_run.state_id, task_run.state_type, task_run.state_name = (
            state,
            state.id,
            state.type,
            state.name,
        )
        if last is not None and last.is_running():
            task_run.total_run_time += state.timestamp - last.timestamp
        if state.is_running():
            task_run.run_count += 1
            task_run.start_time = task_run.start_time or state.timestamp
        if state.is_final():
            task_run.end_time = state.timestamp
        if send:
            run.last_event = emit_task_run_state_change_event(
                task_run=task_run, initial_state=last, validated_state=state, follows=run.last_event
            )
        run.last_state = state


def make_state(name: str, when: datetime, message: str | None) -> states.State:
    """Prefect's state ``name`` at ``when`` (AwaitingRetry is scheduled RETRY_DELAY_S later)."""
    if name == "AwaitingRetry":
        state = states.AwaitingRetry(scheduled_time=when + timedelta(seconds=RETRY_DELAY_S), message=message)
    else:
        state = getattr(states, name)(message=message)
    state.timestamp = when
    return state


_reporter: TaskRunReporter | None = None
_STARTING = threading.Lock()


def running_reporter() -> TaskRunReporter:
    """The reporter, made and started on its first use: not at import, since a thread object that exists when a
    process forks is marked stopped in the child (``ppoflow up``'s launcher forks each command from a process that
    imported this module)."""
    global _reporter
    with _STARTING:  # two flows' threads (a sweep's children) may report their first task runs at once
        if _reporter is None or not _reporter.is_alive():
            _reporter = TaskRunReporter()
            _reporter.start()
        return _reporter


def flush_reported_runs(timeout_s: float = 10.0) -> bool:
    """Every task run reported so far has reached Prefect's events client (at most ``timeout_s``); whether all did."""
    return _reporter is None or not _reporter.is_alive() or _reporter.flush(timeout_s)


def failure_message(error: BaseException) -> str:
    return f"Task run encountered an exception {type(error).__name__}: {error}"


def produced(result: Any, limit: int = 500) -> str | None:
    """What a stage or phase returned, in one line for its Completed state's message (read with the task run's states
    through Prefect's API): a batch's rows and fields, the numbers of a metrics dict, a path, else the type of each
    item of a tuple; None for nothing."""
    parts = []
    try:
        for item in result if isinstance(result, tuple) else (result,):
            if isinstance(item, Batch):
                parts.append(f"a batch of {len(item)} rows: {', '.join([*item.tensors, *item.non_tensors])}")
            elif isinstance(item, dict):
                numbers = {k: v for k, v in item.items() if isinstance(v, (int, float))}
                parts.append(", ".join(f"{k}={v:.4g}" for k, v in numbers.items()) or f"{len(item)} entries")
            elif isinstance(item, (str, Path)):
                parts.append(str(item))
            elif item is not None:
                parts.append(type(item).__name__)
    except RuntimeError:  # a later stage changed the batch's fields while this was read: say less
        return None
    text = "; ".join(parts)
    return (text[:limit] + "...") if len(text) > limit else (text or None)


def call_reported(
    task_name: str, run_name: str, fn: Callable, args: tuple, retries: int = 0, inputs: dict | None = None
) -> tuple[Any, ReportedRun | None]:
    """``fn(*args)``, in this thread, reported as the task run ``run_name`` of the task ``task_name`` when a flow run
    is in progress; a transient error is retried up to ``retries`` times, RETRY_DELAY_S apart. Returns (the result,
    its reported run, None outside a flow run)."""
    TASK_RUNS["started"] += 1
    run = reporter = None
    flow_run_context = FlowRunContext.get()
    if flow_run_context is not None and flow_run_context.flow_run is not None:
        run = ReportedRun(task_name, run_name, retries, inputs or {}, contextvars.copy_context())
        reporter = running_reporter()
    attempt = 0
    while True:
        if run is not None:
            reporter.report(run, "Running" if attempt == 0 else "Retrying")
        try:
            result = fn(*args)
        except BaseException as error:
            if attempt < retries and retryable(error):
                attempt += 1
                retry = f"Retry {attempt}/{retries} will start {RETRY_DELAY_S:g} second(s) from now"
                LOG.warning("%s failed (%s): %s", run_name, failure_message(error), retry)
                if run is not None:
                    reporter.report(run, "AwaitingRetry", retry)
                time.sleep(RETRY_DELAY_S)
                continue
            if run is not None:
                reporter.report(run, "Failed" if isinstance(error, Exception) else "Crashed", failure_message(error))
            raise
        if run is not None:
            reporter.report(run, "Completed", functools.partial(produced, result))
        return result, run


class BackgroundRun:
    """A task run for work beside the flow's thread (a one-step-off generation on the rollout's own workers): Running
    from its start, then Completed or Failed when the flow takes its result, Cancelled when it is dropped. Made in the
    flow's thread; outside a flow run it reports nothing."""

    TASK = "rollout_generate"

    def __init__(self, run_name: str):
        self.run = None
        flow_run_context = FlowRunContext.get()
        if flow_run_context is not None and flow_run_context.flow_run is not None:
            self.run = ReportedRun(self.TASK, run_name, 0, {}, contextvars.copy_context())
            self.reporter = running_reporter()
            self.reporter.report(self.run, "Running")

    def done(self, error: BaseException | None = None, dropped: bool = False) -> None:
        if self.run is None:
            return
        if dropped:
            self.reporter.report(self.run, "Cancelled", "dropped before it was trained on")
        elif error is not None:
            self.reporter.report(self.run, "Failed", failure_message(error))
        else:
            self.reporter.report(self.run, "Completed")


class StageRunner:
    """``runner(name, fn, *args)`` calls the stage function ``fn``, reported as a task run of the task ``name`` named
    ``step-<step>/<name>`` after the runner's current :attr:`step`, its inputs linked to the earlier stages of the
    step whose outputs they are; the stages of ``retry_safe`` are retried ``retries`` times."""

    def __init__(self, retries: int, retry_safe: tuple[str, ...] = ppo_step.IDEMPOTENT_STAGES):
        self.retries, self.retry_safe = retries, retry_safe
        self.step = 0  # the step the next task runs belong to (the session sets it)
        self.outputs: dict[int, tuple[Any, UUID]] = {}  # id(output) -> (the output, its task run): this step's
        self.outputs_step = 0
        self.parameters: dict[Callable, list[str]] = {}  # a stage function's parameter names

    def __call__(self, name: str, fn: Callable, *args: Any) -> Any:
        if self.outputs_step != self.step:
            self.outputs, self.outputs_step = {}, self.step
        retries = self.retries if name in self.retry_safe else 0
        result, run = call_reported(name, f"step-{self.step}/{name}", fn, args, retries, self.upstream(fn, args))
        if run is not None:  # an output, or an item of a tuple output, passed to a later stage links the two
            for output in (result, *result) if isinstance(result, tuple) else (result,):
                self.outputs[id(output)] = (output, run.id)
        return result

    def upstream(self, fn: Callable, args: tuple) -> dict[str, list[UUID]]:
        """The arguments that are earlier stages' outputs, by parameter name."""
        if fn not in self.parameters:
            self.parameters[fn] = list(inspect.signature(fn).parameters)
        names = self.parameters[fn]
        inputs = {}
        for i, arg in enumerate(args):
            output, run_id = self.outputs.get(id(arg), (None, None))
            if run_id is not None and output is arg:
                inputs[names[i] if i < len(names) else f"arg{i}"] = [run_id]
        return inputs


def run_phase(name: str, fn: Callable, *args: Any, step: int | None = None) -> Any:
    """A phase of the run besides the step's stages (loading the inputs, set-up, validation, a checkpoint), reported
    as a task run named ``name``, or ``step-<step>/<name>``; never retried here (the flow recovers)."""
    return call_reported(name, name if step is None else f"step-{step}/{name}", fn, args)[0]
