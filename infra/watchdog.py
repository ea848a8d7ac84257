"""Nothing outlives a killed command: a watchdog process that ends a command's descendants once the command is gone.

A command that starts helpers — Prefect's temporary API server, an embedded Ray cluster (GCS, raylet, and the
agents the raylet starts) — cleans them up when it exits, but not when it is killed by SIGKILL; they are then
re-parented to init and run forever. ``start(pid)`` starts ``python -m infra.watchdog PID`` in a session of its own
(so that the signal that kills the command's process group does not kill it too). Every ``POLL_S`` it records the
descendants of PID (pid and start time, read from /proc); once PID has ended it sends SIGTERM to each recorded process
that still runs (the same start time: never a recycled pid), SIGKILL to those left after ``GRACE_S``, and exits.
A command that ended normally has stopped its helpers already, so the watchdog finds nothing to do. Linux only
(/proc); elsewhere ``start`` does nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5
GRACE_S = 5.0


def stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, parent pid, process group, start time in clock ticks since boot) of ``pid`` from /proc/<pid>/stat; None
    when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # it ended meanwhile
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (command name)", which may hold spaces
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def all_stats() -> dict[int, tuple[str, int, int, int]]:
    """pid -> :func:`stat` of every process."""
    return {
        int(entry.name): found
        for entry in os.scandir("/proc")
        if entry.name.isdigit() and (found := stat(int(entry.name)))
    }


def processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks since boot) of every process."""
    return {pid: (parent, started) for pid, (_, parent, _, started) in all_stats().items()}


def descendants(root: int, table: dict[int, tuple[int, int]]) -> dict[int, int]:
    """pid -> start time of every process below ``root`` in ``table``."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, stack = {}, list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found[pid] = table[pid][1]
        stack.extend(children.get(pid, []))
    return found


def still_running(recorded: dict[int, int]) -> list[int]:
    table = processes()
    return [pid for pid, started in recorded.items() if pid in table and table[pid][1] == started]


def watch(pid: int) -> list[int]:
    """Record ``pid``'s descendants until it ends, then end those still running; returns the pids it had to end."""
    started = processes().get(pid, (0, None))[1]
    recorded: dict[int, int] = {}
    while started is not None:  # a command already gone has nothing to watch (None == None would loop forever)
        table = processes()
        if table.get(pid, (0, None))[1] != started:
            break
        recorded.update(descendants(pid, table))
        time.sleep(POLL_S)
    recorded.pop(os.getpid(), None)
    left = still_running(recorded)
    for target in left:
        try:
            os.kill(target, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GRACE_S
    while still_running(recorded) and time.monotonic() < deadline:
        time.sleep(0.1)
    for target in still_running(recorded):
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def start(pid: int | None = None) -> subprocess.Popen | None:
    """Watch ``pid`` (default: this process) from a process of its own; None where there is no /proc."""
    if not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "infra.watchdog", str(pid or os.getpid())],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=Path(__file__).resolve().parent.parent,
    )


if __name__ == "__main__":
    watch(int(sys.argv[1]))
