"""The helper commands: ``config`` (the composed config), ``algos`` (the registries), ``make-tiny-model``,
``prepare-gsm8k``, ``tools call`` (one call of a tool)."""

from __future__ import annotations

import argparse
import sys


def _print_config(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from flows.config import ConfigError, compose_config

    try:
        print(OmegaConf.to_yaml(compose_config(args.overrides)), end="")
    except ConfigError as error:
        print(f"ppoflow config: {error}", file=sys.stderr)
        return 2
    return 0


def _list_algorithms(args: argparse.Namespace) -> int:
    from rl_core.algos import ADVANTAGE_ESTIMATORS, KL_PENALTIES, LOSS_AGG_MODES, POLICY_LOSSES

    print("advantage estimators (algorithm.adv_estimator):      " + ", ".join(sorted(ADVANTAGE_ESTIMATORS)))
    print("policy losses (actor.policy_loss.loss_mode):          " + ", ".join(sorted(POLICY_LOSSES)))
    print("loss aggregation (actor.loss_agg_mode):               " + ", ".join(LOSS_AGG_MODES))
    print("KL penalties (algorithm.kl_penalty, actor.kl_loss_type): " + ", ".join(KL_PENALTIES))
    return 0


def _make_tiny_model(args: argparse.Namespace) -> int:
    from rl_core.models.families import VISION_FAMILIES

    if args.family in VISION_FAMILIES:
        from rl_core.models.tiny_vlm import make_tiny_vlm as make
    else:
        from rl_core.models.tiny import make_tiny_model as make
    sizes = {"hidden_size": args.hidden_size, "num_layers": args.num_layers}
    folder = make(args.out, seed=args.seed, family=args.family, **sizes)
    print(f"wrote a tiny {args.family} checkpoint to {folder} (use it as actor_rollout_ref.model.path={folder})")
    return 0


def _prepare_gsm8k(args: argparse.Namespace) -> int:
    from rl_core.data.gsm8k import preprocess

    for split, path in preprocess(args.source, args.out).items():
        print(f"{split}: {path}")
    return 0


def _call_tool(args: argparse.Namespace) -> int:
    import json

    from rl_core.agent.tools.base import call_tool
    from rl_core.agent.tools.registry import ToolConfigError, builtin_tool, load_tools

    try:
        tools = load_tools(args.config) if args.config else None
        if tools is not None and args.name not in tools:
            raise ToolConfigError(f"{args.config} has no tool {args.name!r} (it has {', '.join(sorted(tools))})")
        tool = tools[args.name] if tools is not None else builtin_tool(args.name)
        arguments = json.loads(args.arguments)
    except (ToolConfigError, json.JSONDecodeError) as error:
        print(f"ppoflow tools call: {error}", file=sys.stderr)
        return 2
    text = call_tool(tool, arguments).text
    print(text, end="" if text.endswith("\n") else "\n")
    return 0


def add_commands(commands: argparse._SubParsersAction) -> None:
    """``config``, ``algos``, ``make-tiny-model``, ``prepare-gsm8k`` and ``tools call``."""
    from rl_core.models.families import FAMILIES, VISION_FAMILIES

    config = commands.add_parser(
        "config", help="print the composed config (every key with its value) for the given overrides"
    )
    config.add_argument("overrides", nargs="*", help="Hydra overrides key=value")
    config.set_defaults(run=_print_config)
    algos = commands.add_parser(
        "algos", help="list the registered advantage estimators, policy losses, aggregations and KL penalties"
    )
    algos.set_defaults(run=_list_algorithms)
    tiny = commands.add_parser(
        "make-tiny-model", help="write a tiny randomly initialised model + tokenizer (no download) to OUT"
    )
    tiny.add_argument("out", help="output folder")
    tiny.add_argument(
        "--family",
        default="qwen2",
        choices=sorted(FAMILIES) + list(VISION_FAMILIES),
        help="the model family (default qwen2; qwen2_vl, qwen2_5_vl, llava: a vision-language model and its processor)",
    )
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
    tools = commands.add_parser("tools", help="try a tool a policy can call: `ppoflow tools call NAME 'JSON'`")
    actions = tools.add_subparsers(dest="action", required=True)
    call = actions.add_parser("call", help="run one call of a tool and print what the policy would read")
    call.add_argument("name", help="the tool's name (built in without --config: calculator, python)")
    call.add_argument("arguments", help='its arguments as a JSON object, e.g. \'{"expression": "37*48"}\'')
    call.add_argument("--config", help="a tool YAML (verl's format) to take the tool from")
    call.set_defaults(run=_call_tool)
