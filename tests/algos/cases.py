"""Random inputs for the algorithm tests: uneven groups, single-sample groups, and masks of every shape."""

from __future__ import annotations

import numpy as np
import torch

PADDINGS = ("right", "left", "holes")


def make_mask(generator: torch.Generator, batch: int, length: int, padding: str) -> torch.Tensor:
    """(batch, length) 0/1 mask; each row has at least one valid token.

    right: valid prefix (a response then padding); left: valid suffix; holes: random gaps (multi-turn tool output).
    """
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    positions = torch.arange(length).unsqueeze(0)
    if padding == "right":
        return (positions < lengths.unsqueeze(1)).float()
    if padding == "left":
        return (positions >= (length - lengths).unsqueeze(1)).float()
    mask = (torch.rand(batch, length, generator=generator) > 0.3).float()
    mask[torch.arange(batch), torch.randint(0, length, (batch,), generator=generator)] = 1.0
    return mask


def make_groups(generator: torch.Generator, batch: int, min_size: int = 1) -> np.ndarray:
    """uid strings with uneven group sizes (some of size 1 when min_size is 1), shuffled."""
    sizes: list[int] = []
    while sum(sizes) < batch:
        sizes.append(int(torch.randint(min_size, 5, (1,), generator=generator)))
    sizes[-1] -= sum(sizes) - batch
    if sizes[-1] < min_size:  # fold a too-small last group into the one before
        too_small = sizes.pop()
        sizes[-1] += too_small
    ids = [f"uid-{group}" for group, size in enumerate(sizes) for _ in range(size)]
    order = torch.randperm(batch, generator=generator).tolist()
    return np.array([ids[i] for i in order], dtype=object)


def outcome_rewards(generator: torch.Generator, mask: torch.Tensor, levels: int = 3) -> torch.Tensor:
    """Score in {0, .., levels-1} on each row's last valid token, zero elsewhere (an outcome reward)."""
    batch, length = mask.shape
    last = (mask * torch.arange(length)).argmax(dim=-1)
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), last] = torch.randint(0, levels, (batch,), generator=generator).float()
    return rewards


CASES = [(seed, padding) for seed in range(4) for padding in PADDINGS]
