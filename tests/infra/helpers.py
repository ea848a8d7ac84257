"""A tiny role class for infra tests: records calls, sleeps on demand, and reports its rank's shard."""

import os
import time

import torch

from rl_core.batch import Batch
from rl_core.workers.dispatch import DP_COMPUTE, ONE_TO_ALL, RANK_ZERO, dispatch


class EchoWorker:
    def __init__(self, tag: str = "echo"):
        self.tag = tag
        self.steps_trained = 0

    @dispatch(ONE_TO_ALL)
    def whoami(self):
        return {"tag": self.tag, "pid": os.getpid(), "rank": int(os.environ.get("RANK", 0))}

    @dispatch(RANK_ZERO)
    def rank_zero_only(self):
        return int(os.environ["RANK"])

    @dispatch(DP_COMPUTE)
    def double(self, batch: Batch) -> Batch:
        rank = int(os.environ.get("RANK", 0))
        return Batch({"doubled": batch.tensors["x"] * 2, "rank": torch.full((len(batch),), rank)})

    @dispatch(ONE_TO_ALL)
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        self.steps_trained += 1
        return seconds
