"""Asynchronous RL against the synchronous run: trained samples per second and validation accuracy after the same
number of samples, runs alternated in one sitting.

    python bench/async_rl.py [--workload demo|tool|both] [--steps 100] [--repeats 3] [--modes one_step_off ...]
                             [--batching default rounds continuous] [--weights naive gloo gloo-partial]

Each run is ``ppoflow train`` on the embedded demo (``demo``: addition, a 64-wide model) or the tool demo (``tool``:
multiplication through the calculator, its answers delayed by ``--tool-latency`` seconds like a remote service, or by
a time drawn between that and ``--tool-latency-max`` for each call), in a
folder of its own, with validation after the last step only; repeat r uses the shuffling and sampling seeds r+1 and
r in every mode (the accuracy after a few steps is the seed's as much as the mode's):

* ``sync``: the colocated default, generation and training on one worker with every CPU;
* ``one_step_off``: the rollout on a worker of its own (``rollout.n_gpus_per_node=1``), the node's CPUs shared between
  it and the trainer's worker, the next step's generation overlapping this step's training, verl's recipe settings
  (the rollout's log-probs as the old ones: ``algorithm.rollout_correction.bypass_mode=true``);
* ``fully_async``: two rollout workers (``rollout.n_gpus_per_node=2``), ``async_training.mode=fully_async`` with
  ``staleness_threshold=1`` (two steps' prompts per weight sync: one generation ahead, on the worker that is free);
* ``fully_async_2``: the same with ``staleness_threshold=2`` (two generations ahead, one on each worker; samples up to
  two versions old).

``--batching`` runs each mode once per value of ``actor_rollout_ref.rollout.agent.batching`` (the tool workload's
trajectories in rounds, or continuously: each on its own); ``default`` leaves the mode's own (rounds when synchronous,
continuous otherwise). A mode run with a batching other than ``default`` is labelled ``mode:batching``.
``--weights`` runs each asynchronous mode once per way the weights reach the rollout: ``naive`` (Ray's object store),
``gloo`` (``actor_rollout_ref.rollout.checkpoint_engine.backend=gloo``: a broadcast channel per rollout worker, labelled
``mode+gloo``), ``gloo-partial`` (that and ``async_training.partial_rollout=true``: a generation in flight takes the
new weights between two tokens; the fully_async modes only).

On a GPU machine the same command runs each pool on its own GPU (``trainer.n_gpus_per_node=1`` stays; the rollout takes
another). Prints a table per workload (medians over the repeats; the staleness, a sample's versions behind averaged
over the steps, and the share of samples partial rollout continued under newer weights, means) and, last, one JSON
line.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "demo": [],
    "tool": ["data.synthetic.task=calc", "actor_rollout_ref.rollout.multi_turn.max_concurrent_tools=64"],
}
RECIPE = ["actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_correction.bypass_mode=true"]
MODES = {
    "sync": [],
    "one_step_off": ["rollout.n_gpus_per_node=1", "async_training.mode=one_step_off", *RECIPE],
    "fully_async": [
        "rollout.n_gpus_per_node=2",
        "async_training.mode=fully_async",
        "async_training.staleness_threshold=1",
        *RECIPE,
    ],
    "fully_async_2": [
        "rollout.n_gpus_per_node=2",
        "async_training.mode=fully_async",
        "async_training.staleness_threshold=2",
        *RECIPE,
    ],
}


WEIGHTS = {
    "naive": [],
    "gloo": ["actor_rollout_ref.rollout.checkpoint_engine.backend=gloo"],
    "gloo-partial": ["actor_rollout_ref.rollout.checkpoint_engine.backend=gloo", "async_training.partial_rollout=true"],
}


def tool_config(folder: Path, latency_s: float, latency_max_s: float | None) -> Path:
    """The calculator's tool YAML with its answers delayed by ``latency_s`` (or by a time drawn uniformly between it
    and ``latency_max_s`` for each call)."""
    text = (ROOT / "configs" / "tools" / "calculator.yaml").read_text()
    latency = latency_s if latency_max_s is None else f"[{latency_s}, {latency_max_s}]"
    path = folder / "slow_calculator.yaml"
    path.write_text(text.replace("config: {type: native}", f"config: {{type: native, latency_s: {latency}}}"))
    return path


def run(folder: Path, overrides: list[str]) -> dict[str, float]:
    """One ``ppoflow train``: the median step time and generation wait (steps after the first 5), the final greedy
    validation accuracy."""
    folder.mkdir(parents=True)
    result = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", *overrides, f"trainer.default_local_dir={folder}/checkpoints"]
        + [f"trainer.tracking_uri=sqlite:///{folder}/mlflow.db", "trainer.save_freq=-1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if result.returncode != 0:
        raise SystemExit(f"{overrides}: exit {result.returncode}\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    db = sqlite3.connect(folder / "mlflow.db")

    def history(key: str) -> list[float]:
        return [v for (v,) in db.execute("select value from metrics where key = ? order by step", (key,))]

    val_key = next(k for (k,) in db.execute("select distinct key from metrics") if k.endswith("/acc/mean_at_1"))
    step_s = statistics.median(history("perf/time_per_step")[5:])
    gen_wait_s = statistics.median(history("timing_s/gen")[5:])
    staleness = statistics.mean(history("training/staleness_mean") or [0.0])  # 0 colocated (not logged)
    partial = statistics.mean(history("fully_async/partial_ratio") or [0.0])  # 0 without partial rollout
    return {
        "step_s": step_s,
        "val_accuracy": history(val_key)[-1],
        "gen_wait_s": gen_wait_s,
        "staleness": staleness,
        "partial_ratio": partial,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="sync always runs")
    parser.add_argument("--tool-latency", type=float, default=0.1, help="seconds per calculator call (tool workload)")
    parser.add_argument("--tool-latency-max", type=float, help="each call's seconds drawn from [--tool-latency, this]")
    parser.add_argument("--batching", nargs="+", choices=["default", "rounds", "continuous"], default=["default"])
    parser.add_argument("--weights", nargs="+", choices=list(WEIGHTS), default=["naive"])
    args = parser.parse_args()
    from flows.config import compose_config

    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    modes = {
        mode + ("" if batching == "default" else f":{batching}") + ("" if weights == "naive" else f"+{weights}"): MODES[
            mode
        ]
        + ([] if batching == "default" else [f"actor_rollout_ref.rollout.agent.batching={batching}"])
        + WEIGHTS[weights]
        for mode in MODES
        if mode == "sync" or mode in args.modes
        for batching in args.batching
        for weights in (["naive"] if mode == "sync" else args.weights)
        if weights != "gloo-partial" or mode.startswith("fully_async")
    }
    baseline = next(iter(modes))  # sync, with the first batching asked for
    summary: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="ppoflow-async-bench-") as tmp:
        for workload in workloads:
            overrides = [*WORKLOADS[workload], f"trainer.total_training_steps={args.steps}"]
            overrides += [f"trainer.test_freq={args.steps}", "trainer.val_before_train=false"]
            if workload == "tool":
                overrides.append(
                    "actor_rollout_ref.rollout.multi_turn.tool_config_path="
                    + str(tool_config(Path(tmp), args.tool_latency, args.tool_latency_max))
                )
            config = compose_config(overrides)
            samples = config.data.train_batch_size * config.actor_rollout_ref.rollout.n
            results: dict[str, list[dict]] = {mode: [] for mode in modes}
            for repeat in range(args.repeats):  # alternated: the machine's drift falls on both
                seeds = [f"data.seed={repeat + 1}", f"actor_rollout_ref.rollout.seed={repeat}"]  # one per repeat
                for mode, extra in modes.items():
                    results[mode].append(run(Path(tmp) / f"{workload}-{mode}-{repeat}", overrides + seeds + extra))
                    print(f"{workload} {mode} #{repeat + 1}: {results[mode][-1]}", flush=True)
            rows = {
                mode: {
                    "step_s": round(statistics.median(r["step_s"] for r in runs), 4),
                    "samples_per_s": round(samples / statistics.median(r["step_s"] for r in runs), 1),
                    "gen_wait_s": round(statistics.median(r["gen_wait_s"] for r in runs), 4),
                    "val_accuracy": round(statistics.median(r["val_accuracy"] for r in runs), 3),
                    "staleness": round(statistics.mean(r["staleness"] for r in runs), 3),
                    "partial_ratio": round(statistics.mean(r["partial_ratio"] for r in runs), 3),
                }
                for mode, runs in results.items()
            }
            speedups = {
                mode: round(rows[mode]["samples_per_s"] / rows[baseline]["samples_per_s"], 2)
                for mode in rows
                if mode != baseline
            }
            summary[workload] = {"samples_per_step": samples, **rows, "speedup": speedups}
            print(f"\n{workload}: {args.steps} steps of {samples} samples, {args.repeats} repeats (medians)")
            print(
                f"{'mode':25} {'step (s)':>9} {'samples/s':>10} {'gen wait (s)':>13} {'val accuracy':>13} "
                f"{'staleness':>10} {'partial':>8}"
            )
            for mode, row in rows.items():
                print(
                    f"{mode:25} {row['step_s']:9.3f} {row['samples_per_s']:10.1f} {row['gen_wait_s']:13.3f} "
                    f"{row['val_accuracy']:13.3f} {row['staleness']:10.3f} {row['partial_ratio']:8.3f}"
                )
            print(", ".join(f"{mode} / {baseline}: {x:.2f}x" for mode, x in speedups.items()) + " samples per second\n")
    print(json.dumps({"steps": args.steps, "repeats": args.repeats, "workloads": summary}))


if __name__ == "__main__":
    main()
