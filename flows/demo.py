"""The embedded default's assets, built once and cached: a tiny Qwen2 warm-started by SFT on the synthetic task
(``data.synthetic.task``: so that RL starts from a policy that sometimes succeeds), and the task's train/val files.

The calc task's warm start mixes direct answers and calculator calls (``CALC_SFT_TOOL_SHARE``): the policy starts out
calling the tool in some samples and answering directly (2-digit products are beyond it) in the others, and the
outcome reward then favours the calls that are copied right.

The shapes task's model is a tiny Qwen2.5-VL whose warm start answers with the colour of a shape of the image picked at
random (not the largest's): it learns to look and to answer with a colour it sees, right about a third of the time;
which shape the question asks for is what RL teaches."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from omegaconf import DictConfig

from rl_core.data.rows import write_rows
from rl_core.data.synthetic import addition_rows, calc_rows, calc_transcript, shapes_rows

DEMO_VERSION = "v2"  # v2: the SFT warm start no longer depends on data.synthetic.train_size
SFT_STEPS, SFT_BATCH, SFT_LR = 60, 64, 3e-3
SFT_ROWS = 2000  # the warm start's own problems: the cached model is the same whatever data.synthetic.train_size is
CALC_MODEL, CALC_SFT_STEPS, CALC_SFT_LR = {"hidden_size": 128, "num_layers": 2}, 600, 1e-3
# the calc warm start: at lr 1e-3 (6e-3 never learnt to copy) 600 steps teach the tiny model to copy the operands into
# its call and the calculator's answer into its last turn; 30% of its traces call (the others answer directly, wrongly
# on new problems), so the policy starts out calling in about a quarter of its answers and RL finds the calls (README)
CALC_SFT_TOOL_SHARE = 0.3
SHAPES_FAMILY = "qwen2_5_vl"  # the visual demo's model (rl_core.models.tiny_vlm)


def demo_dir(config: DictConfig) -> Path:
    synthetic = config.data.synthetic
    name = (
        f"demo-{DEMO_VERSION}-max{synthetic.max_operand}"
        if synthetic.task == "addition"
        else f"demo-v1-{synthetic.task}"
    )
    return Path(config.trainer.cache_dir).expanduser() / name


def task_rows(config: DictConfig, count: int, split: str) -> list[dict]:
    synthetic = config.data.synthetic
    if synthetic.task == "calc":
        return calc_rows(count, seed=0, split=split)
    if synthetic.task == "shapes":
        return shapes_rows(count, seed=0, split=split)
    return addition_rows(count, seed=0, max_operand=synthetic.max_operand, split=split)


def ensure_demo_data(config: DictConfig) -> tuple[str, str]:
    """(train file, val file) of the synthetic task, written once."""
    folder = demo_dir(config)
    synthetic = config.data.synthetic
    train = folder / f"train-{synthetic.train_size}.parquet"
    val = folder / f"val-{synthetic.val_size}.parquet"
    if not train.exists():
        write_rows(task_rows(config, synthetic.train_size, "train"), train)
    if not val.exists():
        write_rows(task_rows(config, synthetic.val_size, "val"), val)
    return str(train), str(val)


def sft_examples(config: DictConfig) -> list:
    """The warm start's traces: the answers (addition); a mix of direct answers and calculator calls (calc); the colour
    of a shape picked at random, with the image (shapes)."""
    from rl_core.sft import SFTExample

    if config.data.synthetic.task == "shapes":
        from rl_core.data.images import row_images

        rng = random.Random(0)
        return [
            SFTExample(row["prompt"], rng.choice(row["extra_info"]["colours"]), tuple(row_images(row, "images", "sft")))
            for row in shapes_rows(SFT_ROWS, seed=0, split="sft")
        ]
    calc = config.data.synthetic.task == "calc"
    # the calc traces come from problems of their own: direct answers learnt by heart would leak into RL's
    rows = task_rows(config, SFT_ROWS, "sft" if calc else "train")
    if not calc:
        return [SFTExample(row["prompt"], row["reward_model"]["ground_truth"]) for row in rows]
    tool_rows = int(len(rows) * CALC_SFT_TOOL_SHARE)
    return [SFTExample(row["prompt"], calc_transcript(row, i >= len(rows) - tool_rows)) for i, row in enumerate(rows)]


def ensure_demo_model(config: DictConfig, log=print) -> str:
    """The SFT-warm-started tiny model's folder, built on first use (a few seconds on CPU)."""
    target = demo_dir(config) / "tiny-sft"
    if (target / "config.json").exists():
        return str(target)
    # the model code only when the model is built (the controller never loads one)
    from rl_core.config import (
        ModelConfig,
    )
    from rl_core.models.loading import load_policy_model, load_policy_processor
    from rl_core.models.tiny import make_tiny_model
    from rl_core.models.tiny_vlm import make_tiny_vlm
    from rl_core.sft import run_sft

    staging = target.with_name("tiny-sft.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    synthetic = config.data.synthetic
    calc = synthetic.task == "calc"
    shape = CALC_MODEL if calc else {}
    if synthetic.task == "shapes":
        make_tiny_vlm(staging, family=SHAPES_FAMILY, seed=0)
    else:
        make_tiny_model(staging, seed=0, max_operand=synthetic.max_operand, task=synthetic.task, **shape)
    model_config = ModelConfig(path=str(staging))
    model, tokenizer = load_policy_model(model_config)
    processor = load_policy_processor(model_config, tokenizer)
    steps, lr = (CALC_SFT_STEPS, CALC_SFT_LR) if calc else (SFT_STEPS, SFT_LR)
    log(f"[demo] warm-starting the tiny model with {steps} SFT steps (once; cached in {target})")
    examples = sft_examples(config)
    losses = run_sft(model, tokenizer, examples, steps=steps, batch_size=SFT_BATCH, lr=lr, seed=0, processor=processor)
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
