"""Optimizer and learning-rate schedule from an ``optim`` config node (verl's keys).

Schedules (``lr_scheduler_type``), with w warm-up steps and N total steps, as multipliers of ``lr``:
  constant  s / w during warm-up, then 1
  cosine    s / w during warm-up, then min_lr_ratio + (1 - min_lr_ratio) (1 + cos(2 pi num_cycles p)) / 2,
            p = (s - w) / (N - w)
w = ``lr_warmup_steps`` when >= 0, else ``lr_warmup_steps_ratio`` x N.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


def build_optimizer(parameters: Iterable[torch.nn.Parameter], optim_config: Any) -> torch.optim.AdamW:
    """AdamW over the trainable parameters. On the CPU its fused kernel (torch's default there is a Python loop over
    the tensors: 3.5x slower a step, 137 vs 39 ms for a 24M-parameter model; TRL's default is the fused one too); on
    accelerators torch's own choice."""
    trainable = [p for p in parameters if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameter (is everything frozen?)")
    betas = tuple(optim_config.betas)
    on_cpu = all(p.device.type == "cpu" for p in trainable)
    return torch.optim.AdamW(
        trainable,
        lr=float(optim_config.lr),
        betas=betas,
        weight_decay=float(optim_config.weight_decay),
        fused=True if on_cpu else None,
    )


def lr_multiplier(
    step: int, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0, num_cycles: float = 0.5
) -> float:
    """The factor applied to the base learning rate after ``step`` scheduler steps (see module doc)."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    raise ValueError(f"optim.lr_scheduler_type={schedule!r}; choose 'constant' or 'cosine'")


def apply_optim_settings(
    optimizer: torch.optim.Optimizer, lr_scheduler: torch.optim.lr_scheduler.LambdaLR, optim_config: Any
) -> None:
    """After a restore, the config's settings replace the checkpoint's: ``lr``, ``betas`` and ``weight_decay`` in
    every parameter group, and the schedule is the one ``lr_scheduler`` was built with (the config's warm-up, total
    steps and type) at the checkpoint's position s: group lr = ``optim.lr`` x multiplier(s). Adam's moments and step
    counts stay the checkpoint's. With the config a checkpoint was written under, nothing changes."""
    lr = float(optim_config.lr)
    lr_scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for group, multiplier in zip(optimizer.param_groups, lr_scheduler.lr_lambdas):
        group.update(
            lr=lr * multiplier(lr_scheduler.last_epoch),
            initial_lr=lr,
            betas=tuple(optim_config.betas),
            weight_decay=float(optim_config.weight_decay),
        )


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, optim_config: Any, total_steps: int | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    total = int(total_steps if total_steps is not None else optim_config.total_training_steps)
    warmup = int(optim_config.lr_warmup_steps)
    if warmup < 0:
        warmup = int(float(optim_config.lr_warmup_steps_ratio) * max(total, 0))
    schedule = optim_config.lr_scheduler_type
    if schedule == "cosine" and total <= 0:
        raise ValueError("optim.lr_scheduler_type=cosine needs optim.total_training_steps > 0")
    lr_multiplier(warmup, schedule, warmup, total)  # validates the schedule name now, not at the first step
    min_lr_ratio = float(optim_config.min_lr_ratio)
    num_cycles = float(optim_config.num_cycles)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, schedule, warmup, total, min_lr_ratio, num_cycles)
    )
