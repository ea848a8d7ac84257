"""The commands that run flows: ``train``, ``sweep``, ``evaluate``. Each checks its inputs before Prefect starts,
stops cleanly on SIGINT/SIGTERM (exit 130/143) and fails in one line (the traceback in a log file)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from flows.cli.stack_commands import use_stack
from flows.prefect_server import (
    configure_prefect,
    console_without_tracebacks,
    start_temporary_server,
    stop_temporary_server,
)

LAUNCHED = time.monotonic()  # the command line's modules are light: this is when the command began


def prefect_and_stack(args: argparse.Namespace, console: bool = True) -> str:
    """Prefect's settings, then the stack's services when it is up (PREFECT_API_URL: set before Prefect is imported,
    so that Prefect reads it), then (``console``) a failed task run printed in one line unless ``--verbose``, which
    imports Prefect (seconds). Says what it uses."""
    configure_prefect()
    stack = use_stack()
    if console and not args.verbose:
        console_without_tracebacks()
    return stack


def phase(args: argparse.Namespace, done: str) -> None:
    """With ``--verbose``: when a start-up phase ended, in seconds since the command began (the flow's own lines carry
    their clock time)."""
    if args.verbose:
        print(f"ppoflow {args.command}: {time.strftime('%H:%M:%S')} +{time.monotonic() - LAUNCHED:.1f} s {done}")


def _train(args: argparse.Namespace) -> int:
    print(f"ppoflow train: using {prefect_and_stack(args, console=False)}", flush=True)
    phase(args, "Prefect and the stack configured")
    from flows.config import ConfigError, compose_config
    from flows.resume import ResumeRefused, check_resume
    from rl_core.config_checks import ConfigValueError
    from rl_core.input_checks import InputError, check_run_inputs

    # a wrong key, type or value, unusable data, model or reward, a resume under a changed config: one line each, in
    # seconds, before Prefect starts (no torch, Ray or Prefect before they pass)
    try:
        config = compose_config(args.overrides)
        check_run_inputs(config)
        finished = check_resume(config)
    except (ConfigError, ConfigValueError, InputError, ResumeRefused) as error:
        print("\n".join(f"ppoflow train: {line}" for line in str(error).splitlines()), file=sys.stderr)
        return 2
    phase(args, "config, inputs and resume checked")
    if not args.verbose:
        console_without_tracebacks()
    if finished is not None:
        print(
            f"ppoflow train: run {finished['run_id']} already finished at step {finished['step']}; raise "
            "trainer.total_training_steps to continue it, or start a new run (another trainer.experiment_name)"
        )
        from flows.train import summary_line

        print(summary_line(finished))
        return 0
    # Ray's cluster and Prefect's server boot while the flow's modules import (each mostly waits on its own processes)
    from infra.cluster import connect_in_background

    connect_in_background(config.trainer.ray.address, config.trainer.ray.num_cpus)
    server_ready = start_temporary_server()
    from flows import prestart

    prestart.prestart(config)  # a fresh run's inputs and workers, in a thread
    prestart.wait_for_imports()  # then the flow's modules (Prefect, MLflow) while the workers start
    try:
        from flows.secrets import hide_secret_overrides
        from flows.tracking import open_store, tracking_uri
        from flows.train import summary_line, train

        overrides = hide_secret_overrides(args.overrides)  # a secret override never becomes a stored flow-run parameter
        phase(args, "the flow's modules imported")
        open_store(tracking_uri(config))  # while Prefect's server boots: MLflow opens a store once per process
        server_ready()
        phase(args, "Prefect's server up (the set-up line gives Ray's and the workers' times)")
        result = train.with_options(retries=args.retries, retry_delay_seconds=5)(overrides=overrides)
    finally:
        prestart.release()  # what the flow did not take (a different config, an interrupt)
    print(summary_line(result))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    print(f"ppoflow sweep: using {prefect_and_stack(args, console=False)}", flush=True)
    from flows.sweep_space import SweepError, check_sweep

    try:
        # a bad sweep: a one-line error before Prefect or the flow's modules import
        check_sweep(args.overrides, args.search, args.trials, args.direction)
        if not args.verbose:
            console_without_tracebacks()
        server_ready = start_temporary_server()
        from flows.sweep import sweep
        from flows.train import summary_line

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
    print(f"ppoflow evaluate: using {prefect_and_stack(args)}", flush=True)
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


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM: the run stops where it is, cleanly (its MLflow run KILLED, its workers freed)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _stop_on_signals() -> list[int]:
    """The first SIGINT/SIGTERM raises :class:`Interrupted` in the main thread; a second one exits at once (the
    watchdog then ends what the command started). Returns the signals received (Ray's waits turn the handler's
    Interrupted into a plain KeyboardInterrupt: the list says which signal it was).

    A handler runs wherever the main thread is, a weakref callback or a finalizer included, and Python ignores what
    those raise ("Exception ignored in ..."): the stop would be lost and the run go on (seen: a killed command's run
    waited out its Ray time-out). Such a lost stop, this handler's or Prefect's (its SIGTERM handler raises
    TerminationSignal during a flow run), sends the signal again, to be raised where the main thread is then."""
    received: list[int] = []
    lost: list[int] = []  # an Interrupted that Python ignored: the signal is sent again, and raises again

    def stop(signum: int, frame: object) -> None:
        if received and not lost:
            os._exit(128 + signum)
        if lost:
            lost.clear()
        else:
            received.append(signum)
        raise Interrupted(signum)

    default_hook = sys.unraisablehook

    def signal_again(unraisable: Any) -> None:
        error = unraisable.exc_value
        signum = getattr(error, "signum", None) or getattr(error, "signal", None)
        if not (isinstance(error, Interrupted) or type(error).__name__ == "TerminationSignal") or signum is None:
            default_hook(unraisable)
            return
        if isinstance(error, Interrupted):
            lost.append(signum)
        # from a thread, a moment later: sent from here it would be handled here, inside the hook, and lost again
        threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    sys.unraisablehook = signal_again
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


def run_flow_command(args: argparse.Namespace) -> int:
    """A command that runs flows: nothing it starts outlives it (infra/watchdog.py), SIGINT/SIGTERM stop it cleanly
    (exit 130/143), and a failure is one line (the traceback in a log file; on the console too with --verbose)."""
    from infra import watchdog

    watchdog.start()
    received = _stop_on_signals()
    try:
        code = args.flow_command(args)
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
        code = 1
    finally:
        _exit_at_once_on_signals(args.command)
    stop_temporary_server()  # once it recorded this command's task runs: no shutdown noise after the result
    return code


def add_commands(commands: argparse._SubParsersAction) -> None:
    """``train``, ``sweep`` and ``evaluate``."""
    flow_options = argparse.ArgumentParser(add_help=False)
    flow_options.add_argument(
        "--verbose",
        action="store_true",
        help="print a failure's traceback (it is always written to $PPOFLOW_HOME/logs/, default ~/.ppoflow/logs/) and "
        "the start-up phases' times",
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
    train.set_defaults(run=run_flow_command, flow_command=_train, hand_over=True)
    _add_sweep(commands, flow_options)
    evaluate = commands.add_parser(
        "evaluate",
        parents=[flow_options],
        help="greedy and sampled validation of a checkpoint (global_step_N) or models:/<name>/<version>, in its own "
        "MLflow run",
    )
    evaluate.add_argument(
        "source",
        help="a global_step_N checkpoint folder (or its actor folder), local or at a URL (s3://...), or "
        "models:/<name>/<version>",
    )
    evaluate.add_argument(
        "overrides", nargs="*", help="Hydra overrides of the training run's config (e.g. data.val_files=...)"
    )
    evaluate.add_argument("--samples", type=int, default=8, help="sampled responses per prompt (mean@n, pass@k)")
    evaluate.add_argument("--temperature", type=float, default=1.0)
    evaluate.set_defaults(run=run_flow_command, flow_command=_evaluate)


def _add_sweep(commands: argparse._SubParsersAction, flow_options: argparse.ArgumentParser) -> None:
    """``sweep``: a Hydra grid or an Optuna search."""
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
    sweep.set_defaults(run=run_flow_command, flow_command=_sweep)
