"""ppoflow against TRL on the demo task: the same SFT-warm-started tiny model, data, sizes and optimizer settings.

    pip install -e '.[bench]'          # TRL 0.29
    python bench/vs_trl.py [--steps 100] [--prompts 16] [--n 4] [--warmup 5] [--seed S [S ...]]

Rows (each run in a process of its own, one after the other), all with one PPO epoch, one mini-batch, no KL term,
``--prompts`` x ``--n`` responses per step of at most 8 new tokens (the demo's):
  * GRPO: ``ppoflow train`` (the Prefect flow on a Ray worker) and TRL's ``GRPOTrainer`` (``--n`` responses per prompt);
  * PPO with a critic: ppoflow's GAE and TRL's ``PPOTrainer`` (``trl.experimental.ppo``; TRL 1.x has no PPO trainer),
    one response per prompt. TRL's PPO takes a reward *model*: the bench gives it one that applies the demo's rule to
    the decoded response; it logs no token counts (no tokens/s).

For each: the median and the mean step time (the first ``--warmup`` steps left out; the mean counts the steps that
carry bursts of background work, which the median leaves out), tokens per second (prompt + response tokens
of a step / its time), the peak resident memory of all the run's processes together (ppoflow: the controller, its
Prefect server and the Ray cluster and workers; sampled every 0.2 s) and the greedy validation accuracy of the final
policy, computed for both by one function (:func:`greedy_accuracy`: ppoflow's own validation on an in-process
worker). With several ``--seed`` values each row runs once per seed (the rows alternated) and gives the median of
its runs' median steps and its mean accuracy. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


COMPUTE_BOUND_MODEL = {"hidden_size": 512, "num_layers": 6}  # a Qwen2 of ~24M parameters (with the demo tokenizer)


def demo_assets(cache: str, compute_bound: bool = False) -> tuple[str, str, str]:
    """(model folder, train file, val file) of the embedded demo, built once in ``cache``; ``compute_bound``: a
    randomly initialised ~24M-parameter Qwen2 with the demo's tokenizer instead of the SFT-warm-started tiny model."""
    from flows.config import compose_config
    from flows.demo import ensure_demo_data, ensure_demo_model
    from rl_core.models.tiny import make_tiny_model

    config = compose_config([f"trainer.cache_dir={cache}"])
    train, val = ensure_demo_data(config)
    if not compute_bound:
        return ensure_demo_model(config), train, val
    model = Path(cache) / "vs-trl-qwen2-24m"
    if not (model / "config.json").exists():
        make_tiny_model(model, seed=0, max_operand=config.data.synthetic.max_operand, **COMPUTE_BOUND_MODEL)
    return str(model), train, val


def greedy_accuracy(model_dir: str, val_file: str) -> float:
    """The greedy validation accuracy of the policy in ``model_dir`` as ppoflow's own validation computes it
    (rl_core.ppo_step.run_validation on an in-process worker: the same prompts, rollout and scorer)."""
    from flows.config import compose_config
    from rl_core.data.dataset import RLDataset
    from rl_core.ppo_step import StepWorkers, run_validation
    from rl_core.reward.manager import build_reward_manager
    from rl_core.workers import ActorRolloutRefWorker

    config = compose_config(
        ["+profile=demo", f"actor_rollout_ref.model.path={model_dir}", f"data.val_files={val_file}"]
    )
    config.actor_rollout_ref.actor.optim.total_training_steps = 1
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, "actor_rollout")
    worker.init_model()
    data = RLDataset(val_file, worker.tokenizer, config.data)
    metrics = run_validation(config, StepWorkers(actor=worker), data, build_reward_manager(config, worker.tokenizer))
    return next(value for key, value in metrics.items() if key.startswith("val-core/") and "/mean@" in key)


# ---------------------------------------------------------------------------------------------- the runs
# ppoflow's settings besides the workload's sizes (--settings): the demo profile's; the defaults (what a user's own
# model gets: verl's, micro-batches packed by tokens, gradient checkpointing and the old-log-prob pass where needed,
# rollout log-probs, balanced batches); and the defaults with TRL's equivalents where TRL's trainer differs (one
# micro-batch of the whole batch, no gradient checkpointing, the old log-probs from the update's own forward pass)
SETTINGS = {
    "demo": ["+profile=demo", "actor_rollout_ref.actor.recompute_old_log_prob=false"],
    "verl": [],
    "trl": [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1024",
        "critic.ppo_micro_batch_size_per_gpu=1024",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "critic.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.actor.recompute_old_log_prob=false",
    ],
}

# --bf16: ppoflow's passes in bf16 (verl's fsdp_config.dtype; auto is float32 on the CPU)
BF16_KEYS = ("actor_rollout_ref.actor.fsdp_config.dtype", "critic.fsdp.dtype")


def run_ppoflow(args: argparse.Namespace, folder: str, model: str, train: str, val: str, *algorithm: str) -> dict:
    """``ppoflow train`` (the flow on a Ray worker, as the command runs it) with one PPO epoch and one mini-batch, the
    demo's prompt and response lengths and learning rate (TRL's too), and ``--settings`` for the rest."""
    from mlflow.tracking import MlflowClient

    from flows.config import compose_config
    from flows.prefect_server import configure_prefect, start_temporary_server, stop_temporary_server
    from flows.train import train as train_flow

    configure_prefect()
    start_temporary_server()()  # the wait for it
    demo = compose_config([])
    overrides = [
        *SETTINGS[args.settings],
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"data.max_prompt_length={demo.data.max_prompt_length}",
        f"data.max_response_length={args.response_length or demo.data.max_response_length}",
        f"actor_rollout_ref.actor.optim.lr={demo.actor_rollout_ref.actor.optim.lr}",
        f"critic.optim.lr={demo.critic.optim.lr}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        f"trainer.total_training_steps={args.steps}",
        *[f"{key}={args.seed}" for key in ("data.seed", "actor_rollout_ref.rollout.seed") if args.seed is not None],
        *[f"{key}=bfloat16" for key in BF16_KEYS if args.bf16],
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        "trainer.log_samples_freq=-1",
        f"trainer.default_local_dir={folder}/checkpoints",
        f"trainer.tracking_uri=sqlite:///{folder}/mlflow.db",
        f"trainer.artifact_location={folder}/mlartifacts",
        *algorithm,
    ]
    try:
        result = train_flow(overrides=overrides)
    finally:
        stop_temporary_server()  # once it recorded the run's task runs, as the command stops it
    client = MlflowClient(result["tracking_uri"])
    step_s, tokens = (
        [m.value for m in sorted(client.get_metric_history(result["run_id"], name), key=lambda m: m.step)]
        for name in ("perf/time_per_step", "perf/total_num_tokens")
    )
    return {"step_s": step_s, "tokens": tokens, "model_dir": str(Path(result["checkpoint_dir"]) / "actor")}


def run_ppoflow_grpo(args: argparse.Namespace, folder: str, model: str, train: str, val: str) -> dict:
    return run_ppoflow(
        args,
        folder,
        model,
        train,
        val,
        "algorithm.adv_estimator=grpo",
        f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
    )


def run_ppoflow_ppo(args: argparse.Namespace, folder: str, model: str, train: str, val: str) -> dict:
    """PPO with a critic (GAE), one response per prompt: ``--prompts`` x ``--n`` prompts per step (as many responses
    as the GRPO rows), the critic updated on the same single mini-batch."""
    size = args.prompts * args.n
    return run_ppoflow(
        args,
        folder,
        model,
        train,
        val,
        "algorithm.adv_estimator=gae",
        f"data.train_batch_size={size}",
        "actor_rollout_ref.rollout.n=1",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={size}",
        f"critic.ppo_mini_batch_size={size}",
    )


class StepTimer(TrainerCallback):
    """Each step's time (between consecutive step ends, generation included) and tokens (the ``num_tokens`` TRL logs,
    where it logs them)."""

    def __init__(self) -> None:
        self.step_s, self.tokens, self.last, self.last_tokens = [], [], time.perf_counter(), 0.0

    def on_train_begin(self, *_, **__):
        self.last = time.perf_counter()

    def on_step_end(self, *_, **__):
        now = time.perf_counter()
        self.step_s.append(now - self.last)
        self.last = now

    def on_log(self, _args, _state, _control, logs=None, **__):
        if logs and "num_tokens" in logs:
            self.tokens.append(logs["num_tokens"] - self.last_tokens)
            self.last_tokens = logs["num_tokens"]


def run_trl_grpo(args: argparse.Namespace, folder: str, model: str, train: str, val: str) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from flows.config import compose_config
    from rl_core.data.rows import read_rows
    from rl_core.reward.scorers import default_compute_score

    demo = compose_config([])
    rows = [
        {"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"], "data_source": r["data_source"]}
        for r in read_rows(train)
    ]

    def rule_reward(completions, ground_truth, data_source, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(default_compute_score(s, t, g)) for s, t, g in zip(data_source, texts, ground_truth)]

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    config = GRPOConfig(
        output_dir=f"{folder}/trl",
        per_device_train_batch_size=args.prompts * args.n,
        num_generations=args.n,
        max_completion_length=args.response_length or demo.data.max_response_length,
        learning_rate=demo.actor_rollout_ref.actor.optim.lr,
        lr_scheduler_type="constant",
        beta=0.0,
        num_iterations=1,
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        loss_type="dapo",
        scale_rewards="group",
        use_cpu=True,
        bf16=args.bf16,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=args.seed or 0,
        disable_tqdm=True,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model),
        reward_funcs=rule_reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    trainer.save_model(f"{folder}/trl-final")
    tokenizer.save_pretrained(f"{folder}/trl-final")
    return {"step_s": timer.step_s, "tokens": timer.tokens, "model_dir": f"{folder}/trl-final"}


def run_trl_ppo(args: argparse.Namespace, folder: str, model: str, train: str, val: str) -> dict:
    """TRL 0.29's PPO trainer with a value model from the same checkpoint; its reward "model" applies the demo's rule
    (the answer to the prompt's a+b) to the decoded response, at the positions TRL reads the reward from."""
    import copy
    import re
    from types import SimpleNamespace

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from flows.config import compose_config
    from rl_core.data.dataset import RLDataset
    from rl_core.data.synthetic import DATA_SOURCE
    from rl_core.reward.scorers import default_compute_score

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    demo = compose_config([])
    prompts = RLDataset(train, tokenizer, demo.data).prompt_ids  # tokenized as ppoflow does (chat template)

    class RuleReward(torch.nn.Module):
        base_model_prefix = "backbone"

        def __init__(self):
            super().__init__()
            self.score = torch.nn.Identity()
            self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)  # so that .to(device) has a device

        def backbone(self, input_ids, attention_mask, **_):
            values = torch.zeros(*input_ids.shape, 1)
            ends = attention_mask & ~torch.nn.functional.pad(attention_mask[:, 1:], (0, 1), value=False)
            for row, end in ends.nonzero().tolist():
                text = tokenizer.decode(
                    input_ids[row, : end + 1][attention_mask[row, : end + 1]], skip_special_tokens=True
                )
                question, _, answer = text.rpartition("assistant\n")
                a, b = map(int, re.findall(r"(\d+)\+(\d+)=", question)[-1])
                values[row, end, 0] = float(default_compute_score(DATA_SOURCE, answer, str(a + b)))
            return SimpleNamespace(hidden_states=(values,))

    size = args.prompts * args.n
    config = PPOConfig(
        output_dir=f"{folder}/trl",
        per_device_train_batch_size=size,
        gradient_accumulation_steps=1,
        num_ppo_epochs=1,
        num_mini_batches=1,
        total_episodes=size * args.steps,
        local_rollout_forward_batch_size=size,
        response_length=args.response_length or demo.data.max_response_length,
        stop_token="eos",
        temperature=1.0,
        learning_rate=demo.actor_rollout_ref.actor.optim.lr,
        lr_scheduler_type="constant",
        kl_coef=0.0,
        num_sample_generations=0,
        use_cpu=True,
        bf16=args.bf16,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=args.seed or 0,
        disable_tqdm=True,
    )
    policy = AutoModelForCausalLM.from_pretrained(model)
    value = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1)
    value.config.pad_token_id = tokenizer.pad_token_id
    timer = StepTimer()
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=copy.deepcopy(policy),
        reward_model=RuleReward(),
        value_model=value,
        train_dataset=Dataset.from_list([{"input_ids": ids} for ids in prompts]),
        callbacks=[timer],
    )
    trainer.train()
    trainer.save_model(f"{folder}/trl-final")
    tokenizer.save_pretrained(f"{folder}/trl-final")
    return {"step_s": timer.step_s, "tokens": [], "model_dir": f"{folder}/trl-final"}


RUNS = {
    "ppoflow-grpo": run_ppoflow_grpo,
    "trl-grpo": run_trl_grpo,
    "ppoflow-ppo": run_ppoflow_ppo,
    "trl-ppo": run_trl_ppo,
}


# ---------------------------------------------------------------------------------------------- measuring
def tree_rss_bytes(root: int) -> int:
    from infra.watchdog import descendants, processes

    total = 0
    for pid in [root, *descendants(root, processes())]:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def measure(name: str, argv: list[str]) -> dict:
    """Run ``name`` in a child process; its result plus the peak RSS of its process tree."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        child = subprocess.Popen([sys.executable, __file__, "--one", name, "--out", out.name, *argv], cwd=ROOT)
        peak = 0
        while child.poll() is None:
            peak = max(peak, tree_rss_bytes(child.pid))
            time.sleep(0.2)
        if child.returncode:
            raise SystemExit(f"{name} failed (exit {child.returncode})")
        result = json.loads(Path(out.name).read_text())
    return {**result, "peak_rss_gb": peak / 2**30}


def summary(results: list[dict], warmup: int) -> dict:
    """One row over its runs (one per seed): the median of the runs' median steps, the mean of all their steps,
    tokens per second over all of them, the highest peak memory, the mean accuracy and each run's."""
    steps = [run["step_s"][warmup:] for run in results]
    tokens = [t for run in results for t in run["tokens"][warmup:]]
    return {
        "step_median_s": round(statistics.median(statistics.median(s) for s in steps), 4),
        "step_mean_s": round(statistics.mean(t for s in steps for t in s), 4),
        "tokens_per_s": round(sum(tokens) / sum(t for s in steps for t in s), 1) if tokens else None,
        "peak_rss_gb": round(max(run["peak_rss_gb"] for run in results), 2),
        "val_accuracy": round(statistics.mean(run["val_accuracy"] for run in results), 4),
        "val_accuracies": [round(run["val_accuracy"], 4) for run in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt")
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out of the step median")
    parser.add_argument("--cache", default=str(ROOT / ".ppoflow"), help="where the demo model and data are built")
    parser.add_argument("--only", nargs="+", choices=list(RUNS), help="run only these rows")
    parser.add_argument(
        "--compute-bound",
        action="store_true",
        help="a random ~24M-parameter Qwen2 (its responses run to the limit) instead of the tiny demo model",
    )
    parser.add_argument("--response-length", type=int, help="new tokens per response (default: the demo's 8)")
    parser.add_argument(
        "--settings",
        choices=list(SETTINGS),
        default="demo",
        help="ppoflow's other settings: the demo profile's (default), verl's defaults, or TRL's equivalents",
    )
    parser.add_argument(
        "--seed",
        type=int,
        nargs="+",
        help="the seed of every run's shuffling and sampling (default: each trainer's own: ppoflow's data.seed=1 and "
        "rollout.seed=42, TRL's 0); several: each row once per seed, rows alternated (medians, mean accuracy)",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="both trainers compute in bf16: TRL's bf16=True (its default; float32 otherwise), ppoflow's "
        "fsdp_config.dtype=bfloat16 (verl's; auto is float32 on the CPU); ppoflow's rollout follows rollout.dtype",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    model, train, val = demo_assets(args.cache, args.compute_bound)
    if args.one:  # a child: one run, of one seed, its result to --out
        args.seed = args.seed[0] if args.seed else None
        with tempfile.TemporaryDirectory() as folder:
            result = RUNS[args.one](args, folder, model, train, val)
            result["val_accuracy"] = greedy_accuracy(result.pop("model_dir"), val)
        Path(args.out).write_text(json.dumps(result))
        return
    argv = [f"--steps={args.steps}", f"--prompts={args.prompts}", f"--n={args.n}", f"--cache={args.cache}"]
    argv.append(f"--settings={args.settings}")
    argv += ["--bf16"] * args.bf16
    argv += ["--compute-bound"] * args.compute_bound + [f"--response-length={args.response_length}"] * bool(
        args.response_length
    )
    before = greedy_accuracy(model, val)
    names, seeds = args.only or list(RUNS), args.seed or [None]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for seed in seeds:  # the rows alternated: the machine's drift falls on all of them
        for name in names:
            runs[name].append(measure(name, argv + [f"--seed={seed}"] * (seed is not None)))
    rows = {name: summary(results, args.warmup) for name, results in runs.items()}
    print(
        f"demo task{', a random ~24M Qwen2' if args.compute_bound else ''}, {args.steps} steps of {args.prompts} "
        f"prompts x {args.n} responses of at most {args.response_length or 8} new tokens, ppoflow with {args.settings} "
        "settings; greedy validation accuracy "
        f"before training {before:.3f}"
    )
    print(
        f"{'run':<14}{'step median (s)':>16}{'mean (s)':>10}{'tokens/s':>10}{'peak RSS (GB)':>15}{'val accuracy':>14}"
    )
    for name, row in rows.items():
        tokens = f"{row['tokens_per_s']:.0f}" if row["tokens_per_s"] else "-"
        step, mean, accuracy = row["step_median_s"], row["step_mean_s"], row["val_accuracy"]
        each = f"  ({', '.join(f'{a:.3f}' for a in row['val_accuracies'])})" if len(seeds) > 1 else ""
        print(f"{name:<14}{step:>16.3f}{mean:>10.3f}{tokens:>10}{row['peak_rss_gb']:>15.2f}{accuracy:>14.3f}{each}")
    ratios = {
        f"{algo}_step{kind}_ratio_ppoflow_over_trl": round(
            rows[f"ppoflow-{algo}"][f"step{stat}_s"] / rows[f"trl-{algo}"][f"step{stat}_s"], 3
        )
        for algo in ("grpo", "ppo")
        for kind, stat in (("", "_median"), ("_mean", "_mean"))
        if f"ppoflow-{algo}" in rows and f"trl-{algo}" in rows
    }
    print(
        json.dumps(
            {
                "steps": args.steps,
                "prompts": args.prompts,
                "n": args.n,
                "compute_bound": args.compute_bound,
                "response_length": args.response_length,
                "settings": args.settings,
                "seeds": seeds,
                "bf16": args.bf16,
                "val_accuracy_before": round(before, 4),
                **rows,
                **ratios,
            }
        )
    )


if __name__ == "__main__":
    main()
