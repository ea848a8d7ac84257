"""Partial rollout (verl's ``async_training.partial_rollout``): a generation on a rollout of its own takes newer
weights between two tokens instead of finishing with the ones it started with.

When the actor sends newer weights to a rollout worker that is generating (a rendezvous transport announces them
first: ``infra.weight_transport.CollectiveTransport.offered``), the engine stops after the current token, the worker
loads them, and the unfinished responses go on from where they stopped (prompt and tokens so far read again under the
new weights), each token tagged with the version of the weights that sampled it (``TokenSample.versions``, then the
batch's per-token ``rollout_version``; a multi-turn trajectory's turns carry theirs: rl_core/agent/runner.py). The
trainer then waits one token for the rollout worker, not for the rest of the generations it has queued
(rl_core/separate_rollout.py); the samples are fresher, their early tokens older.
"""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_S = 0.005  # how often a generation asks whether newer weights are offered (a round trip to the channel's store)


class NewerWeights:
    """What a generation asks between two tokens: the version of the weights it holds (``held``), whether the actor
    offers newer ones (``offered``: their version; asked at most every ``every_s``), and to take them (``take``: loads
    them, returns their version)."""

    def __init__(
        self, held: Callable[[], int], offered: Callable[[], int], take: Callable[[], int], every_s: float = POLL_S
    ):
        self.held, self.offered, self.take, self.every_s = held, offered, take, every_s
        self.asked_at = float("-inf")

    def waiting(self) -> bool:
        """Whether newer weights than the held ones are being offered (False until ``every_s`` since last asked)."""
        now = time.monotonic()
        if now - self.asked_at < self.every_s:
            return False
        self.asked_at = now
        return self.offered() > self.held()
