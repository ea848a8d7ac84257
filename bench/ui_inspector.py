"""How fast the run inspector's API answers on a long run: 10,000 steps x 50 metrics in a SQLite MLflow store.

    python bench/ui_inspector.py [--steps 10000] [--metrics 50]

Prints the time of each API call the page makes for one selected run — the first call, and the median of the next
three (what the page's polling costs) — and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: its tests' run builder

from mlflow.tracking import MlflowClient  # noqa: E402

from tests.ui.test_store import log_long_run  # noqa: E402
from ui.store import DEFAULT_CURVES, RunStore  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--metrics", type=int, default=50)
    args = parser.parse_args()
    named = [keys[0] for keys in DEFAULT_CURVES.values() if keys] + [f"timing_s/stage{i}" for i in range(8)]
    names = named + [f"extra/metric{i}" for i in range(max(0, args.metrics - len(named)))]
    with tempfile.TemporaryDirectory() as folder:
        uri = f"sqlite:///{folder}/mlflow.db"
        started = time.perf_counter()
        run_id = log_long_run(uri, Path(folder), args.steps, names)
        MlflowClient(uri).set_terminated(run_id)
        logging_s = time.perf_counter() - started
        store = RunStore(uri)
        calls = {
            "runs": lambda: store.runs("long"),
            "curves": lambda: store.curves([run_id]),
            "timeline": lambda: store.timeline(run_id),
        }
        first, repeated = {}, {}
        for name, call in calls.items():
            samples = []
            for _ in range(4):
                started = time.perf_counter()
                call()
                samples.append(time.perf_counter() - started)
            first[name], repeated[name] = samples[0], statistics.median(samples[1:])
        points = max(len(line["steps"]) for lines in store.curves([run_id]).values() for line in lines)
    print(f"{'API call':<12}{'first (s)':>12}{'polling (s)':>14}")
    for name in calls:
        print(f"{name:<12}{first[name]:>12.3f}{repeated[name]:>14.3f}")
    print(
        json.dumps(
            {
                "steps": args.steps,
                "metrics": len(names),
                "logging_s": round(logging_s, 1),
                "max_points_per_curve": points,
                **{f"{name}_first_s": round(first[name], 3) for name in calls},
                **{f"{name}_polling_s": round(repeated[name], 3) for name in calls},
            }
        )
    )


if __name__ == "__main__":
    main()
