"""The commands of the local stack and the cluster: ``up``, ``down``, ``status``, ``workers``, ``ui``."""

from __future__ import annotations

import argparse
import os
import sys


def use_stack() -> str:
    """Point Prefect, MLflow and Ray at the local stack when ``ppoflow up`` runs one (variables already set win);
    returns a line saying which services the command uses."""
    from infra.stack import active_stack

    stack = active_stack()
    if stack is None:
        env = os.environ.get
        return (
            f"no `ppoflow up` stack: Prefect {env('PREFECT_API_URL') or 'without a server'}, MLflow "
            f"{env('MLFLOW_TRACKING_URI') or 'at trainer.tracking_uri'}, Ray "
            f"{env('RAY_ADDRESS') or 'at trainer.ray.address, else a local one'}"
        )
    from flows.prefect_server import point_prefect_at

    point_prefect_at({key: value for key, value in stack.env().items() if key not in os.environ})
    return (
        f"the ppoflow stack: Prefect {os.environ['PREFECT_API_URL']}, MLflow {os.environ['MLFLOW_TRACKING_URI']}, Ray "
        f"{os.environ['RAY_ADDRESS']}"
    )


def _up(args: argparse.Namespace) -> int:
    from infra.stack import LAUNCHER, UNIX_SOCKET_PATH_BYTES, launcher_socket, up
    from infra.team_backend import BUCKET

    ports = {name: getattr(args, f"{name}_port") for name in ("prefect", "mlflow", "ray", "postgres", "s3")}
    try:
        stack, started = up(args.data_dir, {name: port for name, port in ports.items() if port}, args.backend)
    except (RuntimeError, TimeoutError) as error:
        print(f"ppoflow up: {error}", file=sys.stderr)
        return 1
    print(f"ppoflow stack, {stack.backend} backend (data in {stack.data_dir}):")
    for name, service in stack.services.items():
        print(f"  {name:8} {service.url:32} pid {service.pid:<8} {'started' if name in started else 'already running'}")
    if LAUNCHER not in stack.services:
        print(
            f"  (no launcher: its socket path {launcher_socket()} is longer than a Unix socket's "
            f"{UNIX_SOCKET_PATH_BYTES} bytes; commands run in their own process: a shorter PPOFLOW_HOME gives it one)"
        )
    if stack.backend == "postgres":
        print(f"checkpoints on its S3 store: trainer.default_local_dir=s3://{BUCKET}/checkpoints/<run>")
    print("use it from a shell with:")
    for key, value in stack.env().items():
        print(f"export {key}={value}")
    return 0


def _down(args: argparse.Namespace) -> int:
    from infra.stack import down

    stopped = down()
    print(f"stopped {', '.join(stopped)} (data kept)" if stopped else "no ppoflow stack is recorded as running")
    return 0


def _status(args: argparse.Namespace) -> int:
    from infra.stack import Stack, state_file

    stack = Stack.load()
    if stack is None:
        print(f"no ppoflow stack is running ({state_file()} does not exist); `ppoflow up` starts one")
        return 1
    healthy = True
    print(f"ppoflow stack, {stack.backend} backend (data in {stack.data_dir}):")
    for name, service in stack.services.items():
        alive, answers = service.alive(), service.answers()
        healthy &= alive and answers
        print(
            f"  {name:8} {service.url:32} pid {service.pid:<8} {'running' if alive else 'not running'}, "
            f"{'answers' if answers else 'does not answer'}"
        )
    return 0 if healthy else 1


def _workers(args: argparse.Namespace) -> int:
    use_stack()
    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        print(
            "ppoflow workers: no cluster to look at: start the stack (`ppoflow up`), set RAY_ADDRESS or give --address",
            file=sys.stderr,
        )
        return 2
    from flows.tracking import DEFAULT_TRACKING_URI, open_store
    from flows.workers import kill_worker_group, namespace_of_run, worker_groups
    from infra.cluster import ClusterUnreachableError, connect

    try:
        connect(address)
    except ClusterUnreachableError as error:
        print(f"ppoflow workers: {error}", file=sys.stderr)
        return 2
    tracking_uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    groups = worker_groups(tracking_uri)
    if args.action == "list":
        print(f"{'run':34} {'ranks':>5} {'age':>8}  {'resources':24} {'run status':10} {'pids':12} namespace")
        for group in groups:
            age = f"{group.age_s / 60:.1f} min" if group.age_s is not None else "busy"
            resources = ", ".join(f"{k} {v:g}" for k, v in sorted(group.resources.items()))
            print(
                f"{group.run_id:34} {group.ranks:>5} {age:>8}  {resources:24} {group.run_status:10} "
                f"{' '.join(map(str, group.pids)) or 'busy':12} {group.namespace}"
            )
        return 0
    if args.orphans:
        targets = {g.run_id: g.namespace for g in groups if g.run_id != "?" and g.run_status != "RUNNING"}
    else:
        client = open_store(tracking_uri)
        targets = {run_id: namespace_of_run(run_id, client, groups) for run_id in args.runs}
    if not targets:
        print(
            "nothing to kill: name runs (ppoflow workers kill RUN_ID ...) or --orphans (groups whose MLflow run is not "
            "running)"
        )
        return 0 if args.orphans else 2
    for run_id, namespace in targets.items():
        killed = kill_worker_group(namespace) if namespace else 0
        print(f"{run_id}: killed {killed} worker(s)" + ("" if namespace else " (no workers of that run found)"))
    return 0


def _ui(args: argparse.Namespace) -> int:
    # the command line is the entry point of every floor: the only place flows names ui
    from flows.tracking import DEFAULT_TRACKING_URI
    from ui.server import Links, serve

    links = Links.from_environment()
    for name in ("mlflow_url", "prefect_url", "ray_dashboard_url"):
        if getattr(args, name):
            setattr(links, name, getattr(args, name))
    serve(
        args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI,
        args.host,
        args.port,
        links,
        args.experiment,
        args.allowed_host,
    )
    return 0


def add_commands(commands: argparse._SubParsersAction) -> None:
    """``up``, ``down``, ``status``, ``workers`` and ``ui``."""
    _add_up(commands)
    down = commands.add_parser(
        "down", help="stop the services `ppoflow up` started (and nothing else); their data is kept"
    )
    down.set_defaults(run=_down)
    status = commands.add_parser("status", help="say which services of the local stack run and answer")
    status.set_defaults(run=_status)
    workers = commands.add_parser("workers", help="list the training runs' worker groups on the cluster, or kill them")
    workers.add_argument("action", choices=["list", "kill"])
    workers.add_argument("runs", nargs="*", help="kill: the MLflow run ids whose workers to end")
    workers.add_argument(
        "--orphans",
        action="store_true",
        help="kill: every group whose MLflow run is not running (finished, failed, unknown)",
    )
    workers.add_argument("--address", help="the Ray cluster (default: the stack's, else RAY_ADDRESS)")
    workers.add_argument(
        "--tracking-uri",
        help="the MLflow store of the runs (default: the stack's, else MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)",
    )
    workers.set_defaults(run=_workers)
    ui = commands.add_parser(
        "ui",
        help="serve the run inspector page (curves, stage timeline, rollout samples, config diffs) of an MLflow store",
    )
    ui.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    ui.add_argument("--port", type=int, default=8420)
    ui.add_argument(
        "--tracking-uri",
        help="the MLflow store (default: MLFLOW_TRACKING_URI, else the embedded default's sqlite:///mlflow.db)",
    )
    ui.add_argument("--experiment", default="ppoflow", help="the experiment shown first (trainer.project_name)")
    ui.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        help="a name requests may give in their Host header besides "
        "the loopback names and --host (a DNS name in front of it); repeatable",
    )
    ui.add_argument("--mlflow-url", help="the MLflow UI, for links (default http://127.0.0.1:5000)")
    ui.add_argument("--prefect-url", help="the Prefect UI, for links (default PREFECT_UI_URL or http://127.0.0.1:4200)")
    ui.add_argument("--ray-dashboard-url", help="the Ray dashboard, for links (default http://127.0.0.1:8265)")
    ui.set_defaults(run=_ui)


def _add_up(commands: argparse._SubParsersAction) -> None:
    """``up``: where the data goes, the ports, the backend."""
    up = commands.add_parser(
        "up", help="start the local stack on 127.0.0.1 (Prefect server, MLflow server, Ray head); idempotent"
    )
    up.add_argument(
        "--data-dir", help="where the services keep their data (default $PPOFLOW_HOME/data, PPOFLOW_HOME=~/.ppoflow)"
    )
    up.add_argument("--prefect-port", type=int, help="default 4200")
    up.add_argument("--mlflow-port", type=int, help="default 5000")
    up.add_argument("--ray-port", type=int, help="default 6379")
    up.add_argument(
        "--backend",
        choices=["sqlite", "postgres"],
        help="the services' stores: SQLite and a local folder (the default), or PostgreSQL and an S3-compatible store "
        "(moto's server), both started on 127.0.0.1 too (pip install 'ppoflow[team]' and Debian's postgresql)",
    )
    up.add_argument("--postgres-port", type=int, help="postgres backend: default 5432")
    up.add_argument("--s3-port", type=int, help="postgres backend: default 9000")
    up.set_defaults(run=_up)
