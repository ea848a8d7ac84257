"""The commands that deploy the flows: ``serve`` (deployments of a Prefect server), ``deploy`` (a work pool),
``k8s-render`` (Kubernetes manifests)."""

from __future__ import annotations

import argparse
import signal
import sys

from flows.cli.stack_commands import use_stack
from flows.prefect_server import configure_prefect


def _serve(args: argparse.Namespace) -> int:
    # Ctrl-C stops it (as it stops train, sweep and evaluate) even where it started with SIGINT ignored, which Python
    # then leaves ignored: a background job of a script, a test runner's child
    signal.signal(signal.SIGINT, signal.default_int_handler)
    configure_prefect()
    use_stack()
    from flows.deployments import PrefectUnavailableError, serve_deployments
    from flows.sweep_space import SweepError

    options = {
        "search": args.sweep_search,
        "metric": args.sweep_metric,
        "direction": args.sweep_direction,
        "trials": args.sweep_trials,
    }
    try:
        serve_deployments(
            train_concurrency=args.train_concurrency,
            train_retries=args.train_retries,
            sweep_cron=args.sweep_cron,
            sweep_interval_s=args.sweep_interval,
            sweep_overrides=args.sweep_overrides,
            sweep_options=options,
        )
    except (PrefectUnavailableError, SweepError, ValueError) as error:
        print(f"ppoflow serve: {error}", file=sys.stderr)
        return 2
    return 0


def _deploy(args: argparse.Namespace) -> int:
    use_stack()
    from flows.deployments import PrefectUnavailableError, register_in_work_pool

    try:
        names = register_in_work_pool(
            args.work_pool, train_concurrency=args.train_concurrency, train_overrides=args.train_overrides
        )
    except (PrefectUnavailableError, ValueError) as error:
        print(f"ppoflow deploy: {error}", file=sys.stderr)
        return 2
    print(f"registered {', '.join(names)} in work pool {args.work_pool!r}")
    return 0


def _render_k8s(args: argparse.Namespace) -> int:
    from infra.k8s.render import VALUES_FILE, load_values, write

    try:
        values = load_values(args.values or VALUES_FILE, args.set)
    except ValueError as error:
        print(f"ppoflow k8s-render: {error}", file=sys.stderr)
        return 2
    for path in write(values, args.out):
        print(path)
    return 0


def add_commands(commands: argparse._SubParsersAction) -> None:
    """``serve``, ``deploy`` and ``k8s-render``."""
    serve = commands.add_parser(
        "serve",
        help="serve the train, evaluate and sweep flows as deployments of the Prefect server in PREFECT_API_URL",
    )
    serve.add_argument(
        "--train-concurrency", type=int, default=1, help="training runs at once (default 1: one machine)"
    )
    serve.add_argument(
        "--train-retries",
        type=int,
        default=0,
        help="flow-run retries of a failed training run (from its latest checkpoint)",
    )
    serve.add_argument("--sweep-cron", help='run the sweep deployment on this cron schedule, e.g. "0 2 * * *"')
    serve.add_argument("--sweep-interval", type=float, help="or every this many seconds")
    serve.add_argument("--sweep-overrides", nargs="+", help="the scheduled sweep's overrides (Hydra sweep syntax)")
    serve.add_argument("--sweep-search", choices=["grid", "random", "tpe"], default="grid")
    serve.add_argument("--sweep-trials", type=int, default=8)
    serve.add_argument("--sweep-metric", default="auto")
    serve.add_argument("--sweep-direction", choices=["max", "min"], default="max")
    serve.set_defaults(run=_serve)
    deploy = commands.add_parser(
        "deploy", help="register the deployments in a Prefect work pool (its workers run them; see infra/k8s)"
    )
    deploy.add_argument("--work-pool", required=True)
    deploy.add_argument("--train-concurrency", type=int, default=1)
    deploy.add_argument(
        "--train-overrides",
        nargs="+",
        help="the train form's default overrides (e.g. trainer.nnodes=2 trainer.n_gpus_per_node=8)",
    )
    deploy.set_defaults(run=_deploy)
    render = commands.add_parser(
        "k8s-render", help="write the Kubernetes manifests (KubeRay, Prefect, MLflow, PostgreSQL) from a values file"
    )
    render.add_argument("out", help="output folder (then: kubectl apply -f OUT)")
    render.add_argument("--values", help="the values file (default infra/k8s/values.yaml)")
    render.add_argument("--set", nargs="+", help="key.path=value overrides of the values")
    render.set_defaults(run=_render_k8s)
