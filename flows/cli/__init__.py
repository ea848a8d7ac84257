"""The ``ppoflow`` command line: ``ppoflow <command> [args]``, one module per group of commands.

* flows/cli/flow_commands.py: ``train``, ``sweep``, ``evaluate`` (the flows);
* flows/cli/stack_commands.py: ``up``, ``down``, ``status``, ``workers``, ``ui`` (the local stack and the cluster);
* flows/cli/deploy_commands.py: ``serve``, ``deploy``, ``k8s-render`` (deployments);
* flows/cli/tool_commands.py: ``config``, ``algos``, ``make-tiny-model``, ``prepare-gsm8k``, ``tools call``.

Commands import what they use when they run, so that a quick command does not pay for Prefect, Ray or MLflow.
"""

from __future__ import annotations

import argparse
import sys

from flows.cli import deploy_commands, flow_commands, stack_commands, tool_commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppoflow", description="RL post-training of LLMs: Prefect flows driving Ray workers, tracked in MLflow."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for group in (flow_commands, stack_commands, deploy_commands, tool_commands):
        group.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "hand_over", False):  # on a `ppoflow up` stack: run in its launcher's pre-imported process
        from flows.cli.flow_commands import LAUNCHED
        from flows.launcher import hand_over

        code = hand_over(sys.argv[1:] if argv is None else list(argv), LAUNCHED, args.verbose)
        if code is not None:
            return code
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
