"""Overhead of the controller: the demo workload through the Prefect flow on Ray workers vs the same step function
(``rl_core.ppo_step.run_ppo_step``) with plain stage calls on an in-process worker (no Prefect, no Ray), same
sizes, same process.

    python bench/step_overhead.py [--steps 30] [--warmup 5] [--batch 128] [hydra overrides]

Prints a table of per-step medians (the first ``--warmup`` steps are left out: allocator and thread pools settle
for a few steps) and, last, one JSON line with
``flow_median_s``, ``direct_median_s`` and ``ratio`` (flow / direct). Targets: ratio <= 1.03 on a workload whose
direct step takes about a second (``--batch 128``), <= 1.10 at ~150 ms (``--batch 16``).

The direct loop runs before and after the flow, and the ratio is taken against all its steps: on a shared machine
the speed drifts by 10-40 % within minutes, and ``direct_drift`` (after / before) says how much it did this time; a
ratio measured with a drift far from 1 says more about the machine than about the controller.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


EXTRA: list[str] = []


def overrides(folder: str, steps: int, batch: int) -> list[str]:
    return [
        f"trainer.total_training_steps={steps}",
        f"data.train_batch_size={batch}",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.val_before_train=false",
        "trainer.log_samples_freq=-1",
        f"trainer.default_local_dir={folder}/checkpoints",
        f"trainer.tracking_uri=sqlite:///{folder}/mlflow.db",
        f"trainer.artifact_location={folder}/mlartifacts",
        *EXTRA,
    ]


def direct_steps(settings: list[str]) -> list[float]:
    """The same step function (rl_core.ppo_step.run_ppo_step) with stages as plain calls on an in-process worker."""
    from flows.config import compose_config
    from flows.demo import apply_embedded_defaults
    from rl_core.algos.kl import get_kl_controller
    from rl_core.data.dataset import RLDataset
    from rl_core.data.sampler import ResumableSampler
    from rl_core.ppo_step import StepWorkers, run_ppo_step, use_reference
    from rl_core.reward.manager import build_reward_manager
    from rl_core.workers import ActorRolloutRefWorker

    config = compose_config(settings)
    apply_embedded_defaults(config)
    config.actor_rollout_ref.actor.optim.total_training_steps = config.trainer.total_training_steps
    actor = ActorRolloutRefWorker(
        config.actor_rollout_ref, "actor_rollout_ref" if use_reference(config) else "actor_rollout"
    )
    actor.init_model()
    data = RLDataset(config.data.train_files, actor.tokenizer, config.data)
    sampler = ResumableSampler(len(data), config.data.train_batch_size, config.data.shuffle, config.data.seed)
    reward, kl = build_reward_manager(config, actor.tokenizer), get_kl_controller(config.algorithm.kl_ctrl)
    times = []
    for step in range(1, config.trainer.total_training_steps + 1):
        started = time.perf_counter()
        run_ppo_step(config, StepWorkers(actor=actor), data, sampler, reward, kl, step)
        times.append(time.perf_counter() - started)
    return times


def flow_steps(settings: list[str]) -> list[float]:
    """The same workload through the Prefect flow on Ray workers; per-step times as the flow logged them."""
    from mlflow.tracking import MlflowClient

    from flows.prefect_server import configure_prefect, start_temporary_server
    from flows.train import train

    configure_prefect()  # what `ppoflow train` does before its flow starts
    start_temporary_server()()  # the wait for it
    result = train(overrides=settings)
    history = MlflowClient(result["tracking_uri"]).get_metric_history(result["run_id"], "perf/time_per_step")
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="leading steps left out of the medians")
    parser.add_argument(
        "--batch",
        type=int,
        default=128,
        help="prompts per step (x rollout.n = 8 responses each); 128 makes a ~1 s step here",
    )
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for both paths")
    args = parser.parse_args()
    EXTRA.extend(args.overrides)
    with tempfile.TemporaryDirectory() as folder:
        settings = overrides(folder, args.steps, args.batch)
        direct_before = direct_steps(settings)[args.warmup :]
        flow = flow_steps(settings)[args.warmup :]
        direct_after = direct_steps(settings)[args.warmup :]
    direct = direct_before + direct_after
    direct_median, flow_median = statistics.median(direct), statistics.median(flow)
    print(f"{'path':<32}{'median step (s)':>16}{'min (s)':>10}{'max (s)':>10}")
    for name, times in (
        ("direct, before the flow", direct_before),
        ("flow (Prefect tasks, Ray)", flow),
        ("direct, after the flow", direct_after),
    ):
        print(f"{name:<32}{statistics.median(times):>16.3f}{min(times):>10.3f}{max(times):>10.3f}")
    print(
        json.dumps(
            {
                "steps": args.steps,
                "batch": args.batch,
                "direct_median_s": round(direct_median, 4),
                "flow_median_s": round(flow_median, 4),
                "ratio": round(flow_median / direct_median, 3),
                "direct_drift": round(statistics.median(direct_after) / statistics.median(direct_before), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
