"""The ``ppoflow`` command line: ``ppoflow <command> [args]``.

Commands import their modules lazily, so that a quick command does not pay for Prefect, Ray or MLflow.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback

from flows.prefect_server import configure_prefect, start_temporary_server


def _list_algorithms(args: argparse.Namespace) -> int:
    from rl_core.algos import ADVANTAGE_ESTIMATORS, KL_PENALTIES, LOSS_AGG_MODES, POLICY_LOSSES

    print("advantage estimators (algorithm.adv_estimator):      " + ", ".join(sorted(ADVANTAGE_ESTIMATORS)))
    print("policy losses (actor.policy_loss.loss_mode):          " + ", ".join(sorted(POLICY_LOSSES)))
    print("loss aggregation (actor.loss_agg_mode):               " + ", ".join(LOSS_AGG_MODES))
    print("KL penalties (algorithm.kl_penalty, actor.kl_loss_type): " + ", ".join(KL_PENALTIES))
    return 0


def _make_tiny_model(args: argparse.Namespace) -> int:
    from rl_core.models.tiny import make_tiny_model

    folder = make_tiny_model(
        args.out, seed=args.seed, hidden_size=args.hidden_size, num_layers=args.num_layers, family=args.family
    )
    print(f"wrote a tiny {args.family} checkpoint to {folder} (use it as actor_rollout_ref.model.path={folder})")
    return 0


def _prepare_gsm8k(args: argparse.Namespace) -> int:
    from rl_core.data.gsm8k import preprocess

    for split, path in preprocess(args.source, args.out).items():
        print(f"{split}: {path}")
    return 0


def _use_stack() -> str:
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
    for key, value in stack.env().items():
        os.environ.setdefault(key, value)
    return (
        f"the ppoflow stack: Prefect {os.environ['PREFECT_API_URL']}, MLflow {os.environ['MLFLOW_TRACKING_URI']}, Ray "
        f"{os.environ['RAY_ADDRESS']}"
    )


def _up(args: argparse.Namespace) -> int:
    from infra.stack import up

    ports = {
        name: port
        for name, port in (("prefect", args.prefect_port), ("mlflow", args.mlflow_port), ("ray", args.ray_port))
        if port
    }
    try:
        stack, started = up(args.data_dir, ports)
    except (RuntimeError, TimeoutError) as error:
        print(f"ppoflow up: {error}", file=sys.stderr)
        return 1
    print(f"ppoflow stack (data in {stack.data_dir}):")
    for name, service in stack.services.items():
        print(f"  {name:8} {service.url:32} pid {service.pid:<8} {'started' if name in started else 'already running'}")
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
    print(f"ppoflow stack (data in {stack.data_dir}):")
    for name, service in stack.services.items():
        alive, answers = service.alive(), service.answers()
        healthy &= alive and answers
        print(
            f"  {name:8} {service.url:32} pid {service.pid:<8} {'running' if alive else 'not running'}, "
            f"{'answers' if answers else 'does not answer'}"
        )
    return 0 if healthy else 1


def _train(args: argparse.Namespace) -> int:
    configure_prefect()
    print(f"ppoflow train: using {_use_stack()}", flush=True)
    from flows.config import ConfigError, compose_config
    from rl_core.input_checks import InputError, check_run_inputs

    # a wrong key, type or value, unusable data, model or reward: one line each, in a second, before Prefect starts
    try:
        config = compose_config(args.overrides)
        check_run_inputs(config)
    except (ConfigError, InputError) as error:
        print("\n".join(f"ppoflow train: {line}" for line in str(error).splitlines()), file=sys.stderr)
        return 2
    # Ray's cluster and Prefect's server boot while the flow's modules import (each mostly waits on its own processes)
    from infra.cluster import connect_in_background

    connect_in_background(config.trainer.ray.address, config.trainer.ray.num_cpus)
    server_ready = start_temporary_server()
    from flows.secrets import hide_secret_overrides
    from flows.train import summary_line, train

    overrides = hide_secret_overrides(args.overrides)  # a secret override never becomes a stored flow-run parameter
    server_ready()
    result = train.with_options(retries=args.retries, retry_delay_seconds=5)(overrides=overrides)
    print(summary_line(result))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    configure_prefect()
    print(f"ppoflow sweep: using {_use_stack()}", flush=True)
    from flows.sweep import SweepError, check_sweep
    from flows.train import summary_line

    try:
        check_sweep(
            args.overrides, args.search, args.trials, args.direction
        )  # a bad sweep: a one-line error before Prefect starts
        server_ready = start_temporary_server()
        from flows.sweep import sweep

        server_ready()

        result = sweep(
            overrides=args.overrides,
            search=args.search,
            trials=args.trials,
            metric=args.metric,
            direction=args.direction,
            name=args.name,
            seed=args.seed,
        )
    except SweepError as error:
        print(f"ppoflow sweep: {error}", file=sys.stderr)
        return 2
    print(summary_line({k: result[k] for k in ("tracking_uri", "parent_run_id", "name", "metric")}))
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    configure_prefect()
    print(f"ppoflow evaluate: using {_use_stack()}", flush=True)
    server_ready = start_temporary_server()
    from flows.config import ConfigError
    from flows.evaluate import EvaluationSourceError, evaluate
    from flows.train import summary_line

    server_ready()

    try:
        result = evaluate(
            source=args.source, overrides=args.overrides, samples=args.samples, temperature=args.temperature
        )
    except (ConfigError, EvaluationSourceError) as error:
        print(f"ppoflow evaluate: {error}", file=sys.stderr)
        return 2
    print(summary_line(result))
    return 0


def _serve(args: argparse.Namespace) -> int:
    configure_prefect()
    _use_stack()
    from flows.deployments import PrefectUnavailableError, serve_deployments
    from flows.sweep import SweepError

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
    _use_stack()
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


def _workers(args: argparse.Namespace) -> int:
    _use_stack()
    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        print(
            "ppoflow workers: no cluster to look at: start the stack (`ppoflow up`), set RAY_ADDRESS or give --address",
            file=sys.stderr,
        )
        return 2
    from flows.tracking import DEFAULT_TRACKING_URI
    from flows.workers import kill_worker_group, worker_groups
    from infra.cluster import ClusterUnreachableError, connect

    try:
        connect(address)
    except ClusterUnreachableError as error:
        print(f"ppoflow workers: {error}", file=sys.stderr)
        return 2
    groups = worker_groups(args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI)
    if args.action == "list":
        print(f"{'run':34} {'ranks':>5} {'age':>8}  {'resources':24} {'run status':10} pids")
        for group in groups:
            age = f"{group.age_s / 60:.1f} min" if group.age_s is not None else "busy"
            resources = ", ".join(f"{k} {v:g}" for k, v in sorted(group.resources.items()))
            print(
                f"{group.run_id:34} {group.ranks:>5} {age:>8}  {resources:24} {group.run_status:10} "
                f"{' '.join(map(str, group.pids)) or 'busy'}"
            )
        return 0
    targets = [g.run_id for g in groups if g.run_status != "RUNNING"] if args.orphans else args.runs
    if not targets:
        print(
            "nothing to kill: name runs (ppoflow workers kill RUN_ID ...) or --orphans (groups whose MLflow run is not "
            "running)"
        )
        return 0 if args.orphans else 2
    for run_id in targets:
        print(f"{run_id}: killed {kill_worker_group(run_id)} worker(s)")
    return 0


def _print_config(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from flows.config import ConfigError, compose_config

    try:
        print(OmegaConf.to_yaml(compose_config(args.overrides)), end="")
    except ConfigError as error:
        print(f"ppoflow config: {error}", file=sys.stderr)
        return 2
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


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM: the run stops where it is, cleanly (its MLflow run KILLED, its workers freed)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _stop_on_signals() -> list[int]:
    """The first SIGINT/SIGTERM raises :class:`Interrupted` in the main thread; a second one exits at once (the
    watchdog then ends what the command started). Returns the signals received (Ray's waits turn the handler's
    Interrupted into a plain KeyboardInterrupt: the list says which signal it was)."""
    received: list[int] = []

    def stop(signum: int, frame: object) -> None:
        if received:
            os._exit(128 + signum)
        received.append(signum)
        raise Interrupted(signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    return received


def _exit_at_once_on_signals(command: str) -> None:
    """Once the command's work is done, a signal during the exit (Ray and Prefect's server being stopped by atexit
    handlers) ends the process at once with 128 + the signal; the watchdog ends what is left."""

    def stop(signum: int, frame: object) -> None:
        print(f"ppoflow {command}: stopped by {signal.Signals(signum).name} while exiting", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def _traceback_file(command: str) -> str:
    from infra.stack import stack_home

    folder = stack_home() / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    path.write_text(traceback.format_exc())
    return str(path)


def _run_flow_command(args: argparse.Namespace) -> int:
    """A command that runs flows: nothing it starts outlives it (infra/watchdog.py), SIGINT/SIGTERM stop it cleanly
    (exit 130/143), and a failure is one line (the traceback in a log file; on the console too with --verbose)."""
    from infra import watchdog

    watchdog.start()
    received = _stop_on_signals()
    try:
        return args.flow_command(args)
    except KeyboardInterrupt as stop:  # Interrupted, or the plain KeyboardInterrupt a Ray wait makes of it
        signum = getattr(stop, "signum", received[0] if received else signal.SIGINT)
        print(
            f"ppoflow {args.command}: stopped by {signal.Signals(signum).name}; the run is marked KILLED and its "
            "workers were freed",
            file=sys.stderr,
        )
        return 128 + signum
    except Exception as error:
        path = _traceback_file(args.command)
        if args.verbose:
            traceback.print_exc()
        from flows.prefect_view import one_line

        print(
            f"ppoflow {args.command}: {one_line(error)}\n(the traceback: "
            f"{path}{'' if args.verbose else '; --verbose prints it'})",
            file=sys.stderr,
        )
        return 1
    finally:
        _exit_at_once_on_signals(args.command)


def build_parser() -> argparse.ArgumentParser:
    from rl_core.models.families import FAMILIES

    parser = argparse.ArgumentParser(
        prog="ppoflow", description="RL post-training of LLMs: Prefect flows driving Ray workers, tracked in MLflow."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    flow_options = argparse.ArgumentParser(add_help=False)
    flow_options.add_argument(
        "--verbose",
        action="store_true",
        help="print a failure's traceback (it is always written to $PPOFLOW_HOME/logs/, default ~/.ppoflow/logs/)",
    )
    train = commands.add_parser(
        "train",
        parents=[flow_options],
        help="run PPO/GRPO training (Hydra overrides, e.g. algorithm.adv_estimator=gae); no overrides = the embedded "
        "demo",
    )
    train.add_argument("overrides", nargs="*", help="Hydra overrides key=value (`ppoflow config` lists every key)")
    train.add_argument(
        "--retries",
        type=int,
        default=0,
        help="Prefect flow-run retries: a failed run starts again from its latest "
        "checkpoint, reattaching to its workers (default 0)",
    )
    train.set_defaults(run=_run_flow_command, flow_command=_train)
    up = commands.add_parser(
        "up", help="start the local stack on 127.0.0.1 (Prefect server, MLflow server, Ray head); idempotent"
    )
    up.add_argument(
        "--data-dir", help="where the services keep their data (default $PPOFLOW_HOME/data, PPOFLOW_HOME=~/.ppoflow)"
    )
    up.add_argument("--prefect-port", type=int, help="default 4200")
    up.add_argument("--mlflow-port", type=int, help="default 5000")
    up.add_argument("--ray-port", type=int, help="default 6379")
    up.set_defaults(run=_up)
    down = commands.add_parser(
        "down", help="stop the services `ppoflow up` started (and nothing else); their data is kept"
    )
    down.set_defaults(run=_down)
    status = commands.add_parser("status", help="say which services of the local stack run and answer")
    status.set_defaults(run=_status)
    sweep = commands.add_parser(
        "sweep",
        parents=[flow_options],
        help="training runs over a Hydra grid (key=a,b) or an Optuna search, nested under one MLflow parent run and "
        "compared",
    )
    sweep.add_argument(
        "overrides",
        nargs="+",
        help="Hydra overrides: key=a,b / range(...) vary (interval(...) for random/tpe), key=v is fixed",
    )
    sweep.add_argument("--search", choices=["grid", "random", "tpe"], default="grid")
    sweep.add_argument("--trials", type=int, default=8, help="children of a random/tpe search (default 8)")
    sweep.add_argument(
        "--metric",
        default="auto",
        help="compare by this metric (default: the first validation mean@n, else critic/score/mean)",
    )
    sweep.add_argument("--direction", choices=["max", "min"], default="max")
    sweep.add_argument("--name", help="the sweep's name (default: from the overrides; the same name continues a sweep)")
    sweep.add_argument("--seed", type=int, default=0, help="the random/tpe sampler's seed")
    sweep.set_defaults(run=_run_flow_command, flow_command=_sweep)
    evaluate = commands.add_parser(
        "evaluate",
        parents=[flow_options],
        help="greedy and sampled validation of a checkpoint (global_step_N) or models:/<name>/<version>, in its own "
        "MLflow run",
    )
    evaluate.add_argument(
        "source", help="a global_step_N checkpoint folder (or its actor folder), or models:/<name>/<version>"
    )
    evaluate.add_argument(
        "overrides", nargs="*", help="Hydra overrides of the training run's config (e.g. data.val_files=...)"
    )
    evaluate.add_argument("--samples", type=int, default=8, help="sampled responses per prompt (mean@n, pass@k)")
    evaluate.add_argument("--temperature", type=float, default=1.0)
    evaluate.set_defaults(run=_run_flow_command, flow_command=_evaluate)
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
    config = commands.add_parser(
        "config", help="print the composed config (every key with its value) for the given overrides"
    )
    config.add_argument("overrides", nargs="*", help="Hydra overrides key=value")
    config.set_defaults(run=_print_config)
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
    algos = commands.add_parser(
        "algos", help="list the registered advantage estimators, policy losses, aggregations and KL penalties"
    )
    algos.set_defaults(run=_list_algorithms)
    tiny = commands.add_parser(
        "make-tiny-model", help="write a tiny randomly initialised model + tokenizer (no download) to OUT"
    )
    tiny.add_argument("out", help="output folder")
    tiny.add_argument("--family", default="qwen2", choices=sorted(FAMILIES), help="the model family (default qwen2)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--num-layers", type=int, default=2)
    tiny.set_defaults(run=_make_tiny_model)
    gsm8k = commands.add_parser(
        "prepare-gsm8k", help="convert a local copy of GSM8K (train/test jsonl or parquet) to verl's format"
    )
    gsm8k.add_argument("source", help="folder holding train*.jsonl / test*.jsonl (or parquet)")
    gsm8k.add_argument("out", help="output folder for train.parquet / test.parquet")
    gsm8k.set_defaults(run=_prepare_gsm8k)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
