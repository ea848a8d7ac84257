"""How fast the run inspector's API answers on a long run: 10,000 steps x 50 metrics in a SQLite MLflow store.

    python bench/ui_inspector.py [--steps 10000] [--metrics 50]

Prints the time of each API call the page makes for one selected run (median of 3) and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from tests.ui.test_store import log_long_run
from ui.store import CURVES, RunStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--metrics", type=int, default=50)
    args = parser.parse_args()
    named = [keys[0] for keys in CURVES.values() if keys] + [f"timing_s/stage{i}" for i in range(8)]
    names = named + [f"extra/metric{i}" for i in range(max(0, args.metrics - len(named)))]
    with tempfile.TemporaryDirectory() as folder:
        uri = f"sqlite:///{folder}/mlflow.db"
        started = time.perf_counter()
        run_id = log_long_run(uri, Path(folder), args.steps, names)
        logging_s = time.perf_counter() - started
        store = RunStore(uri)
        calls = {"runs": lambda: store.runs("long"), "curves": lambda: store.curves([run_id]), "timeline": lambda: store.timeline(run_id)}
        timings = {}
        for name, call in calls.items():
            samples = []
            for _ in range(3):
                started = time.perf_counter()
                call()
                samples.append(time.perf_counter() - started)
            timings[name] = statistics.median(samples)
        points = max(len(line["steps"]) for lines in store.curves([run_id]).values() for line in lines)
    print(f"{'API call':<12}{'median (s)':>12}")
    for name, seconds in timings.items():
        print(f"{name:<12}{seconds:>12.3f}")
    print(json.dumps({"steps": args.steps, "metrics": len(names), "logging_s": round(logging_s, 1), "max_points_per_curve": points,
                      **{f"{name}_s": round(seconds, 3) for name, seconds in timings.items()}}))


if __name__ == "__main__":
    main()
