"""``rlflow`` command line: every pipeline stage and every user tool is a subcommand.

Each subcommand lives in its own module (``rlflow.stages.<stage>`` for pipeline stages,
``rlflow.commands.<tool>`` for user tools) exposing ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``. User errors (:class:`rlflow.errors.RLFlowError`) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rlflow import __version__
from rlflow.errors import RLFlowError

COMMAND_MODULES = [
    "rlflow.stages.export_model",
    "rlflow.stages.generate_rules",
    "rlflow.stages.collect_rollouts",
    "rlflow.stages.merge_rollouts",
    "rlflow.stages.measure_costs",
    "rlflow.stages.search_taso",
    "rlflow.stages.search_greedy",
    "rlflow.stages.search_eqsat",
    "rlflow.stages.train_encoder",
    "rlflow.stages.train_world_model",
    "rlflow.stages.train_controller",
    "rlflow.stages.train_model_free",
    "rlflow.stages.evaluate",
    "rlflow.stages.report",
    "rlflow.stages.summary",
    "rlflow.commands.inspect",
    "rlflow.commands.run",
    "rlflow.commands.convert",
    "rlflow.commands.rules",
    "rlflow.commands.optimize",
    "rlflow.commands.cost",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlflow",
        description="Optimise neural-network graphs with verified rewrites chosen by an RL agent, "
        "and run the experiment pipeline's stages.",
    )
    parser.add_argument("--version", action="version", version=f"rlflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for modname in COMMAND_MODULES:
        mod = importlib.import_module(modname)
        p = sub.add_parser(mod.NAME, help=mod.HELP, aliases=getattr(mod, "ALIASES", []), description=(mod.__doc__ or mod.HELP).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # inside the try: a closed pipe is reported here, not at interpreter exit
        return code
    except RLFlowError as e:
        print(f"rlflow: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("rlflow: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `rlflow inspect m.onnx | head`: the reader left; stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
