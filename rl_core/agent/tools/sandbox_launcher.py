"""Started by the ``python`` tool as ``python -I -S sandbox_launcher.py SPEC`` (a fresh interpreter: no threads, so
forking here is safe): isolates, then runs the code in another fresh interpreter. Standard library only.

1. new network and PID namespaces (and a user namespace when not root): no network at all; the code's process is the
   namespace's first process, so every process it starts dies with it. Refuses (exit 97) when unsharing fails;
2. in the forked child: the working folder, resource limits (address space, CPU seconds, processes, file size, open
   files, no core), an unprivileged user when root, death with this launcher (``PR_SET_PDEATHSIG``), stdin from
   /dev/null, an empty environment; then ``exec`` of ``python -I -S -c CODE``;
3. exits with the child's status (a signal as 128 + its number).
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG = 1
REFUSED = 97


def refuse(reason):
    sys.stderr.write(f"sandbox refused: {reason}\n")
    sys.stderr.flush()
    os._exit(REFUSED)


def isolate_namespaces(libc):
    root = os.geteuid() == 0
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNET | CLONE_NEWPID | (0 if root else CLONE_NEWUSER)
    if libc.unshare(flags) != 0:
        refuse(f"cannot make network and process namespaces ({os.strerror(ctypes.get_errno())})")
    if not root:  # the same user inside the new user namespace
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as handle:
                handle.write(text)


def run_child(libc, spec):
    limits = spec["limits"]
    os.chdir(spec["workdir"])
    for name, value in (
        ("RLIMIT_AS", limits["memory_mb"] << 20),
        ("RLIMIT_CPU", limits["cpu_s"]),
        ("RLIMIT_NPROC", limits["max_processes"]),
        ("RLIMIT_FSIZE", limits["max_file_mb"] << 20),
        ("RLIMIT_NOFILE", 64),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:  # after the user change, which clears it
        refuse("cannot tie the code's process to the launcher")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    python = spec["python"]
    os.execve(python, [python, "-I", "-S", "-c", spec["code"]], {})


def main():
    spec = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    isolate_namespaces(libc)
    pid = os.fork()
    if pid == 0:
        try:
            run_child(libc, spec)
        except BaseException as error:  # noqa: BLE001 - anything that stops the isolation refuses the run
            refuse(f"{type(error).__name__}: {error}")
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    sys.exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main()
