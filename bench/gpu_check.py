"""GPU check: GRPO steps through rl_core's workers on one GPU, in bf16, checked against a float32 CPU reference.

    python bench/gpu_check.py                 # on a GPU: a Qwen2-0.5B-shaped model (random init), bf16, ~1-2 min
    python bench/gpu_check.py --device cpu    # tiny sizes on the CPU (CI runs this): the same code paths, seconds
    python bench/gpu_check.py --out $OUT      # also writes gpu_check.log (all it prints) and gpu_check.json there

It needs only torch, transformers, peft and safetensors (what a bare GPU machine has): no Ray, Prefect, MLflow, vLLM,
OmegaConf or pyarrow, and no network — the model, its tokenizer and the prompts (the demo's addition task) are built
here. It runs rl_core's own step (:func:`rl_core.ppo_step.run_ppo_step`) on in-process workers.

1. Numbers: a tiny model's response log-probs and one actor update computed on ``--device`` in bf16 against the same
   in float32 on the CPU (``parity/*``: the largest log-prob difference, the relative difference of the weight update).
2. Speed: ``--steps`` GRPO steps of the larger model (verl's defaults with a KL loss and a reference policy, one PPO
epoch),
   the first a warm-up; per-step medians of rollout tokens/s (valid response tokens / generate time), training tokens/s
   (tokens of the batch / update_actor time), ``perf/mfu/actor`` and the peak CUDA memory (peak RSS on the CPU).

Prints a table and a final JSON line; exits 1 when the numbers disagree beyond bf16's precision.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_core.algos.kl import get_kl_controller  # noqa: E402
from rl_core.batch import Batch  # noqa: E402
from rl_core.batch_fields import ADVANTAGES, ATTENTION_MASK, OLD_LOG_PROBS, REF_LOG_PROB, RESPONSE_MASK  # noqa: E402
from rl_core.config import RESOLVERS, PPOTrainerConfig  # noqa: E402
from rl_core.data.dataset import RLDataset  # noqa: E402
from rl_core.data.rows import write_rows  # noqa: E402
from rl_core.data.sampler import ResumableSampler  # noqa: E402
from rl_core.data.synthetic import addition_rows  # noqa: E402
from rl_core.models.tiny import make_tiny_model  # noqa: E402
from rl_core.ppo_step import StepWorkers, run_ppo_step, use_reference  # noqa: E402
from rl_core.reward.manager import RewardManager  # noqa: E402
from rl_core.workers import ActorRolloutRefWorker  # noqa: E402

# Qwen2-0.5B's dimensions (random weights: nothing is downloaded)
QWEN2_05B = {
    "hidden_size": 896,
    "num_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
}
TINY = {"hidden_size": 64, "num_layers": 2}
# (model shape, prompts per step, samples per prompt, response tokens) of the speed part, per device
WORKLOADS = {"cuda": (QWEN2_05B, 64, 4, 128), "cpu": (TINY, 4, 2, 8)}
LOG_PROB_TOLERANCE = 0.15  # bf16 has 8 mantissa bits: log-probs agree to ~1e-2 on the tiny model
UPDATE_TOLERANCE = 0.25  # relative difference of the bf16 and float32 weight updates


def resolve_interpolations(node: object, root: object) -> None:
    """Replace rl_core.config's ``"${a.b}"`` and ``"${resolver:${a.b}}"`` defaults by the values they name (what
    OmegaConf does, which this script does without)."""
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if dataclasses.is_dataclass(value):
            resolve_interpolations(value, root)
        elif isinstance(value, str) and value.startswith("${") and value.endswith("}"):
            setattr(node, field.name, interpolated(value, root))


def interpolated(value: str, root: object) -> object:
    """The value of one interpolation: a key's (``${a.b}``) or a resolver's of its argument (``${name:ARG}``)."""
    name, colon, argument = value[2:-1].partition(":")
    if colon:
        return RESOLVERS[name](interpolated(argument, root) if argument.startswith("${") else argument)
    target = root
    for part in name.split("."):
        target = getattr(target, part)
    return target


def run_config(
    model_path: Path, data_path: Path, prompts: int, n: int, response_length: int, compute_dtype: str
) -> PPOTrainerConfig:
    """The default config (verl's) as GRPO with a KL loss (so a reference policy too), with this check's model, data and
    sizes (micro-batches of 16 responses per update, 32 per log-prob pass)."""
    config = PPOTrainerConfig()
    config.algorithm.adv_estimator = "grpo"
    config.actor_rollout_ref.actor.use_kl_loss = True
    config.actor_rollout_ref.model.path = str(model_path)
    config.data.train_files = str(data_path)
    config.data.train_batch_size = config.actor_rollout_ref.actor.ppo_mini_batch_size = prompts
    config.data.max_prompt_length = 64
    config.data.max_response_length = response_length
    config.actor_rollout_ref.rollout.n = n
    config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 16
    config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = (
        config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
    ) = 32
    config.actor_rollout_ref.actor.optim.lr = 1e-5
    config.actor_rollout_ref.actor.fsdp_config.dtype = compute_dtype
    resolve_interpolations(config, config)
    resolve_interpolations(config, config)  # an interpolation naming another one
    return config


def digit_share(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """A reward that varies between a random model's samples (the task's own is ~0 for all of them): the share of
    digits in the response."""
    return sum(c.isdigit() for c in solution_str) / (len(solution_str) + 1)


def build_worker(config: PPOTrainerConfig, device: str) -> ActorRolloutRefWorker:
    role = "actor_rollout_ref" if use_reference(config) else "actor_rollout"
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role, device=device)
    worker.init_model()
    return worker


# ---------------------------------------------------------------------------------------------- 1. numbers
def parity(folder: Path, data_path: Path, device: str) -> dict[str, float]:
    """bf16 on ``device`` against float32 on the CPU: log-probs of the same sequences, and one update from the same
    weights."""
    model_path = make_tiny_model(folder / "parity-model", seed=0)
    reference_config = run_config(model_path, data_path, 4, 2, 8, "float32")
    reference = build_worker(reference_config, "cpu")
    checked = build_worker(run_config(model_path, data_path, 4, 2, 8, "bfloat16"), device)
    data = RLDataset(str(data_path), reference.tokenizer, reference_config.data)
    sequences = reference.generate_sequences(data.collate([0, 1, 2, 3], uid_prefix="p-").repeat_interleave(2))
    mask = sequences.tensors[RESPONSE_MASK].bool()
    expected = reference.compute_log_prob(sequences).tensors[OLD_LOG_PROBS]
    got = checked.compute_log_prob(sequences).tensors[OLD_LOG_PROBS]
    log_prob_error = float((expected - got)[mask].abs().max())

    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    update = sequences.union(Batch({OLD_LOG_PROBS: expected, ADVANTAGES: advantages, REF_LOG_PROB: expected}))
    deltas = []
    for worker in (reference, checked):
        before = {k: v.detach().float().cpu().clone() for k, v in worker.module.state_dict().items()}
        worker.update_actor(update)
        deltas.append(
            torch.cat([(v.detach().float().cpu() - before[k]).flatten() for k, v in worker.module.state_dict().items()])
        )
    update_error = float((deltas[0] - deltas[1]).norm() / deltas[0].norm())
    return {
        "parity/max_log_prob_error": log_prob_error,
        "parity/update_relative_error": update_error,
        "parity/ok": float(log_prob_error < LOG_PROB_TOLERANCE and update_error < UPDATE_TOLERANCE),
    }


# ---------------------------------------------------------------------------------------------- 2. speed
def speed(folder: Path, data_path: Path, device: str, steps: int) -> dict[str, float]:
    shape, prompts, n, response_length = WORKLOADS[device]
    shape = dict(shape)
    model_path = make_tiny_model(
        folder / "model", seed=0, hidden_size=shape.pop("hidden_size"), num_layers=shape.pop("num_layers"), **shape
    )
    config = run_config(model_path, data_path, prompts, n, response_length, "auto")
    worker = build_worker(config, device)
    data = RLDataset(str(data_path), worker.tokenizer, config.data)
    sampler = ResumableSampler(len(data), prompts, True, 0)
    reward = RewardManager(worker.tokenizer, digit_share, config.reward, config.data)
    kl_controller = get_kl_controller(config.algorithm.kl_ctrl)
    rows = []
    for step in range(1, steps + 1):
        started = time.perf_counter()
        batch, metrics = run_ppo_step(config, StepWorkers(actor=worker), data, sampler, reward, kl_controller, step)
        rows.append(
            {
                "step_s": time.perf_counter() - started,
                "rollout_tokens_per_s": float(batch.tensors[RESPONSE_MASK].sum()) / metrics["timing_s/gen"],
                "train_tokens_per_s": float(batch.tensors[ATTENTION_MASK].sum()) / metrics["timing_s/update_actor"],
                "rollout_probs_diff_max": metrics[
                    "training/rollout_probs_diff_max"
                ],  # bf16 sampling vs bf16 recomputation
                "mfu": metrics.get("perf/mfu/actor"),  # None on the CPU or an unknown GPU (rl_core.models.flops)
                "peak_memory_gb": metrics.get(
                    "perf/max_memory_allocated_gb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
                ),
            }
        )
        print(f"step {step}: " + "  ".join(f"{k} {v:.4g}" for k, v in rows[-1].items() if v is not None), flush=True)
    measured = rows[1:] or rows  # the first step warms up (allocator, kernels, compilation)
    result = {
        key: statistics.median(r[key] for r in measured)
        for key in ("step_s", "rollout_tokens_per_s", "train_tokens_per_s")
    }
    result["rollout_probs_diff_max"] = max(r["rollout_probs_diff_max"] for r in measured)
    result["mfu"] = statistics.median(r["mfu"] for r in measured) if measured[0]["mfu"] is not None else None
    result["peak_memory_gb"] = max(r["peak_memory_gb"] for r in rows)
    result["parameters_m"] = sum(p.numel() for p in worker.module.parameters()) / 1e6
    return result


class Tee:
    """A text stream writing to several (the console and the log file)."""

    def __init__(self, *streams: Any):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps of the speed part (the first is a warm-up)")
    parser.add_argument("--out", type=Path, help="a folder for gpu_check.log (everything printed) and gpu_check.json")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU here; run with --device cpu")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        log = open(args.out / "gpu_check.log", "w")  # noqa: SIM115 (open until the process ends)
        sys.stdout, sys.stderr = Tee(sys.stdout, log), Tee(sys.stderr, log)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data_path = write_rows(addition_rows(512, seed=0, max_operand=9), folder / "train.jsonl")
        result = {
            "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            **parity(folder, data_path, args.device),
            **speed(folder, data_path, args.device, args.steps),
        }
    result["wall_s"] = time.perf_counter() - started
    print(f"\n{'figure':32} value")
    for key, value in result.items():
        print(f"{key:32} {value:.4g}" if isinstance(value, float) else f"{key:32} {value}")
    print(json.dumps(result))
    if args.out is not None:
        (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    return 0 if result["parity/ok"] == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
