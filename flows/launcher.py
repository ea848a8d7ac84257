"""The stack's launcher: ``ppoflow train`` on a running ``ppoflow up`` stack starts in a process whose modules are
imported already.

A command's own start costs seconds of imports before its first useful work (torch, transformers, Prefect's flow
engine, MLflow: ~6 CPU-seconds, bench/README.md). ``ppoflow up`` therefore starts one more service, this module:
it imports what ``ppoflow train`` imports (:data:`PRELOAD`), then waits on a Unix socket beside the stack's state
(``$PPOFLOW_HOME/launcher.sock``, the owner's only). ``ppoflow train`` connects (:func:`hand_over`) and sends its
arguments, working folder, file-creation mask, environment and ``sys.path``, with its stdin, stdout and stderr as
file descriptors; the launcher forks, and the child becomes the command: the descriptors are its own, the folder,
mask, environment and path the command's, Prefect's settings and logging read again from that environment, and it
runs the same ``flows.cli.main`` that the command would have run. The command waits for the child's exit code and
exits with it, passing on SIGINT/SIGTERM/SIGHUP (Ctrl-C stops the run as it would in the command's own process); when
the command is killed, its socket closes and the child gets SIGTERM.

The command runs in its own process instead (and says why with ``--verbose``) when there is no launcher, when
``PPOFLOW_LAUNCHER=0``, or when the launcher refuses: another Python or another checkout of the project, a thread
running in it (a fork copies only the forking thread), or a source file of the project changed since it imported it
(it then starts again with the new code, at once, for the next command). The launcher holds no run's state: each
command is a new process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from infra.stack import launcher_socket

# what ``ppoflow train`` imports before its flow runs (flows/cli/flow_commands.py::_train, flows/prestart.py)
PRELOAD = (
    "flows.config",
    "flows.resume",
    "rl_core.input_checks",
    "infra.cluster",
    "flows.prestart",
    "flows.workers",
    "flows.inputs",
    "flows.secrets",
    "flows.tracking",
    "flows.train",
    "prefect.main",
    "transformers",
)
PROJECT_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flows", "rl_core", "infra", "ui")  # the project's code, whose changes restart the launcher
ENV_SWITCH = "PPOFLOW_LAUNCHER"  # "0": every command runs in its own process (a launched one hands nothing over)


# --- the command's side ------------------------------------------------------------------------------------------


def hand_over(argv: list[str], launched_at: float, verbose: bool = False) -> int | None:
    """Run the command ``argv`` in a process forked by the stack's launcher; its exit code, or None when the command
    is to run in this process (no launcher, ``PPOFLOW_LAUNCHER=0``, or the launcher refused; ``verbose`` says why).
    ``launched_at``: when the command began (``time.monotonic()``), for its start-up phases."""
    path = launcher_socket()
    if os.environ.get(ENV_SWITCH) == "0" or not path.exists():
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(str(path))
    except OSError:
        connection.close()
        return None
    umask = os.umask(0)
    os.umask(umask)
    request = {
        "argv": argv,
        "cwd": os.getcwd(),
        "umask": umask,
        "env": dict(os.environ),
        "path": sys.path,
        "python": sys.executable,
        "code": str(PROJECT_ROOT),
        "launched_at": launched_at,
    }
    replies = connection.makefile("rb")
    try:
        socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        answer = json.loads(replies.readline() or "null")
    except (OSError, ValueError):
        answer = None
    command = f"ppoflow {argv[0]}" if argv else "ppoflow"
    if not answer or "pid" not in answer:
        if verbose:
            why = answer["refused"] if answer else "it did not answer"
            print(f"{command}: runs in its own process: the stack's launcher refused ({why})", flush=True)
        connection.close()
        return None
    child = answer["pid"]
    if verbose:
        print(f"{command}: runs in a process of the stack's launcher (pid {child}, modules imported)", flush=True)

    def pass_on(signum: int, frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:  # it has ended: its exit code is on its way
            pass

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, pass_on)
    line = replies.readline()  # blocks until the child ends; a signal's handler runs and the read goes on
    if not line:
        print(f"{command}: its process (pid {child}) ended without an exit code", file=sys.stderr)
        return 1
    return int(json.loads(line)["exit"])


# --- the launcher's side -----------------------------------------------------------------------------------------


def project_sources() -> dict[str, int]:
    """The project's imported source files and their modification times (ns)."""
    folders = tuple(str(PROJECT_ROOT / package) + os.sep for package in PACKAGES)
    sources = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and file.startswith(folders) and os.path.isfile(file):
            sources[file] = os.stat(file).st_mtime_ns
    return sources


def changed_sources(sources: dict[str, int]) -> list[str]:
    """The files of ``sources`` (:func:`project_sources`) modified or removed since."""
    changed = []
    for file, mtime in sources.items():
        try:
            if os.stat(file).st_mtime_ns != mtime:
                changed.append(file)
        except OSError:
            changed.append(file)
    return changed


def refusal(request: dict, sources: dict[str, int]) -> str | None:
    """Why the launcher cannot run ``request`` as the command would run itself; None when it can."""
    if request.get("python") != sys.executable:
        return f"the command's Python is {request.get('python')}, the launcher's {sys.executable}"
    if request.get("code") != str(PROJECT_ROOT):
        return f"the command's code is at {request.get('code')}, the launcher's at {PROJECT_ROOT}"
    if threading.active_count() > 1:
        return f"{threading.active_count() - 1} thread(s) run in the launcher: a fork would copy only one"
    changed = changed_sources(sources)
    if changed:
        return f"{os.path.relpath(changed[0], PROJECT_ROOT)} changed since the launcher imported it (it restarts)"
    return None


def receive(connection: socket.socket) -> tuple[dict, list[int]] | None:
    """A request: one JSON line, the command's stdin, stdout and stderr with its first bytes; None for a connection
    closed at once (``ppoflow status`` asking whether the launcher answers)."""
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    if not data and not fds:
        return None
    while not data.endswith(b"\n"):
        more = connection.recv(1 << 16)
        if not more:
            raise ConnectionError("the command closed its connection mid-request")
        data += more
    if len(fds) != 3:
        raise ConnectionError(f"the command sent {len(fds)} file descriptor(s), not 3")
    return json.loads(data), fds


def serve(path: Path) -> None:
    """Import :data:`PRELOAD`, listen on ``path``, and fork each command that connects (:func:`become_command`). The
    loop runs in the main thread and starts none: the fork must copy a process with one thread."""
    import importlib

    from flows.prefect_server import configure_prefect

    configure_prefect()  # Prefect's logging settings, read when Prefect is imported, as in a command
    for module in PRELOAD:
        importlib.import_module(module)
    sources = project_sources()
    path.unlink(missing_ok=True)  # a launcher that was killed left its socket
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)  # the socket is the owner's only: a command hands over its environment
    listener.bind(str(path))
    os.umask(old_mask)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children are reaped by the kernel
    print(f"launcher: {len(sources)} project modules imported, listening on {path}", flush=True)
    offer_standby_in_a_child(listener)
    while True:
        connection, _ = listener.accept()
        try:
            received = receive(connection)
        except (OSError, ValueError) as error:
            print(f"launcher: a bad request: {error}", flush=True)
            received = None
        if received is None:
            connection.close()
            continue
        request, fds = received
        why_not = refusal(request, sources)
        if why_not is not None:
            connection.sendall(json.dumps({"refused": why_not}).encode() + b"\n")
            for fd in fds:
                os.close(fd)
            connection.close()
            if changed_sources(sources):  # the next command gets the new code
                print(f"launcher: {why_not}: restarting", flush=True)
                listener.close()
                os.execv(sys.executable, [sys.executable, "-m", "flows.launcher", str(path)])
            continue
        if os.fork() == 0:
            listener.close()
            become_command(connection, request, fds)  # ends the process
        for fd in fds:
            os.close(fd)
        connection.close()


def offer_standby_in_a_child(listener: socket.socket) -> None:
    """Fork a child that offers the standby worker group the stack's last run left
    (:func:`flows.standby_workers.offer_recorded_standby`): the first run after ``ppoflow up``, or after this launcher
    restarted with new code, adopts one too. The launcher serves commands meanwhile."""
    if os.fork() != 0:
        return
    listener.close()
    try:
        from flows.standby_workers import offer_recorded_standby

        print(f"launcher: {offer_recorded_standby()}", flush=True)
    except Exception as error:  # a head start only: the next run starts its workers itself
        print(f"launcher: no standby workers ({type(error).__name__}: {error})", flush=True)
    finally:
        import ray

        ray.shutdown()
        os._exit(0)


def become_command(connection: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked child: take the command's descriptors, folder, environment and path, run ``flows.cli.main`` with
    its arguments, send the exit code, exit with it (Python's normal exit: atexit handlers, the temporary server's
    stop). Ends the process."""
    os.setpgid(0, 0)  # a group of its own: stopping the launcher (``ppoflow down``) does not signal a running command
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the command waits for its own children
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[ENV_SWITCH] = "0"  # it is the command: it hands nothing over again (nor do commands it starts)
    sys.path[:] = request["path"]
    sys.argv = ["ppoflow", *request["argv"]]
    from prefect.context import refresh_global_settings_context
    from prefect.logging.configuration import setup_logging

    from flows.prefect_server import configure_prefect

    configure_prefect()  # as the command does first (its variables win)
    refresh_global_settings_context()  # the command's Prefect settings (the stack's, once it finds the stack)
    setup_logging(incremental=False)  # its console handlers on this process's stderr, its logging settings

    import atexit

    exit_code = [1]

    def send_exit_code() -> None:
        """The last exit handler: the command may end once it has the code, so this process ends here too."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the command's end closes once it has the code: not a kill
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            connection.sendall(json.dumps({"exit": exit_code[0]}).encode() + b"\n")
        except OSError:  # the command is gone
            pass
        os._exit(exit_code[0])

    atexit.register(send_exit_code)  # registered first, so it runs last
    connection.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")

    def stop_when_the_command_is_gone() -> None:
        if not connection.recv(1):  # the command's end of the socket closed: it was killed
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_the_command_is_gone, name="ppoflow-launcher-client", daemon=True).start()
    import flows.cli.flow_commands as flow_commands
    from flows.cli import main

    flow_commands.LAUNCHED = request["launched_at"]
    try:
        exit_code[0] = main(request["argv"])
    except SystemExit as stop:
        exit_code[0] = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    sys.exit(exit_code[0])


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
