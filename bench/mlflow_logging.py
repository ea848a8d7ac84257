"""What logging a step's metrics to MLflow costs the controller: CPU per step of :class:`flows.tracking.RunTracker`
on a SQLite store, with the steps sent one by one and together (``METRICS_INTERVAL_S``).

    python bench/mlflow_logging.py [--steps 60] [--metrics 90] [--step-s 0.13] [--intervals 0 1 5]

Each arm is a fresh store and run; a "step" sleeps ``--step-s`` (the step's own time, in which the background thread
sends) and then logs ``--metrics`` metrics (a GRPO step logs ~90). The process's CPU time (all its threads: the
background thread's SQLite writes included) is read around the steps and the final flush. The CPU a run's controller
spends here is taken from the workers on a small machine. Prints a table and, last, one JSON line
``{"arms": {interval: {"cpu_ms_per_step", "calls"}}}``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

import flows.tracking
from flows.tracking import RunTracker


def measure(folder: Path, interval: float, steps: int, metrics: int, step_s: float) -> dict:
    config = OmegaConf.create(
        {
            "trainer": {
                "tracking_uri": f"sqlite:///{folder}/mlflow.db",
                "project_name": "bench",
                "experiment_name": f"interval-{interval}",
                "artifact_location": str(folder / "artifacts"),
            }
        }
    )
    flows.tracking.METRICS_INTERVAL_S = interval
    tracker = RunTracker(config)
    calls = []
    log_batch = tracker.client.log_batch

    def counted(run_id, metrics=(), **kwargs):
        if metrics:  # not the tags
            calls.append(len(metrics))
        return log_batch(run_id, metrics=metrics, **kwargs)

    tracker.client.log_batch = counted
    names = [f"group{i % 7}/metric_{i}" for i in range(metrics)]
    started = time.process_time()
    for step in range(1, steps + 1):
        time.sleep(step_s)
        tracker.log_step(step, {name: step * 0.5 + i for i, name in enumerate(names)})
    tracker.flush()
    cpu = time.process_time() - started
    tracker.finish()
    return {"cpu_ms_per_step": round(cpu / steps * 1000, 2), "calls": len(calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--metrics", type=int, default=90, help="metrics a step logs")
    parser.add_argument("--step-s", type=float, default=0.13, help="the step's own time, slept between two logs")
    parser.add_argument("--intervals", type=float, nargs="+", default=[0.0, 1.0, 5.0], help="METRICS_INTERVAL_S")
    args = parser.parse_args()
    arms = {}
    for interval in args.intervals:
        with tempfile.TemporaryDirectory(prefix="ppoflow-mlflow-bench-") as folder:
            arms[str(interval)] = measure(Path(folder), interval, args.steps, args.metrics, args.step_s)
    print(f"{args.steps} steps of {args.metrics} metrics, {args.step_s * 1000:.0f} ms each, SQLite store")
    print(f"{'interval (s)':<14}{'CPU ms/step':>12}{'calls':>8}")
    for interval, arm in arms.items():
        print(f"{interval:<14}{arm['cpu_ms_per_step']:>12.2f}{arm['calls']:>8}")
    print(json.dumps({"steps": args.steps, "metrics": args.metrics, "step_s": args.step_s, "arms": arms}))


if __name__ == "__main__":
    main()
