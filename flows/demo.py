"""The embedded default's assets, built once and cached: a tiny Qwen2 warm-started by SFT on the synthetic
addition task (so that RL starts from a policy that sometimes succeeds), and the task's train/val files."""

from __future__ import annotations

import shutil
from pathlib import Path

from omegaconf import DictConfig

from rl_core.data.dataset import write_rows
from rl_core.data.synthetic import addition_rows

DEMO_VERSION = "v2"  # v2: the SFT warm start no longer depends on data.synthetic.train_size
SFT_STEPS, SFT_BATCH, SFT_LR = 60, 64, 3e-3
SFT_ROWS = 2000  # the warm start's own problems: the cached model is the same whatever data.synthetic.train_size is


def demo_dir(config: DictConfig) -> Path:
    return Path(config.trainer.cache_dir).expanduser() / f"demo-{DEMO_VERSION}-max{config.data.synthetic.max_operand}"


def ensure_demo_data(config: DictConfig) -> tuple[str, str]:
    """(train file, val file) of the synthetic task, written once."""
    folder = demo_dir(config)
    synthetic = config.data.synthetic
    train = folder / f"train-{synthetic.train_size}.parquet"
    val = folder / f"val-{synthetic.val_size}.parquet"
    if not train.exists():
        write_rows(addition_rows(synthetic.train_size, seed=0, max_operand=synthetic.max_operand, split="train"), train)
    if not val.exists():
        write_rows(addition_rows(synthetic.val_size, seed=0, max_operand=synthetic.max_operand, split="val"), val)
    return str(train), str(val)


def ensure_demo_model(config: DictConfig, log=print) -> str:
    """The SFT-warm-started tiny model's folder, built on first use (a few seconds on CPU)."""
    target = demo_dir(config) / "tiny-sft"
    if (target / "config.json").exists():
        return str(target)
    # the model code only when the model is built (the controller never loads one)
    from rl_core.config import (
        ModelConfig,
    )
    from rl_core.models.loading import load_policy_model
    from rl_core.models.tiny import make_tiny_model
    from rl_core.sft import SFTExample, run_sft

    staging = target.with_name("tiny-sft.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    make_tiny_model(staging, seed=0, max_operand=config.data.synthetic.max_operand)
    model, tokenizer = load_policy_model(ModelConfig(path=str(staging)))
    rows = addition_rows(SFT_ROWS, seed=0, max_operand=config.data.synthetic.max_operand, split="train")
    examples = [SFTExample(row["prompt"], row["reward_model"]["ground_truth"]) for row in rows]
    log(f"[demo] warm-starting the tiny model with {SFT_STEPS} SFT steps (once; cached in {target})")
    losses = run_sft(model, tokenizer, examples, steps=SFT_STEPS, batch_size=SFT_BATCH, lr=SFT_LR, seed=0)
    log(f"[demo] SFT loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    staging.rename(target)
    return str(target)


def apply_embedded_defaults(config: DictConfig, log=print) -> None:
    """Fill ``model.path`` / ``data.*_files`` left null with the demo's (in place)."""
    if config.data.train_files is None or config.data.val_files is None:
        train, val = ensure_demo_data(config)
        config.data.train_files = config.data.train_files or train
        config.data.val_files = config.data.val_files or val
    if config.actor_rollout_ref.model.path is None:
        path = ensure_demo_model(config, log)
        config.actor_rollout_ref.model.path = path
        if config.critic.model.path is None:
            config.critic.model.path = path
