"""``rlflow`` command line: every pipeline stage and every user tool is a subcommand.

Each subcommand lives in its own module and has a ``run(args) -> int``:

* a user tool (``rlflow.commands.<tool>``) also exposes ``NAME``, ``HELP`` and ``add_arguments(parser)``;
* a pipeline stage (``rlflow.stages.<stage>``) exposes ``HELP`` and ``SET_EXAMPLE`` (a ``--set`` example for its
  help), and ``add_arguments(parser)`` only for options of its own. Its command name, its file and wildcard
  flags (``--model``, ``--onnx``, ``--out``, ...) and ``--no-progress`` come from its entry in
  :mod:`rlflow.pipeline.registry`, the same declaration its Snakemake rule and dvc.yaml stage are made from, so
  the command line and both pipelines cannot disagree.

User errors (:class:`rlflow.errors.RLFlowError`) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from rlflow import __version__
from rlflow.errors import RLFlowError
from rlflow.pipeline.registry import STAGES, stage

STAGE_PREFIX = "rlflow.stages."

#: the user tools, each a module of rlflow.commands
USER_COMMANDS = [
    "rlflow.commands.inspect",
    "rlflow.commands.run",
    "rlflow.commands.convert",
    "rlflow.commands.rules",
    "rlflow.commands.optimize",
    "rlflow.commands.cost",
    "rlflow.commands.passes",
]
#: every subcommand's module: the pipeline stages' (from the registry, each stage module once), then the tools
COMMAND_MODULES = [*dict.fromkeys(s.module for s in STAGES.values()), *USER_COMMANDS]


def _wrapped(command: str, width: int = 110) -> str:
    """A long command line broken before flags, as a shell would take it (``\\`` line ends)."""
    lines, line = [], ""
    for part in re.split(r" (?=--)", command):
        if line and len(line) + len(part) + 1 > width:
            lines.append(line + " \\")
            line = "    " + part
        else:
            line = f"{line} {part}" if line else part
    return "\n  ".join([*lines, line])


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
        st = stage(modname.removeprefix(STAGE_PREFIX)) if modname.startswith(STAGE_PREFIX) else None
        description = (mod.__doc__ or mod.HELP).strip()
        if st:
            description += (f"\n\nThe pipeline runs it as (Snakemake rule and dvc.yaml stage {st.name}, from "
                            f"rlflow.pipeline.registry), e.g.:\n  " + _wrapped(st.example_cmd()))
        p = sub.add_parser(st.command.split()[1] if st else mod.NAME, help=mod.HELP,
                           aliases=getattr(mod, "ALIASES", []), description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if st:
            st.add_cli_arguments(p, mod.SET_EXAMPLE)
        if hasattr(mod, "add_arguments"):
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
