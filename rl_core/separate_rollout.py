"""Generation on a rollout of its own (separate resource pools): each step's prompts generated on the rollout's
workers, up to a window of steps ahead of the trainer.

With ``rollout.n_gpus_per_node > 0`` the step's generation runs on rollout workers that hold copies of the policy,
synced from the actor (:mod:`rl_core.weight_sync`) when behind. The schedule (``async_training.*``) is a window of
steps (:mod:`rl_core.rollout_schedule`): as step k starts, every step up to the window's last that has not started
generating is launched, each on the rollout worker with the fewest generations not yet taken, in a thread per worker
(a worker generates one step at a time, in launch order); the worker first takes the actor's weights as they are
now when it holds older ones. Then the step takes its own generation, waiting for it if it is not done.

* ``sync`` (window 1): each step launches and takes its own: the colocated run's samples, exactly;
* ``one_step_off`` (window 2): step k launches step k+1's generation, which overlaps step k's training;
* ``fully_async``: wider windows, weights synced every ``trigger_parameter_sync_step`` steps, several workers.

Step k+j's prompts are read from a copy of the sampler, so a checkpoint after step k holds the sampler as of step k:
a resumed run draws step k+1's prompts again and generates them anew (the generations in flight are lost; no prompt is
skipped or trained twice).

With a rendezvous transport (``checkpoint_engine.backend`` gloo / nccl: a broadcast over a channel of the actor and
each rollout worker, opened as the workers start) the actor sends while the worker receives: a worker that is behind
takes its weights after the generations it has queued, and the trainer waits for that before it goes on (verl's
collective sync waits for the rollout's generations in flight the same way); with Ray's object store it never waits.
With partial rollout (``async_training.partial_rollout``, a rendezvous transport) the worker's generation in flight
takes them between two tokens instead (:mod:`rl_core.rollout.partial`): the trainer waits for one token, and the
responses carry each token's version.

Every response token carries the version of the weights that sampled it (``rollout_version``); ``training/
staleness_*`` is the actor's version at the update minus a sample's oldest (at most the window minus one), and with
partial rollout ``fully_async/partial_ratio`` the share of samples whose tokens come from more than one version.
Correct for it with ``algorithm.rollout_correction``. The step's ``timing_s/gen`` is how long the trainer waited
for its samples, ``timing_s/generate_ahead`` how long a rollout worker worked on them (taking the weights included);
``fully_async/queue_depth`` the generations finished and waiting for their step, ``fully_async/in_flight`` those
still generating, both as the step took its own.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from rl_core.batch import Batch
from rl_core.batch_fields import RESPONSE_MASK, ROLLOUT_VERSION, UID
from rl_core.rollout_schedule import GenerationWindow
from rl_core.weight_sync import WeightsUpdate

RECEIVER_FAILURE_WAIT_S = 10.0  # a failed send: how long to wait for the receiver's own error (a death shows in ms)


@dataclass
class RolloutWorker:
    """One rollout worker (a replica of the policy): its role object, the thread that calls it, the weights' version
    it holds (or will, once its queued work has run), how many of its generations are not taken yet."""

    role: Any
    thread: ThreadPoolExecutor
    version: int
    untaken: int = 0
    last_launch: int = 0  # the launch count when it last got one (ties go to the longest unused)


@dataclass
class Pending:
    """A generation launched: the worker and weights' version it runs with, its future, its tracker (or None)."""

    worker: RolloutWorker
    version: int
    future: Future
    tracker: Any = None

    def finish(self, error: BaseException | None = None, dropped: bool = False) -> None:
        self.worker.untaken -= 1
        if self.tracker is not None:
            self.tracker.done(error, dropped)


class SeparateRollout:
    """The steps' generations on the rollout's workers (see the module docstring). ``generate(rollout, prompts)`` is
    the step's generation stage called on a rollout worker's role."""

    def __init__(
        self,
        actor: Any,
        rollouts: list[Any],
        window: GenerationWindow,
        generate: Callable[[Any, Batch], Batch],
        track: Callable[[str], Any] | None = None,
        rendezvous: bool = False,
        partial_rollout: bool = False,
    ):
        """``track(name)``, when given, is called as a generation is launched and returns an object whose
        ``done(error, dropped)`` is called when its result is taken or dropped: the flow reports it as a task run.
        ``rendezvous``: the workers' weight transport is one (the channels are connected here); ``partial_rollout``:
        the workers' generations take newer weights between two tokens."""
        self.actor, self.window, self.generate, self.track = actor, window, generate, track
        self.rendezvous, self.partial_rollout = rendezvous, partial_rollout
        self.workers = [
            RolloutWorker(role, ThreadPoolExecutor(1, thread_name_prefix=f"ppoflow-rollout{i}"), role.weights_version())
            for i, role in enumerate(rollouts)
        ]
        if rendezvous:
            for index, worker in enumerate(self.workers):
                address = actor.open_weight_channel(index)
                joined = worker.thread.submit(worker.role.connect_weight_channel, address)
                actor.connect_weight_channel(address, index)
                joined.result()
        self.pending: dict[tuple[str, ...], Pending] = {}  # by the prompts' uids
        self.launched_through = 0  # the last step whose generation was launched
        self.launches = 0
        self.actor_version = 0  # the actor's updates done, as the current step started
        self.exported: WeightsUpdate | None = None

    def steps_to_launch(self, step: int, last_step: int) -> list[int]:
        """As step ``step`` starts (before its own generation is taken): the steps whose generation the window lets
        start now, in order (this one's included when it has not started)."""
        self.actor_version = self.actor.weights_version()
        first = max(step, self.launched_through + 1)
        return list(range(first, min(self.window.last_launchable(step), last_step) + 1))

    def upcoming(self, sampler: Any, count: int) -> list[list[int]]:
        """The prompt indices of the sampler's next ``count`` batches, without moving it."""
        ahead = copy.deepcopy(sampler)
        return [ahead.next_batch() for _ in range(count)]

    def launch(self, prompts: Batch, step: int) -> None:
        """Start generating ``prompts`` (step ``step``'s) on the least busy worker, with the actor's weights as they
        are now (sent along when the worker holds older ones)."""
        self.launches += 1
        worker = min(self.workers, key=lambda w: (w.untaken, w.last_launch))
        worker.last_launch = self.launches
        version = self.actor_version
        update = None
        if version > worker.version and self.rendezvous:
            self._send_now(worker, version)
        elif version > worker.version:
            if self.exported is None or self.exported.version != version:
                self.exported = self.actor.export_weights()
            update = self.exported
        worker.version = version
        tracker = self.track(f"rollout-{step}/generate (policy v{version})") if self.track else None
        future = worker.thread.submit(self._receive_and_generate, worker.role, update, prompts)
        worker.untaken += 1
        self.pending[tuple(prompts.non_tensors[UID])] = Pending(worker, version, future, tracker)
        self.launched_through = max(self.launched_through, step)

    def _send_now(self, worker: RolloutWorker, version: int) -> None:
        """A rendezvous transport: the worker receives (in its thread, after the generations it has queued; with
        partial rollout, its generation in flight between two tokens, the queued receive then finding them there)
        while the actor sends; back when both are done (partial rollout: when the weights have arrived). A send that
        fails because the worker died raises the worker's death (the flow then rebuilds the rollout alone)."""
        received = worker.thread.submit(worker.role.receive_weights, WeightsUpdate(version, None))
        try:
            self.actor.export_weights(to=self.workers.index(worker))
        except BaseException as error:
            try:
                received.result(timeout=RECEIVER_FAILURE_WAIT_S)
            except FutureTimeout:
                pass
            except BaseException as cause:  # the receiver's own failure says why the channel broke
                raise cause from error
            raise
        if not self.partial_rollout:
            received.result()

    def _receive_and_generate(self, role: Any, update: WeightsUpdate | None, prompts: Batch) -> tuple[Batch, float]:
        """In the worker's thread: take the weights, generate; with the seconds it took (the worker busy)."""
        started = time.perf_counter()
        if update is not None:
            role.receive_weights(update)
        return self.generate(role, prompts), time.perf_counter() - started

    def take(self, prompts: Batch, step: int) -> tuple[Batch, dict[str, float]]:
        """The generation of ``prompts`` (launched now when it was not: a dynamic-sampling batch), tagged with its
        version, and the staleness and queue metrics."""
        key = tuple(prompts.non_tensors[UID])
        if key not in self.pending:
            self.launch(prompts, step)
        pending = self.pending.pop(key)
        try:
            batch, busy_s = pending.future.result()
        except BaseException as error:
            pending.finish(error)
            raise
        pending.finish()
        mask = batch.tensors[RESPONSE_MASK].bool()
        if ROLLOUT_VERSION not in batch.tensors:  # the whole generation ran with the weights it was launched with
            batch.tensors[ROLLOUT_VERSION] = torch.full(mask.shape, pending.version, dtype=torch.long)
        versions = batch.tensors[ROLLOUT_VERSION]
        oldest = torch.where(mask, versions, torch.iinfo(torch.long).max).min(-1).values
        oldest = torch.where(mask.any(-1), oldest, pending.version)  # a response without sampled tokens: its launch
        staleness = (self.actor_version - oldest).float()
        ready = sum(p.future.done() for p in self.pending.values())
        metrics = {
            "timing_s/generate_ahead": busy_s,
            "training/staleness_mean": staleness.mean().item(),
            "training/staleness_max": staleness.max().item(),
            "fully_async/queue_depth": float(ready),
            "fully_async/in_flight": float(len(self.pending) - ready),
        }
        if self.partial_rollout:
            newest = torch.where(mask, versions, -1).max(-1).values
            metrics["fully_async/partial_ratio"] = (newest > oldest).float().mean().item()
        return batch, metrics

    def close(self) -> None:
        """Drop the generations in flight (the run ended or failed) and the workers' threads."""
        for pending in self.pending.values():
            pending.future.cancel()
            pending.finish(dropped=True)
        self.pending = {}
        for worker in self.workers:
            worker.thread.shutdown(wait=False, cancel_futures=True)
