"""The visual demo learns: ``ppoflow train data.synthetic.task=shapes`` run as a newcomer runs it, in a fresh folder
(the tiny Qwen2.5-VL and its warm start built there by the first run), then its validation read back from MLflow; and
what the images cost: the same run with the images left out of the prompts (``data.image_key`` naming no column: the
same model, the ``<image>`` placeholder then plain text).

    python bench/vlm_demo.py [--keep DIR] [--no-text-only] [hydra overrides]

Prints the validations, a table of the runs (greedy accuracy before and after, the step's median time and its stages
from MLflow's ``timing_s/*``, tokens per sample, the worker's peak resident memory) and, last, one JSON line with
``runs`` and ``learned``: the issue's mark, greedy validation accuracy up by >= 0.3 (the exit status is 1 when missed).
About two minutes per run on 2 cores: run it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from calc_demo import run_demo, validations

ACCURACY = "val-core/ppoflow/shapes/acc/mean@1"
MIN_GAIN = 0.3
STAGES = ("gen", "old_log_prob", "ref", "update_actor")
MEDIAN_OF = ("perf/time_per_step", "prompt_length/mean", "response_length/mean", "perf/max_rss_gb")
MEDIAN_OF += tuple(f"timing_s/{stage}" for stage in STAGES)


def step_medians(result: dict) -> dict[str, float]:
    """Medians over the run's steps after the first (warming up) of the step's time and its stages."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(result["tracking_uri"])
    medians = {}
    for name in MEDIAN_OF:
        values = [m.value for m in client.get_metric_history(result["run_id"], name) if m.step > 1]
        medians[name] = statistics.median(values) if values else float("nan")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="run in this folder and keep it (default: a temporary one)")
    parser.add_argument("--no-text-only", action="store_true", help="skip the run without images")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for ppoflow train")
    args = parser.parse_args()
    variants = {"images": []} | ({} if args.no_text_only else {"text only": ["data.image_key=no_images"]})
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.keep or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        for name, extra in variants.items():
            overrides = [f"trainer.experiment_name=demo_shapes_{name.replace(' ', '_')}", *extra, *args.overrides]
            result, wall_s, warm_start_s = run_demo(folder, overrides, task="shapes")
            table = validations(result, (ACCURACY,))
            print(f"{name}: " + ", ".join(f"step {step} {row[ACCURACY]:.3f}" for step, row in sorted(table.items())))
            first, last = table[min(table)][ACCURACY], table[max(table)][ACCURACY]
            run = {"run": name, "wall_s": round(wall_s, 1), "warm_start_s": round(warm_start_s, 1)}
            run |= {"acc_before": first, "acc_after": last, "learned": last - first >= MIN_GAIN}
            run |= {key: round(value, 4) for key, value in step_medians(result).items()}
            runs.append(run)
    print(f"{'run':<11}{'acc before':>11}{'acc after':>10}{'step s':>8}", end="")
    print("".join(f"{stage:>14}" for stage in STAGES) + f"{'prompt tokens':>15}{'peak RSS GB':>13}")
    for run in runs:
        print(f"{run['run']:<11}{run['acc_before']:>11.3f}{run['acc_after']:>10.3f}", end="")
        print(f"{run['perf/time_per_step']:>8.3f}", end="")
        print("".join(f"{run[f'timing_s/{stage}']:>14.3f}" for stage in STAGES), end="")
        print(f"{run['prompt_length/mean']:>15.1f}{run['perf/max_rss_gb']:>13.2f}")
    learned = runs[0]["learned"]
    print(json.dumps({"runs": runs, "learned": learned}))
    sys.exit(0 if learned else 1)


if __name__ == "__main__":
    main()
