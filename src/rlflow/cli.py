"""``rlflow`` command line: every user tool and every pipeline stage is a subcommand (``rlflow --help`` lists
the tools first, then the stages).

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
import textwrap

from rlflow import __version__
from rlflow.errors import RLFlowError
from rlflow.pipeline.registry import STAGES, stage

STAGE_PREFIX = "rlflow.stages."

#: modules of the optional dependency groups (pyproject.toml's optional-dependencies) -> their group; a command
#: that imports a missing one says which group to install (tests/test_packaging.py checks the map)
OPTIONAL_MODULES = {"tensorflow": "tf", "jax": "xla", "dvc": "pipeline", "dvclive": "pipeline", "matplotlib": "pipeline"}

#: the user's tools, listed first in ``rlflow --help``
USER_COMMANDS = [
    "rlflow.commands.optimize",
    "rlflow.commands.cost",
    "rlflow.commands.inspect",
    "rlflow.commands.run",
    "rlflow.commands.convert",
    "rlflow.commands.rules",
    "rlflow.commands.passes",
]
#: the pipeline's stages (each a Snakemake rule and a dvc.yaml stage), from the stage registry in its order, each
#: stage module once (a sweep or machine-track stage runs the module of the stage it repeats)
STAGE_COMMANDS = list(dict.fromkeys(s.module for s in STAGES.values()))
COMMAND_MODULES = USER_COMMANDS + STAGE_COMMANDS


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


def _listing(title: str, rows: list[tuple[str, str]], width: int = 110) -> str:
    """One group of ``rlflow --help``'s command list: ``  name   help``, the help wrapped under itself."""
    indent = max(len(name) for name, _ in rows) + 4
    lines = [f"{title}:"]
    for name, text in rows:
        wrapped = textwrap.wrap(text, width - indent) or [""]
        lines.append(f"  {name:<{indent - 2}}{wrapped[0]}")
        lines += [" " * indent + more for more in wrapped[1:]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlflow",
        description="Optimise neural-network graphs (ONNX models) with verified rewrites, and run the experiment\n"
                    "pipeline's stages. `rlflow COMMAND --help` describes each command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rlflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                help="a user command or a pipeline stage, listed below")
    groups: dict[bool, list[tuple[str, str]]] = {False: [], True: []}
    for modname in COMMAND_MODULES:
        mod = importlib.import_module(modname)
        st = stage(modname.removeprefix(STAGE_PREFIX)) if modname.startswith(STAGE_PREFIX) else None
        description = (mod.__doc__ or mod.HELP).strip()
        if st:
            description += (f"\n\nThe pipeline runs it as (Snakemake rule and dvc.yaml stage {st.name}, from "
                            f"rlflow.pipeline.registry), e.g.:\n  " + _wrapped(st.example_cmd()))
        name = st.command.split()[1] if st else mod.NAME
        aliases = getattr(mod, "ALIASES", [])
        # no help= here: argparse would list the commands in one flat block; the epilog lists them in groups
        p = sub.add_parser(name, aliases=aliases, description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        groups[st is not None].append((name + (f" ({', '.join(aliases)})" if aliases else ""), mod.HELP))
        if st:
            st.add_cli_arguments(p, mod.SET_EXAMPLE)
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    parser.epilog = "\n\n".join([
        _listing("user commands", groups[False]),
        _listing("pipeline stages (Snakemake and DVC run these; see docs/pipeline.md)", groups[True])])
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
    except ModuleNotFoundError as e:
        group = OPTIONAL_MODULES.get((e.name or "").split(".")[0])
        if group is None:
            raise
        print(f"rlflow: error: this needs {e.name}, from rlflow's optional group '{group}': "
              f"pip install 'rlflow[{group}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rlflow: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `rlflow inspect m.onnx | head`: the reader left; stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
