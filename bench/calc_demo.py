"""The tool demo learns: ``ppoflow train data.synthetic.task=calc`` run as a newcomer runs it, in a fresh folder (its
warm start built there by the first run, the later runs reuse it), then its validation read back from MLflow.

    python bench/calc_demo.py [--seeds N] [--attention padding_free sdpa] [--keep DIR] [hydra overrides]

One run per rollout seed (``actor_rollout_ref.rollout.seed`` 0..N-1) and attention path (``padding_free``: the
default; ``sdpa``: transformers' SDPA attention, ``+actor_rollout_ref.model.override_config.attn_implementation=sdpa``).
Prints each run's validations (greedy accuracy, the call rate, turns per trajectory), a table of the runs and, last, one
JSON line with ``runs`` (each: ``seed``, ``attention``, ``wall_s`` (the whole command), ``warm_start_s`` (the demo's
SFT, from the command's start to its loss line; only the first run builds it), ``acc_before``, ``acc_after``,
``call_rate_before``, ``call_rate_after``, ``learned``) and ``learned`` (every run): the issue's mark, the call rate >=
0.9 and the accuracy up by >= 0.4 at the last step (the exit status is 1 when a run misses it). Minutes per run on 2
cores: run it alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ACCURACY = "val-core/ppoflow/calc/acc/mean@1"
CALL_RATE, TURNS = "val-aux/tool/call_rate", "val-aux/num_turns/mean"
MIN_CALL_RATE, MIN_GAIN = 0.9, 0.4
ATTENTION = {"padding_free": [], "sdpa": ["+actor_rollout_ref.model.override_config.attn_implementation=sdpa"]}


def run_demo(folder: Path, overrides: list[str], task: str = "calc") -> tuple[dict, float, float]:
    """(the command's final JSON, its wall time, the seconds until its warm start's loss line): ``ppoflow train`` of
    synthetic ``task``, run in ``folder``."""
    command = [str(Path(sys.executable).with_name("ppoflow")), "train", f"data.synthetic.task={task}", *overrides]
    started, warm_start_s, last = time.perf_counter(), float("nan"), ""
    with subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
        for line in process.stdout:
            sys.stderr.write(line)
            if line.startswith("[demo] SFT loss"):
                warm_start_s = time.perf_counter() - started
            if line.startswith("{"):
                last = line
    if process.returncode != 0 or not last:
        raise SystemExit(f"ppoflow train exited {process.returncode}: its output is above")
    return json.loads(last), time.perf_counter() - started, warm_start_s


def validations(result: dict, metrics: tuple[str, ...] = (ACCURACY, CALL_RATE, TURNS)) -> dict[int, dict[str, float]]:
    """{step: {metric: value}} of the run's ``metrics`` (MLflow's names have "_at_" for "@")."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(result["tracking_uri"])
    table: dict[int, dict[str, float]] = {}
    for name in (metric.replace("@", "_at_") for metric in metrics):
        for metric in client.get_metric_history(result["run_id"], name):
            table.setdefault(metric.step, {})[name.replace("_at_", "@")] = metric.value
    return table


def summarize(table: dict[int, dict[str, float]]) -> dict:
    """A run's first and last validation and whether it met the mark; its validations printed."""
    print(f"{'step':>6}{'greedy acc':>12}{'call rate':>12}{'turns':>8}")
    for step, row in sorted(table.items()):
        print(f"{step:>6}{row.get(ACCURACY, float('nan')):>12.3f}{row.get(CALL_RATE, float('nan')):>12.3f}", end="")
        print(f"{row.get(TURNS, float('nan')):>8.2f}")
    first, last = table[min(table)], table[max(table)]
    return {
        "steps": max(table),
        "acc_before": first[ACCURACY],
        "acc_after": last[ACCURACY],
        "call_rate_before": first[CALL_RATE],
        "call_rate_after": last[CALL_RATE],
        "learned": last[CALL_RATE] >= MIN_CALL_RATE and last[ACCURACY] - first[ACCURACY] >= MIN_GAIN,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1, help="rollout seeds 0..N-1 (default 1)")
    parser.add_argument("--attention", nargs="+", choices=sorted(ATTENTION), default=["padding_free"])
    parser.add_argument("--keep", help="run in this folder and keep it (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for ppoflow train")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(args.keep or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        for attention in args.attention:
            for seed in range(args.seeds):
                name = [f"trainer.experiment_name=demo_calc_{attention}_seed{seed}"]
                overrides = [*ATTENTION[attention], f"actor_rollout_ref.rollout.seed={seed}", *name, *args.overrides]
                result, wall_s, warm_start_s = run_demo(folder, overrides)
                print(f"seed {seed}, {attention}:")
                run = {"seed": seed, "attention": attention, "wall_s": round(wall_s, 1)}
                run |= {"warm_start_s": round(warm_start_s, 1)} | summarize(validations(result))
                runs.append(run)
    print(
        f"{'attention':<14}{'seed':>5}{'acc before':>12}{'acc after':>11}{'call rate':>11}{'wall s':>8}{'learned':>9}"
    )
    for run in runs:
        print(f"{run['attention']:<14}{run['seed']:>5}{run['acc_before']:>12.3f}{run['acc_after']:>11.3f}", end="")
        print(f"{run['call_rate_after']:>11.2f}{run['wall_s']:>8.0f}{str(run['learned']):>9}")
    learned = all(run["learned"] for run in runs)
    print(json.dumps({"runs": runs, "learned": learned}))
    sys.exit(0 if learned else 1)


if __name__ == "__main__":
    main()
