"""The PPO training flow: Prefect is the single controller, Ray workers do the work, MLflow records it.

One flow run = one training run, read top to bottom in :func:`run_training`:

1. inputs: the demo assets (when no model is named), data and reward, checked before anything starts;
2. the session (flows/session.py): checkpoint folder, MLflow run, workers, resumed from the latest checkpoint;
3. the loop: one PPO step (:func:`rl_core.ppo_step.run_ppo_step`, one Prefect task run per stage: generate -> reward ->
   old_log_prob -> ref_log_prob -> values -> advantage -> update_critic -> update_actor), validation when due,
   then metrics, samples and the checkpoint;
4. the final policy, uploaded as an MLflow model.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from omegaconf import DictConfig
from prefect import flow
from prefect.states import Failed

from flows import prestart
from flows.config import compose_config
from flows.demo import apply_embedded_defaults
from flows.inputs import TrainingInputs
from flows.parameters import TrainSettings
from flows.prefect_view import PrefectRunView, one_line
from flows.secrets import secret_overrides
from flows.session import TrainingSession, every
from flows.stages import run_phase
from flows.tracking import provenance_tags
from rl_core.input_checks import check_run_inputs


def run_training(config: DictConfig, tags: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything the flow does after composing the config (callable without Prefect's decorator, as tests do);
    ``tags`` go on a new MLflow run. Returns the run's summary."""
    # 1. Inputs. A bad one fails here, before any run exists (the datasets check every prompt).
    inputs = run_phase("load-inputs", load_inputs, config)

    # 2. The session: the folder, the MLflow run and the workers, resumed from the latest checkpoint.
    with TrainingSession(config, inputs, tags) as session:
        if session.finished_result is not None:
            return session.result()
        session.validate_before_training()

        # 3. The loop.
        with one_torch_thread():
            while session.progress.global_step < session.total_steps:
                step = session.progress.global_step + 1
                with session.step(step):  # a dead worker: the group is rebuilt and the loop rewinds to the checkpoint
                    batch, metrics = session.ppo_step(step)  # run_ppo_step; each stage a Prefect task run
                    if every(step, config.trainer.test_freq, session.total_steps):
                        metrics.update(session.validate())
                    session.record(step, batch, metrics)

        # 4. The final policy.
        session.finish()
        return session.result()


_LOOPS = {"running": 0, "threads": 0}  # the training loops in this process (a sweep runs several), torch's threads
_LOOPS_LOCK = threading.Lock()


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """The controller's own maths during the loop (the reward, the advantage, the metrics) are on tensors of a few
    thousand numbers: torch runs them on one thread while any loop of this process runs. With one per core, each op
    large enough to run in parallel leaves the other thread spinning, on the cores the workers train on (measured on
    2 cores: ~11 ms of CPU per step of a small run; bench/README.md). The count is restored after the last loop."""
    import torch

    with _LOOPS_LOCK:
        if _LOOPS["running"] == 0:
            _LOOPS["threads"] = torch.get_num_threads()
            torch.set_num_threads(1)
        _LOOPS["running"] += 1
    try:
        yield
    finally:
        with _LOOPS_LOCK:
            _LOOPS["running"] -= 1
            if _LOOPS["running"] == 0:
                torch.set_num_threads(_LOOPS["threads"])


def load_inputs(config: DictConfig) -> TrainingInputs:
    """The demo's assets when no model is named (built once, cached), then the model's tokenizer, the data and the
    reward, each checked (loaded already when ``ppoflow train`` prestarted this run: flows/prestart.py)."""
    prestart.wait(inputs_only=True)  # a prestart building the demo's assets finishes first
    apply_embedded_defaults(config)
    check_run_inputs(config, tokenize=False)
    return prestart.claim_inputs(config) or TrainingInputs.load(config)


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
    ``["algorithm.adv_estimator=gae"]``; ``ppoflow config`` lists every key); ``tags`` go on the MLflow run. Returns
    the run summary.

    A failed run's state message is the cause in one line (the full traceback is in the flow run's logs)."""
    composed_from = training_overrides(settings, overrides)
    config = compose_config(composed_from)  # a wrong key or type fails here
    view = PrefectRunView()
    view.log(
        f"ppoflow: {config.algorithm.adv_estimator} on "
        f"{config.actor_rollout_ref.model.path or 'the embedded tiny model'}, "
        f"{config.trainer.total_training_steps or 'all'} steps (at most {config.trainer.total_epochs} epochs)"
    )
    try:
        return run_training(config, {**provenance_tags(composed_from), **(tags or {})})
    except Exception as error:
        view.failure(error)
        return Failed(message=one_line(error), data=error)


def summary_line(result: dict[str, Any]) -> str:
    return json.dumps(result, default=str)
