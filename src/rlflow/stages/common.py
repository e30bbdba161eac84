"""Arguments and loading shared by the pipeline stages (each stage module stays a short, readable script)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlflow.config import load_config
from rlflow.problem import Problem
from rlflow.problem import load_problem as _load_problem


def add_config_arguments(parser: argparse.ArgumentParser, example: str = "zoo.bert.layers=2") -> None:
    """``--config`` (repeatable, deep-merged) and ``--set KEY=VALUE`` (repeatable, applied last)."""
    parser.add_argument("--config", metavar="YAML", action="append", default=None,
                        help="config file; repeat to merge several, later ones win (default: schema defaults)")
    parser.add_argument("--set", metavar="KEY=VALUE", dest="overrides", action="append", default=[],
                        help=f"override one config key after the files, e.g. --set {example} (repeatable)")


def add_problem_arguments(parser: argparse.ArgumentParser, costs: bool = True) -> None:
    """The inputs of a stage that rewrites a model: its ONNX file, the rules file and the cost cache."""
    parser.add_argument("--model", required=True, metavar="NAME", help="the model's name (labels the outputs)")
    parser.add_argument("--onnx", required=True, type=Path, metavar="ONNX", help="the model (results/<model>/model.onnx)")
    parser.add_argument("--rules", required=True, type=Path, metavar="JSON", help="the rules (results/rules/rules.json)")
    if costs:
        parser.add_argument("--costs", type=Path, metavar="JSON",
                            help="measured cost cache (results/costs/<device>/<model>.json); cost.model=measured")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def load_problem(args: argparse.Namespace) -> Problem:
    """Validate the config (``--config``/``--set``), then :func:`rlflow.problem.load_problem` on the stage's
    ``--onnx``, ``--rules`` and ``--costs``."""
    config = load_config(args.config, args.overrides)
    return _load_problem(config, args.onnx, args.rules, getattr(args, "costs", None))


def add_logs_argument(parser: argparse.ArgumentParser, curves: str) -> None:
    """``--logs DIR``: a training stage's dvclive folder, holding ``curves``."""
    parser.add_argument("--logs", type=Path, metavar="DIR",
                        help=f"dvclive folder: {curves} (the pipeline gives it; without it: no curves)")

