"""Generation on a rollout of its own (separate resource pools), synchronous or one step off the policy.

With ``rollout.n_gpus_per_node > 0`` the step's generation runs on the rollout's workers, which hold a copy of the
policy synced from the actor (:mod:`rl_core.weight_sync`) whenever it is behind. Two schedules
(``async_training.mode``):

* ``sync``: each step syncs the weights, then generates its prompts: the same samples as the colocated run.
* ``one_step_off`` (verl's one_step_off_policy recipe): step k takes the generation of its prompts that step k-1
  launched, syncs the weights (the actor has done k-1 updates), and launches step k+1's generation before its own
  stages run, so generation overlaps training. Step k's samples come from the policy after k-2 updates: one version
  behind the actor that trains on them (the first step generates its own). Step k+1's prompts are read from a copy of
  the sampler, so a checkpoint after step k holds the sampler as of step k: a resumed run draws step k+1's prompts
  again and generates them anew (the generation in flight is lost; no prompt is skipped or trained twice).

Every response carries the version of the weights that produced it (``rollout_version``); ``training/staleness_*``
is the actor's version at the update minus it. Correct for it with ``algorithm.rollout_correction``. The step's
``timing_s/gen`` is then how long the trainer waited for its samples, ``timing_s/generate_ahead`` how long the
rollout worked on them (taking the weights included).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from rl_core.batch import Batch
from rl_core.batch_fields import ROLLOUT_VERSION, UID
from rl_core.weight_sync import WeightsUpdate, sync_rollout_weights

SCHEDULES = ("sync", "one_step_off")


@dataclass
class Pending:
    """A generation in flight: its prompts' ids, the weights' version it runs with, its tracker (or None)."""

    uids: list[str]
    version: int
    future: Future
    tracker: Any = None

    def finish(self, error: BaseException | None = None, dropped: bool = False) -> None:
        if self.tracker is not None:
            self.tracker.done(error, dropped)


class SeparateRollout:
    """The step's generation on the rollout's workers (see the module docstring). ``generate(rollout, prompts)`` is
    the step's generation stage called on the rollout role; it runs in a thread of its own for one_step_off."""

    def __init__(
        self,
        actor: Any,
        rollout: Any,
        schedule: str,
        generate: Callable[[Any, Batch], Batch],
        track: Callable[[str], Any] | None = None,
    ):
        """``track(name)``, when given, is called as a one-step-off generation starts and returns an object whose
        ``done(error, dropped)`` is called when its result is taken or dropped: the flow reports it as a task run."""
        if schedule not in SCHEDULES:
            raise ValueError(f"async_training.mode={schedule!r}: choose one of {', '.join(SCHEDULES)}")
        self.actor, self.rollout, self.schedule, self.generate = actor, rollout, schedule, generate
        self.track = track
        self.pending: Pending | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppoflow-rollout")
        self.weights_synced = 0
        self.rollout_version = rollout.weights_version()  # the version it holds, or will once its pending work runs
        self.actor_version = 0

    def _synced_version(self) -> int:
        if sync_rollout_weights(self.actor, self.rollout):
            self.weights_synced += 1
        return self.rollout.weights_version()

    def _receive_and_generate(self, update: WeightsUpdate | None, prompts: Batch) -> tuple[Batch, float]:
        """In the rollout's thread: take the weights, generate; with the seconds it took (the rollout busy)."""
        started = time.perf_counter()
        if update is not None:
            self.rollout.receive_weights(update)
            self.weights_synced += 1
        return self.generate(self.rollout, prompts), time.perf_counter() - started

    def take(self, prompts: Batch) -> tuple[Batch, dict[str, float]]:
        """The generation of ``prompts``: the one launched for them, else made now with synced weights; tagged with
        its version, and the staleness metrics."""
        uids = list(prompts.non_tensors[UID])
        pending, self.pending = self.pending, None
        metrics: dict[str, float] = {}
        if pending is not None and pending.uids == uids:
            try:
                (batch, busy_s), version = pending.future.result(), pending.version
            except BaseException as error:
                pending.finish(error)
                raise
            pending.finish()
            metrics["timing_s/generate_ahead"] = busy_s
        else:
            if pending is not None:  # launched for other prompts (cannot happen within a run): not trained on
                pending.future.cancel()
                pending.finish(dropped=True)
            version = self.rollout_version = self._synced_version()
            batch = self.generate(self.rollout, prompts)
        batch.tensors[ROLLOUT_VERSION] = torch.full((len(batch),), version, dtype=torch.long)
        self.actor_version = self.actor.weights_version()  # what trains on the batch (launch() reuses it)
        staleness = self.actor_version - version
        metrics |= {"training/staleness_mean": float(staleness), "training/staleness_max": float(staleness)}
        return batch, metrics

    def launch(self, prompts: Batch, step: int) -> None:
        """one_step_off: start generating ``prompts`` (step ``step``'s) now, with the actor's current weights."""
        if self.schedule != "one_step_off":
            return
        # the actor's weights are exported now (before its next update changes them); the rollout takes them in the
        # background thread, before it generates
        version = self.actor_version  # take() just asked; no update since
        update = self.actor.export_weights() if version > self.rollout_version else None
        self.rollout_version = version
        tracker = self.track(f"rollout-{step}/generate (policy v{version})") if self.track else None
        future = self.executor.submit(self._receive_and_generate, update, prompts)
        self.pending = Pending(list(prompts.non_tensors[UID]), version, future, tracker)

    def upcoming(self, sampler: Any) -> list[int]:
        """The prompt indices the sampler gives next, without moving it."""
        return copy.deepcopy(sampler).next_batch()

    def close(self) -> None:
        """Drop a generation in flight (the run ended or failed) and the thread."""
        if self.pending is not None:
            self.pending.future.cancel()
            self.pending.finish(dropped=True)
            self.pending = None
        self.executor.shutdown(wait=False, cancel_futures=True)
