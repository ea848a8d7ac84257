"""How fast ``ppoflow train`` refuses bad input: each probe is the command a user types, timed from the process's start
(interpreter start and imports included) to its exit.

    python bench/refusals.py [--repeats 3] [--busy]

Probes: negative steps, ``rollout.n=0``, ``lr=nan``, batch 0, a misspelt algorithm, a missing data file, a missing
model folder, a misspelt key. ``--busy`` adds the busy-folder probe: a first ``ppoflow train`` of the demo trains in a
folder (its step lines printing) while a second one is started in the same folder and refused; timed under that load.
Every probe must exit 2 with its message. Prints a table per probe (median and slowest of ``--repeats``) and, last,
one JSON line ``{"probes": {name: {"median_s", "max_s"}}, "slowest_s": ...}``.
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

ROOT = Path(__file__).resolve().parent.parent
PROBES = {
    "negative steps": ["trainer.total_training_steps=-1"],
    "n=0": ["actor_rollout_ref.rollout.n=0"],
    "lr=nan": ["actor_rollout_ref.actor.optim.lr=nan"],
    "batch 0": ["data.train_batch_size=0"],
    "misspelt algorithm": ["algorithm.adv_estimator=grpoo"],
    "missing data file": ["data.train_files=/nonexistent/train.parquet", "data.val_files=/nonexistent/val.parquet"],
    "missing model folder": ["actor_rollout_ref.model.path=/nonexistent/model"],
    "misspelt key": ["algorithm.adv_estimatr=grpo"],
}


def refuse(overrides: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Seconds until ``ppoflow train OVERRIDES`` exited, and its first error line; it must exit 2."""
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", *overrides], capture_output=True, text=True, cwd=ROOT, env=env
    )
    seconds = time.monotonic() - started
    if result.returncode != 2:
        raise SystemExit(f"{overrides}: exit {result.returncode}, expected 2\n{result.stdout[-2000:]}{result.stderr}")
    return seconds, result.stderr.splitlines()[0]


def busy_folder(folder: Path, env: dict[str, str], repeats: int) -> tuple[list[float], str]:
    """A second run in the folder a first one trains in: its refusal times, measured while the first one steps."""
    overrides = [
        f"trainer.default_local_dir={folder}/checkpoints",
        f"trainer.tracking_uri=sqlite:///{folder}/mlflow.db",
    ]
    log = open(folder / "first.log", "w")  # noqa: SIM115 (open while the first run lives)
    first = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "train", *overrides, "trainer.total_training_steps=1000"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 600
        while "step 3/" not in (folder / "first.log").read_text():  # training, its workers busy
            if first.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the first run did not reach step 3:\n{(folder / 'first.log').read_text()[-3000:]}")
            time.sleep(0.5)
        times, line = [], ""
        for _ in range(repeats):
            seconds, line = refuse(overrides, env)
            times.append(seconds)
        return times, line
    finally:
        first.terminate()
        first.wait(60)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy", action="store_true", help="also the busy-folder probe (trains the demo meanwhile)")
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    print(f"{'probe':<22}{'median (s)':>12}{'max (s)':>10}  message")
    with tempfile.TemporaryDirectory(prefix="ppoflow-refusals-") as scratch:
        env = {**os.environ, "PPOFLOW_HOME": scratch}
        rows = []
        for number, (name, overrides) in enumerate(PROBES.items()):
            folder = Path(scratch) / f"probe-{number}"
            settings = [f"trainer.default_local_dir={folder}/checkpoints", f"trainer.cache_dir={folder}/cache"]
            timed = [refuse([*overrides, *settings], env) for _ in range(args.repeats)]
            rows.append((name, [seconds for seconds, _ in timed], timed[-1][1]))
        if args.busy:
            folder = Path(scratch) / "busy"
            folder.mkdir()
            times, line = busy_folder(folder, env, args.repeats)
            rows.append(("busy folder (loaded)", times, line))
    for name, times, line in rows:
        results[name] = {"median_s": round(statistics.median(times), 2), "max_s": round(max(times), 2)}
        print(f"{name:<22}{results[name]['median_s']:>12.2f}{results[name]['max_s']:>10.2f}  {line[:90]}")
    print(json.dumps({"probes": results, "slowest_s": max(r["max_s"] for r in results.values())}))


if __name__ == "__main__":
    main()
