"""How long ``ppoflow train`` takes to its first step line: the command a user types, timed from the process's start
(interpreter start and imports included) to the ``step 1/2`` line, on the embedded default (a local Ray cluster and
Prefect's temporary server started by the command) or on a running ``ppoflow up`` stack.

    python bench/startup.py [--runs 5] [--stack [--own-process] [--pause S] [--restart]] [--baseline PATH]

A first run per code builds the demo's assets and the MLflow store (not timed), as a user's second run finds them.
``--baseline PATH``: another checkout of the project (e.g. ``git worktree add /tmp/base HEAD~1``), run alternately with
this one (its modules first on PYTHONPATH; with ``--stack`` each code gets a stack of its own, started with it, since
the stack's Ray workers import the stack's code). ``--own-process`` (with ``--stack``): each run of this code is
alternated with one in the command's own process (``PPOFLOW_LAUNCHER=0``, not handed to the stack's launcher,
flows/launcher.py) on the same stack. ``--pause S`` (with ``--stack``): S seconds between one command's end and the
next one's start, as a user reading the output takes (the standby workers a run leaves, infra/standby.py, import
meanwhile); 0, back to back, by default. ``--restart`` (with ``--stack``): the stack stopped and started again
before each timed run, which is then the first after ``ppoflow up`` (started ``--pause`` seconds after the new
launcher has offered the standby workers the last run left). Run it alone: the start-up is CPU-bound on a small
machine. Prints a table (each run, the median) and, last, one JSON line ``{"codes": {name: {"seconds", "median_s"}}}``.
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
FIRST_STEP = "step 1/"
OWN_PROCESS = "this-own"  # --own-process: this code, the command not handed to the stack's launcher


def ppoflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", *args]


def environment(code: Path, scratch: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The command's environment: ``code``'s modules first, the scratch folder as its home (demo assets, stack)."""
    return {**os.environ, "PYTHONPATH": str(code), "PPOFLOW_HOME": str(scratch / "home"), **(extra or {})}


def time_to_first_step(code: Path, scratch: Path, name: str, extra: dict[str, str] | None = None) -> float:
    """Seconds from starting ``ppoflow train`` (a fresh run of 2 steps) to its first step line; the run then ends."""
    overrides = ["trainer.total_training_steps=2", f"trainer.experiment_name={name}"]
    overrides.append(f"trainer.default_local_dir={scratch / 'checkpoints' / name}")
    started = time.monotonic()
    command = subprocess.Popen(
        ppoflow("train", *overrides),
        cwd=scratch,
        env=environment(code, scratch, extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seconds, output = None, []
    for line in command.stdout:
        output.append(line)
        if seconds is None and FIRST_STEP in line:
            seconds = time.monotonic() - started
    if command.wait() != 0 or seconds is None:
        raise SystemExit(f"{code}: `ppoflow train` failed (exit {command.returncode}):\n{''.join(output[-40:])}")
    return seconds


def stack(code: Path, scratch: Path, action: str) -> None:
    """``ppoflow up`` / ``ppoflow down`` with ``code``."""
    result = subprocess.run(
        ppoflow(action), cwd=scratch, env=environment(code, scratch), capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SystemExit(f"`ppoflow {action}` failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")


def restart_stack(code: Path, scratch: Path) -> None:
    """``ppoflow down`` then ``up``, and the wait until the new launcher has offered the standby workers the last run
    left (flows/standby_workers.py), or has said it offers none; a code whose launcher does not (the code before them)
    is given 15 s after it listens."""
    log = scratch / "home" / "data" / "logs" / "launcher.log"
    stack(code, scratch, "down")
    seen = log.stat().st_size if log.exists() else 0
    stack(code, scratch, "up")
    listening = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        new = log.read_text()[seen:] if log.exists() else ""
        if "standby workers" in new:
            return
        if listening is None and "listening on" in new:
            listening = time.monotonic()
        if listening is not None and time.monotonic() - listening > 15:
            return
        time.sleep(0.2)
    raise SystemExit(f"{code}: the launcher did not listen within 120 s after `ppoflow up`")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--stack", action="store_true", help="on a running `ppoflow up` stack")
    parser.add_argument("--baseline", type=Path, help="another checkout, run alternately with this one")
    parser.add_argument("--own-process", action="store_true", help="--stack: also without the stack's launcher")
    parser.add_argument("--pause", type=float, default=0.0, help="--stack: seconds between commands (a user's)")
    parser.add_argument("--restart", action="store_true", help="--stack: each timed run the first after `up`")
    args = parser.parse_args()
    codes = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    seconds: dict[str, list[float]] = {name: [] for name in codes}
    own_process = args.stack and args.own_process
    if own_process:  # this code's runs alternate with ones in the command's own process, on the same stack
        seconds[OWN_PROCESS] = []
    with tempfile.TemporaryDirectory(prefix="ppoflow-startup-") as folder:
        scratch = Path(folder)
        if args.stack:  # one code's runs after the other's, each on its own stack
            for name, code in codes.items():
                stack(code, scratch, "up")
                try:
                    time_to_first_step(code, scratch, f"{name}-warm-up")
                    for run in range(args.runs):
                        if args.restart:
                            restart_stack(code, scratch)
                        time.sleep(args.pause)
                        seconds[name].append(time_to_first_step(code, scratch, f"{name}-{run}"))
                        if own_process and name == "this":
                            time.sleep(args.pause)
                            own = time_to_first_step(code, scratch, f"own-{run}", {"PPOFLOW_LAUNCHER": "0"})
                            seconds[OWN_PROCESS].append(own)
                finally:
                    stack(code, scratch, "down")
        else:
            for name, code in codes.items():
                time_to_first_step(code, scratch, f"{name}-warm-up")
            for run in range(args.runs):
                for name, code in codes.items():
                    seconds[name].append(time_to_first_step(code, scratch, f"{name}-{run}"))
    where = "the embedded default"
    if args.stack:
        first = ", each the first after `up`" if args.restart else ""
        where = f"a `ppoflow up` stack, {args.pause:g} s between commands{first}"
    print(f"seconds to the first step line, {where}")
    print(f"{'code':<10}{'median':>8}  runs")
    results = {}
    for name, times in seconds.items():
        results[name] = {"seconds": [round(s, 2) for s in times], "median_s": round(statistics.median(times), 2)}
        print(f"{name:<10}{results[name]['median_s']:>8.2f}  {' '.join(f'{s:.2f}' for s in times)}")
    where = "stack" if args.stack else "embedded"
    print(json.dumps({"where": where, "pause_s": args.pause, "restart": args.restart, "codes": results}))


if __name__ == "__main__":
    main()
