"""The persistent local stack behind ``ppoflow up / down / status``: a Prefect server, an MLflow tracking server and a
Ray head, all on 127.0.0.1, their data in one folder, and a launcher that runs ``ppoflow train`` in processes with its
modules imported (flows/launcher.py; a Unix socket, started last: it imports for seconds). Their stores: SQLite
files and a local artifact folder (the ``sqlite`` backend, the default), or PostgreSQL and an S3-compatible store that
``up`` starts too (``postgres``: infra/team_backend.py).

``up`` starts each service as its own process group (so that ``down`` stops exactly what ``up`` started, and
nothing else), records them in ``$PPOFLOW_HOME/stack.json`` (default ``~/.ppoflow``) and waits until each
answers; run again, it starts only what is not answering. ``down`` stops the recorded groups (data kept).
``ppoflow train`` uses the stack when it answers, through the three environment variables of :meth:`Stack.env`.

A service is its process group *and* the start time of the group's leader: a stale ``stack.json`` (a reboot, a crash)
whose pids now belong to other programs names nothing, and nothing is signalled that ``up`` did not start. A
service that exits while starting is seen at once (its exit is reaped), and the last error line of its log is shown.

Choices measured elsewhere (../shared/DESIGN.md): MLflow's server with one worker and job execution off (else
~2.4 GiB and 25 s to start); Prefect's UI needs ``PREFECT_UI_API_URL`` on a port other than 4200; Ray with
token authentication, on loopback (infra/cluster.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from http.client import HTTPException
from pathlib import Path

from infra import team_backend
from infra.ray_settings import INLINE_OBJECTS_ENV, LOCAL_CLUSTER_ENV, LOOPBACK_ENV, ensure_auth_token
from infra.telemetry import telemetry_env
from infra.watchdog import all_stats, stat

HOST = "127.0.0.1"
DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000, "ray": 6379}
# the postgres backend's stores, started (and answering) before the servers that use them
STORE_PORTS = {"postgres": 5432, "s3": 9000}
BACKENDS = ("sqlite", "postgres")
START_TIMEOUT_S = 180.0
# ports Ray keeps for itself by default: its client server (10001) and its workers (10002-19999, `ray start
# --min-worker-port/--max-worker-port`); a service there fails, or makes a Ray worker fail later
RAY_RESERVED_PORTS = range(10001, 20000)


def stack_home() -> Path:
    return Path(os.environ.get("PPOFLOW_HOME", "~/.ppoflow")).expanduser()


def state_file() -> Path:
    return stack_home() / "stack.json"


# the fourth service: ``ppoflow train``'s modules imported, waiting for commands on a Unix socket (flows/launcher.py)
LAUNCHER = "launcher"


def launcher_socket() -> Path:
    return stack_home() / "launcher.sock"


UNIX_SOCKET_PATH_BYTES = 107  # Linux's limit (sun_path)


def launcher_fits() -> bool:
    """Whether the launcher's socket path fits a Unix socket's address; without it commands run in their own process
    (``ppoflow up`` says so: a shorter PPOFLOW_HOME gives it one)."""
    return len(os.fsencode(launcher_socket())) <= UNIX_SOCKET_PATH_BYTES


def unix_socket_answers(path: str | Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


@dataclass
class Service:
    name: str
    pid: int  # the leader of the service's own process group
    port: int
    url: str
    log: str
    started: int | None = None  # the leader's start time (clock ticks since boot): with pid, who the service is

    def members(self) -> list[int]:
        """The live processes of the service's group: its leader (when it is the process ``up`` started, not a zombie),
        or, once the leader is gone, what it left in the group (started after it: never a stranger's)."""
        leader = stat(self.pid)
        if leader is not None and self.started is not None and leader[3] == self.started:
            return [self.pid] if leader[0] != "Z" else self._left_behind()
        return self._left_behind() if leader is None else []

    def _left_behind(self) -> list[int]:
        if self.started is None:
            return []
        return [
            pid
            for pid, (state, _, group, started) in all_stats().items()
            if group == self.pid and pid != self.pid and state != "Z" and started >= self.started
        ]

    def alive(self) -> bool:
        return bool(self.members())

    def answers(self, timeout_s: float = 3.0) -> bool:
        if self.name == LAUNCHER:
            return unix_socket_answers(self.url.removeprefix("unix:"))
        if self.name in ("ray", "postgres", "s3"):
            return port_open(self.port, timeout_s)
        path = "/api/health" if self.name == "prefect" else "/health"
        return http_ok(self.url.rstrip("/").removesuffix("/api") + path, timeout_s)


def service_ports(backend: str) -> dict[str, int]:
    """The services of a backend's stack and their default ports, in the order they start."""
    return {**(STORE_PORTS if backend == "postgres" else {}), **DEFAULT_PORTS}


@dataclass
class Stack:
    data_dir: str
    services: dict[str, Service] = field(default_factory=dict)
    backend: str = "sqlite"

    def env(self) -> dict[str, str]:
        """What a shell (or ``ppoflow train``) needs to use the stack: on the postgres backend, the S3 store's endpoint
        and keys too (checkpoints at ``trainer.default_local_dir=s3://ppoflow/...``)."""
        store = team_backend.s3_env(Path(self.data_dir), self.services["s3"].port) if "s3" in self.services else {}
        return {
            "PREFECT_API_URL": self.services["prefect"].url,
            "MLFLOW_TRACKING_URI": self.services["mlflow"].url,
            "RAY_ADDRESS": f"{HOST}:{self.services['ray'].port}",
            **store,
        }

    def save(self) -> None:
        path = state_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(".tmp")
        staging.write_text(json.dumps(asdict(self), indent=1))
        os.replace(staging, path)

    @classmethod
    def load(cls) -> Stack | None:
        path = state_file()
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        services = {name: Service(**service) for name, service in raw["services"].items()}
        return cls(raw["data_dir"], services, raw.get("backend", "sqlite"))


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the stack's servers are on loopback


def http_ok(url: str, timeout_s: float) -> bool:
    """Whether a GET of the local server's ``url`` answers 200 within ``timeout_s``. Polled while a server boots, so
    the standard library's client, without proxies: each ``httpx.get`` builds a client and its SSL context (~50 ms of
    CPU here, 0.3 ms for this), which polling every 0.1 s took from the boot on 2 cores."""
    try:
        with _NO_PROXY.open(url, timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, HTTPException, ValueError):  # refused, timed out, an error status (HTTPError), a bad answer
        return False


def port_open(port: int, timeout_s: float = 1.0) -> bool:
    try:
        socket.create_connection((HOST, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


# Prefect's server runs at the lowest CPU priority: it records task runs from their events asynchronously (~40 ms of
# CPU per task run), and on a small CPU machine, at normal priority, it preempts the workers' threads mid-stage
# (bench/README.md: a step 1.6x slower). It boots at nice 19 and, once it answers, runs under SCHED_IDLE: on the CPU
# the workers leave idle (bench/README.md: the small run's mean step 60 -> 51 ms).
LOWEST_PRIORITY = 19

# The settings the stack's Prefect server and a command's temporary one start with (variables already set win):
# * the task-run recorder writes up to 100 task runs' events at once, at least every second, instead of one at a
#   time: ~36 -> ~15 ms of server CPU per task run, taken from the workers on a small machine (bench/README.md: the
#   step_overhead ratio 1.20 -> 1.11 at --batch 16); every task run is still recorded, at most a second later;
# * Prefect's database stays bounded on long runs: a training step makes 6-8 task runs, each with three state-change
#   events (~90 KB of events and ~35 KB of task runs per step, measured). The flow deletes the task runs of all but its
#   last trainer.prefect_history_steps steps; the server's vacuum deletes the task runs' events after an hour (checked
#   every 10 min) instead of Prefect's default 7 days.
PREFECT_SERVER_SETTINGS = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_SERVICES_DB_VACUUM_EVENT_RETENTION_OVERRIDES": json.dumps(
        {f"prefect.task-run.{state}": 3600 for state in ("Pending", "Running", "Completed", "Failed", "Crashed")}
        | {"prefect.flow-run.heartbeat": 86400}
    ),
    "PREFECT_SERVER_SERVICES_DB_VACUUM_LOOP_SECONDS": "600",
}


def _tool(name: str) -> str:
    return shutil.which(name, path=os.path.dirname(sys.executable)) or name


def service_command(
    name: str, port: int, data: Path, stores: dict[str, int] | None = None
) -> tuple[list[str], dict[str, str], str]:
    """(command, extra environment, URL) of one service, its data under ``data``; ``stores``: the ports of the
    postgres backend's PostgreSQL and S3 store (None: the sqlite backend)."""
    if name == "postgres":
        return team_backend.postgres_command(port, data)
    if name == "s3":
        return team_backend.s3_command(port, data)
    team = team_backend.server_env(data, stores["postgres"], stores["s3"]) if stores else {}
    if name == "prefect":
        url = f"http://{HOST}:{port}/api"
        env = {
            "PREFECT_HOME": str(data / "prefect"),
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{data / 'prefect' / 'prefect.db'}",
            "PREFECT_UI_API_URL": url,
            "PREFECT_API_URL": url,
            **telemetry_env(),
            **{key: os.environ.get(key, value) for key, value in PREFECT_SERVER_SETTINGS.items()},
            **team.get("prefect", {}),
        }
        return [_tool("prefect"), "server", "start", "--host", HOST, "--port", str(port)], env, url
    if name == "mlflow":
        store, artifacts = (
            (team_backend.database_url("postgresql+psycopg", stores["postgres"], "mlflow"), team_backend.ARTIFACTS)
            if stores
            else (f"sqlite:///{data / 'mlflow.db'}", str(data / "mlartifacts"))
        )
        command = [
            _tool("mlflow"),
            "server",
            "--host",
            HOST,
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            store,
            "--artifacts-destination",
            artifacts,
        ]
        env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **telemetry_env(), **team.get("mlflow", {})}
        return command, env, f"http://{HOST}:{port}"
    if name == LAUNCHER:
        path = launcher_socket()
        return [sys.executable, "-m", "flows.launcher", str(path)], {}, f"unix:{path}"
    if name == "ray":
        command = [
            _tool("ray"),
            "start",
            "--head",
            "--block",
            f"--node-ip-address={HOST}",
            f"--port={port}",
            "--include-dashboard=false",
        ]
        env = {**LOOPBACK_ENV, **LOCAL_CLUSTER_ENV, **INLINE_OBJECTS_ENV, **telemetry_env()}
        return command, env, f"ray://{HOST}:{port}"
    raise KeyError(name)


def check_port(name: str, port: int) -> None:
    if name == LAUNCHER:  # a Unix socket, not a port
        return
    if port in RAY_RESERVED_PORTS:
        raise RuntimeError(
            f"port {port} for {name} is in the range Ray keeps for its client and workers "
            f"({RAY_RESERVED_PORTS.start}-{RAY_RESERVED_PORTS.stop - 1}): give ppoflow up --{name}-port another port"
        )
    if port_open(port):
        raise RuntimeError(
            f"port {port} on {HOST} is taken by another program: stop it, or give ppoflow up --{name}-port another port"
        )


SERVICE_PROCESSES: dict[int, subprocess.Popen] = {}  # the services this process started


def start_service(name: str, port: int, data: Path, stores: dict[str, int] | None = None) -> Service:
    check_port(name, port)
    command, env, url = service_command(name, port, data, stores)
    if name == "ray":
        ensure_auth_token(_tool("ray"), {**os.environ, **env})
    logs = data / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with open(log, "ab") as output:
        process = subprocess.Popen(
            command,
            env={**os.environ, **env},
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=data,
            preexec_fn=_preexec(name),
        )
    SERVICE_PROCESSES[process.pid] = process  # polled while it starts: an exit is reaped, not left a zombie
    return Service(name, process.pid, port, url, str(log), started=stat(process.pid)[3])


def _preexec(name: str):
    """Prefect's server at the lowest CPU priority; PostgreSQL as its own user when this process is root."""
    if name == "prefect":
        return lambda: os.nice(LOWEST_PRIORITY)
    return team_backend.as_user(team_backend.server_user()) if name == "postgres" else None


def lower_priority(pid: int, idle: bool = False) -> None:
    """Every thread of process ``pid`` at the lowest CPU priority: nice 19, or with ``idle`` Linux's SCHED_IDLE
    policy (where the platform has it), under which a thread runs on CPU time no other thread wants: a worker's
    thread that wakes takes its CPU at once, as from an idle CPU, where under nice 19 it may wait for the server's
    slice or for another CPU. Linux keeps the priority per thread; threads started later inherit their creator's."""
    tasks = Path(f"/proc/{pid}/task")
    for thread in tasks.iterdir() if tasks.is_dir() else [Path(str(pid))]:
        try:
            if idle and hasattr(os, "SCHED_IDLE"):
                os.sched_setscheduler(int(thread.name), os.SCHED_IDLE, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, int(thread.name), LOWEST_PRIORITY)
        except (ProcessLookupError, PermissionError):
            pass


def wait_until_answering(services: list[Service], timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    for service in services:
        while not service.answers():
            process = SERVICE_PROCESSES.get(service.pid)
            if (process is not None and process.poll() is not None) or not service.alive():
                if process is not None:  # it may have ended between poll() and alive(): reap it for its exit code
                    try:
                        process.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
                code = (
                    f" (exit code {process.returncode})"
                    if process is not None and process.returncode is not None
                    else ""
                )
                raise RuntimeError(
                    f"{service.name} exited while starting{code}: {last_error_line(service.log)} (its log: "
                    f"{service.log})"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{service.name} did not answer on port {service.port} within {timeout_s:.0f}s: "
                    f"{last_error_line(service.log)} (its log: {service.log})"
                )
            time.sleep(0.5)


def last_error_line(path: str) -> str:
    """The last line of a log that reads like an error (else its last line): what a service died of."""
    lines = [line.strip() for line in Path(path).read_text(errors="replace").splitlines() if line.strip()]
    errors = [
        line
        for line in lines
        if any(word in line for word in ("Error", "error", "ERROR", "Exception", "failed", "Failed"))
    ]
    return (errors or lines or ["(its log is empty)"])[-1][:500]


def up(
    data_dir: str | Path | None = None, ports: dict[str, int] | None = None, backend: str | None = None
) -> tuple[Stack, list[str]]:
    """Start what is not running (idempotent); returns the stack and the names of the services started now.
    ``backend``: ``sqlite`` or ``postgres`` (default: the recorded stack's, else sqlite)."""
    existing = Stack.load()
    backend = backend or (existing.backend if existing else "sqlite")
    if backend not in BACKENDS:
        raise RuntimeError(f"backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if existing is not None and existing.backend != backend and any(s.alive() for s in existing.services.values()):
        raise RuntimeError(
            f"the stack runs on the {existing.backend} backend: `ppoflow down` first, then ppoflow up "
            f"--backend {backend}"
        )
    data = Path(data_dir or (existing.data_dir if existing else stack_home() / "data")).expanduser().resolve()
    data.mkdir(parents=True, exist_ok=True)
    stack = Stack(str(data), backend=backend)
    wanted = {**service_ports(backend), **(ports or {})}
    for name, port in wanted.items():  # every port checked before anything starts
        service = existing.services.get(name) if existing else None
        if service is None or not service.alive():
            check_port(name, port)
    started: list[Service] = []
    stores = None
    try:
        launcher = {LAUNCHER: 0} if launcher_fits() else {}
        for name, port in {**wanted, **launcher}.items():  # the launcher last: it imports for seconds
            if name == "prefect" and backend == "postgres":  # the stores answer before the servers using them start
                wait_until_answering(started)
                stores = {store: stack.services[store].port for store in STORE_PORTS}
                team_backend.prepare(data, stores["postgres"], stores["s3"])
            service = existing.services.get(name) if existing else None
            if service is not None and service.alive() and service.answers():
                stack.services[name] = service
                continue
            if service is not None and service.alive():  # running but not answering: replace it
                stop_service(service)
            stack.services[name] = start_service(name, port, data, stores)
            started.append(stack.services[name])
            stack.save()
        wait_until_answering(started)
        for service in started:
            if service.name == "prefect":  # booted: from now on it runs on the CPU time the runs leave idle
                for pid in service.members():
                    lower_priority(pid, idle=True)
    except BaseException:
        for service in reversed(started):
            stop_service(service)
        if existing is None:
            state_file().unlink(missing_ok=True)
        raise
    return stack, [service.name for service in started]


def stop_service(service: Service, timeout_s: float = 30.0) -> None:
    """SIGTERM to the service's process group, SIGKILL to what remains after ``timeout_s``; nothing when the group is
    not the one ``up`` started (:meth:`Service.members`)."""
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        if not service.alive():
            break
        try:
            os.killpg(service.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while service.alive() and time.monotonic() < deadline:
            _reap(service)
            time.sleep(0.2)
    _reap(service)


def _reap(service: Service) -> None:
    process = SERVICE_PROCESSES.get(service.pid)
    if process is not None:
        process.poll()


def down() -> list[str]:
    """Stop the recorded services (their data stays); returns their names."""
    stack = Stack.load()
    if stack is None:
        return []
    for service in reversed(stack.services.values()):  # the stores last: the servers using them end first
        stop_service(service)
    state_file().unlink(missing_ok=True)
    return list(stack.services)


def active_stack() -> Stack | None:
    """The recorded stack when every server answers (the launcher aside: without it commands run in their own
    process), else None."""
    stack = Stack.load()
    servers = service_ports(stack.backend) if stack is not None else {}
    if stack is None or not set(servers) <= set(stack.services):
        return None
    return stack if all(stack.services[name].answers(timeout_s=2.0) for name in servers) else None
