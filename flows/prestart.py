"""A fresh run's inputs and workers, made while Prefect's server boots.

Before the flow run of ``ppoflow train`` begins, the command spends seconds starting Prefect's temporary server and
importing the flow; the workers (a new process importing torch and the models' code, then loading the models) used
to start only after that. Their Ray namespace is named after the checkpoint folder
(:func:`flows.workers.workers_namespace`: known from the config alone), so the command starts them right after its
input checks: :func:`prestart` starts a thread that takes the folder's lock and loads the run's inputs (tokenizer,
data, reward) while a second thread starts the worker processes as soon as Ray answers; once the inputs are loaded the
workers get the run's final config (the demo's paths, the LR schedule's length from the data's size) and load their
models (:func:`flows.workers.start_workers`, :func:`flows.workers.load_models`). The flow's session then claims
each part (:func:`claim_inputs`, :func:`claim_lock`, :func:`claim_group`) when its own config is the one the part was
made for, and makes the part itself otherwise; the command releases what was not claimed (:func:`release`). Only a
run that starts from scratch is prestarted: a resumed run may reattach to its live workers, which its session decides
under the folder's lock.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from flows.demo import apply_embedded_defaults
from flows.resume import config_record, starts_fresh, workers_config_digest
from infra.cluster import connected
from rl_core.step_checkpoint import PRESTART_MARK, StepCheckpoints, run_checkpoints


@dataclass
class Prestarted:
    """What the prestart thread made; each part is claimed once (then set to None here)."""

    folder: Path
    inputs_record: str = ""  # the config (embedded defaults applied) the inputs were loaded for
    inputs: Any = None
    folder_lock: Any = None
    group: Any = None
    workers_digest: str = ""  # the worker settings (step count planned) the group was built from
    notes: list[str] = field(default_factory=list)  # what loading the models said (the session logs it)
    seconds: float = 0.0
    imported: threading.Event = field(default_factory=threading.Event)  # its modules (torch, transformers, workers')
    inputs_done: threading.Event = field(default_factory=threading.Event)  # the lock and the inputs (the group follows)
    done: threading.Event = field(default_factory=threading.Event)
    released: bool = False  # the command ended first: the thread frees what it makes
    lock: threading.Lock = field(default_factory=threading.Lock)


_prestarted: Prestarted | None = None


def _record(config: DictConfig) -> str:
    return json.dumps(config_record(config), sort_keys=True)


def prestart(config: DictConfig) -> None:
    """Begin a fresh run's inputs and workers in a thread (nothing for a run that resumes). What fails here is left to
    the session, which does the same work again and reports the error where a run's errors are reported."""
    global _prestarted
    if _prestarted is not None or not starts_fresh(config):
        return
    _prestarted = Prestarted(run_checkpoints(config.trainer).root)
    thread = threading.Thread(target=_make, args=(_prestarted, copy.deepcopy(config)), name="ppoflow-prestart")
    thread.daemon = True
    thread.start()


def _make(started: Prestarted, config: DictConfig) -> None:
    began = time.perf_counter()
    workers_started = None
    try:
        # the mark tells this process's input checks that the folder is held for the run they check, not by another
        started.folder_lock = StepCheckpoints(started.folder).lock(
            {"run": config.trainer.experiment_name, PRESTART_MARK: os.getpid()}
        )
        # imported here, not by the command: the thread starts before the command imports the flow; the worker
        # processes start (each imports torch and the models' code) as soon as Ray answers, then the inputs load
        from flows.workers import load_models

        workers_started = _start_workers(copy.deepcopy(config))
        from flows.inputs import TrainingInputs, plan_steps

        import_data_readers()
        # the demo's assets, built once (their lines are the run's first), then cached: before the command imports the
        # flow, as writing the data imports pandas (pyarrow's conversions), which MLflow imports too
        apply_embedded_defaults(config)
        started.imported.set()
        started.inputs_record = _record(config)
        started.inputs = TrainingInputs.load(config)
        plan_steps(config, len(started.inputs.train_data))
        started.workers_digest = workers_config_digest(config)
        started.inputs_done.set()  # the flow may go on (its MLflow run) while the workers load their models
        group, workers_started = workers_started(), None
        if group is not None:
            load_models(group, config, log=started.notes.append)  # with the final config (demo paths, LR schedule)
            started.group = group
    except Exception:  # the session makes it again and reports the error
        if workers_started is not None and (group := workers_started()) is not None:
            group.kill()  # the inputs failed: workers would only hold the run's namespace
    finally:
        started.seconds = time.perf_counter() - began
        with started.lock:
            started.imported.set()
            started.inputs_done.set()
            started.done.set()
            if started.released:
                _free(started)


def _start_workers(config: DictConfig) -> Callable[[], Any]:
    """Start the run's worker group in a thread once Ray is connected; returns a function waiting for it: the group, or
    None when Ray is not connected or the start failed (the session starts them again and says why)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            if connected():
                from flows.workers import start_fresh_workers

                result["group"] = start_fresh_workers(config)
        except Exception:
            pass

    thread = threading.Thread(target=run, name="ppoflow-prestart-workers", daemon=True)
    thread.start()

    def started_group() -> Any:
        thread.join()
        return result.get("group")

    return started_group


def import_data_readers() -> None:
    """Import what reading the run's data files imports (pyarrow's parquet reader and its file systems), which the
    flow's modules import too (MLflow's pandas imports pyarrow's file systems). The prestart reads them while the
    command imports the flow (:func:`wait_for_imports`), and two threads importing the same modules at once can fail
    ("cannot import name ... from partially initialized module"): after this, loading the inputs imports none of the
    flow's modules."""
    import pyarrow.parquet  # noqa: F401


def wait_for_imports() -> None:
    """Until the prestart (if any) has imported its modules. Two threads importing transformers at once can fail
    (``cannot import name ...`` from its lazy module, seen here): the command imports the flow after."""
    if _prestarted is not None:
        _prestarted.imported.wait()


def wait(inputs_only: bool = False) -> None:
    """Until the prestart (if any) is done, or (``inputs_only``) until it has the folder's lock and the inputs."""
    if _prestarted is not None:
        (_prestarted.inputs_done if inputs_only else _prestarted.done).wait()


def _claim(part: str, matches: bool) -> Any:
    """The prestart's ``part`` when ``matches``, handed over once; else None."""
    if _prestarted is None or not matches:
        return None
    value = getattr(_prestarted, part)
    setattr(_prestarted, part, None)
    return value


def claim_inputs(config: DictConfig) -> Any:
    """The prestarted inputs when they were loaded for ``config`` (embedded defaults applied), else None."""
    wait(inputs_only=True)
    return _claim("inputs", _prestarted is not None and _prestarted.inputs_record == _record(config))


def claim_lock(folder: Path) -> Any:
    """The prestart's lock of the checkpoint folder ``folder``, else None."""
    wait(inputs_only=True)
    return _claim("folder_lock", _prestarted is not None and _prestarted.folder == Path(folder))


def claim_group(config: DictConfig) -> tuple[Any, list[str], float] | None:
    """The prestarted worker group, what loading its models said and the seconds the prestart took, when it was built
    from ``config``'s worker settings (its step count planned), else None."""
    wait()
    if _prestarted is None or _prestarted.group is None:
        return None
    if _prestarted.workers_digest != workers_config_digest(config):  # of no use: it would hold the run's namespace
        _claim("group", True).kill()
        return None
    return _claim("group", True), _prestarted.notes, _prestarted.seconds


def _free(started: Prestarted) -> None:
    if started.group is not None:
        started.group.kill()
    if started.folder_lock is not None:
        started.folder_lock.release()
    started.group = started.folder_lock = started.inputs = None


def release() -> None:
    """Free what no session claimed (the command is ending): the workers killed, the folder let go; a prestart still
    running frees what it makes when it is done."""
    global _prestarted
    started, _prestarted = _prestarted, None
    if started is None:
        return
    with started.lock:
        started.released = True
        if started.done.is_set():
            _free(started)
