"""A deterministic, resumable order of dataset rows: epochs of seeded shuffles, consumed in batches.

The position (epoch, batch within the epoch) is the whole state: a resumed run that restores it gets the same
batches as an uninterrupted one.
"""

from __future__ import annotations

import torch


class ResumableSampler:
    """Yields lists of ``batch_size`` row indices; each epoch is a permutation seeded by (seed, epoch)."""

    def __init__(self, num_rows: int, batch_size: int, shuffle: bool = True, seed: int = 0):
        if batch_size > num_rows:
            raise ValueError(f"data.train_batch_size={batch_size} is larger than the dataset ({num_rows} rows)")
        self.num_rows, self.batch_size, self.shuffle, self.seed = num_rows, batch_size, shuffle, seed
        self.epoch, self.batch_in_epoch = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.num_rows // self.batch_size  # the incomplete last batch is dropped

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        return torch.randperm(
            self.num_rows, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        ).tolist()

    def next_batch(self) -> list[int]:
        """The next batch of indices, moving to the next epoch when this one is used up."""
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        start = self.batch_in_epoch * self.batch_size
        self.batch_in_epoch += 1
        return self._order(self.epoch)[start : start + self.batch_size]

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "num_rows": self.num_rows,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_rows"] != self.num_rows or state["seed"] != self.seed:
            raise ValueError(
                f"the checkpoint's data position is for {state['num_rows']} rows with seed {state['seed']}, this "
                f"dataset has {self.num_rows} rows with seed {self.seed}: resume with the same data and data.seed"
            )
        self.epoch, self.batch_in_epoch = state["epoch"], state["batch_in_epoch"]
