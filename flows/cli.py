"""The ``ppoflow`` command line: ``ppoflow <command> [args]``.

Commands import their modules lazily, so that a quick command does not pay for Prefect, Ray or MLflow.
"""

from __future__ import annotations

import argparse
import sys


def _list_algorithms(args: argparse.Namespace) -> int:
    from rl_core.algos import ADVANTAGE_ESTIMATORS, KL_PENALTIES, LOSS_AGG_MODES, POLICY_LOSSES

    print("advantage estimators (algorithm.adv_estimator):      " + ", ".join(sorted(ADVANTAGE_ESTIMATORS)))
    print("policy losses (actor.policy_loss.loss_mode):          " + ", ".join(sorted(POLICY_LOSSES)))
    print("loss aggregation (actor.loss_agg_mode):               " + ", ".join(LOSS_AGG_MODES))
    print("KL penalties (algorithm.kl_penalty, actor.kl_loss_type): " + ", ".join(KL_PENALTIES))
    return 0


def _make_tiny_model(args: argparse.Namespace) -> int:
    from rl_core.models.tiny import make_tiny_model

    folder = make_tiny_model(args.out, seed=args.seed, hidden_size=args.hidden_size, num_layers=args.num_layers)
    print(f"wrote a tiny Qwen2 checkpoint to {folder} (use it as actor_rollout_ref.model.path={folder})")
    return 0


def _prepare_gsm8k(args: argparse.Namespace) -> int:
    from rl_core.data.gsm8k import preprocess

    for split, path in preprocess(args.source, args.out).items():
        print(f"{split}: {path}")
    return 0


def _train(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")  # the flow prints one line per step itself
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.config import ConfigError, compose_config

    try:
        compose_config(args.overrides)  # a wrong key or type: a one-line error in a second, before Prefect starts
    except ConfigError as error:
        print(f"ppoflow train: {error}", file=sys.stderr)
        return 2
    from flows.train import summary_line, train

    result = train(overrides=args.overrides)
    print(summary_line(result))
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
    import os

    from flows.tracking import DEFAULT_TRACKING_URI
    from ui.server import Links, serve

    links = Links.from_environment()
    for name in ("mlflow_url", "prefect_url", "ray_dashboard_url"):
        if getattr(args, name):
            setattr(links, name, getattr(args, name))
    serve(args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI, args.host, args.port, links, args.experiment)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ppoflow", description="RL post-training of LLMs: Prefect flows driving Ray workers, tracked in MLflow.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run PPO/GRPO training (Hydra overrides, e.g. algorithm.adv_estimator=gae); no overrides = the embedded demo")
    train.add_argument("overrides", nargs="*", help="Hydra overrides key=value (`ppoflow config` lists every key)")
    train.set_defaults(run=_train)
    config = commands.add_parser("config", help="print the composed config (every key with its value) for the given overrides")
    config.add_argument("overrides", nargs="*", help="Hydra overrides key=value")
    config.set_defaults(run=_print_config)
    ui = commands.add_parser("ui", help="serve the run inspector page (curves, stage timeline, rollout samples, config diffs) of an MLflow store")
    ui.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    ui.add_argument("--port", type=int, default=8420)
    ui.add_argument("--tracking-uri", help="the MLflow store (default: MLFLOW_TRACKING_URI, else the embedded default's sqlite:///mlflow.db)")
    ui.add_argument("--experiment", default="ppoflow", help="the experiment shown first (trainer.project_name)")
    ui.add_argument("--mlflow-url", help="the MLflow UI, for links (default http://127.0.0.1:5000)")
    ui.add_argument("--prefect-url", help="the Prefect UI, for links (default PREFECT_UI_URL or http://127.0.0.1:4200)")
    ui.add_argument("--ray-dashboard-url", help="the Ray dashboard, for links (default http://127.0.0.1:8265)")
    ui.set_defaults(run=_ui)
    algos = commands.add_parser("algos", help="list the registered advantage estimators, policy losses, aggregations and KL penalties")
    algos.set_defaults(run=_list_algorithms)
    tiny = commands.add_parser("make-tiny-model", help="write a tiny Qwen2 model + tokenizer (no download) to OUT")
    tiny.add_argument("out", help="output folder")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--num-layers", type=int, default=2)
    tiny.set_defaults(run=_make_tiny_model)
    gsm8k = commands.add_parser("prepare-gsm8k", help="convert a local copy of GSM8K (train/test jsonl or parquet) to verl's format")
    gsm8k.add_argument("source", help="folder holding train*.jsonl / test*.jsonl (or parquet)")
    gsm8k.add_argument("out", help="output folder for train.parquet / test.parquet")
    gsm8k.set_defaults(run=_prepare_gsm8k)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
