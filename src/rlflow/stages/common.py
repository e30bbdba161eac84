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


def add_agent_arguments(parser: argparse.ArgumentParser, dream: bool, curves: str) -> None:
    """The files of an agent-training stage (train_controller with ``dream``, train_model_free): the trained
    encoder (and the latents and world model of the dream), and what the stage writes."""
    add_problem_arguments(parser)
    parser.add_argument("--encoder", required=True, type=Path, help="encoder checkpoint (train_encoder)")
    if dream:
        parser.add_argument("--latents", required=True, type=Path, help="latents.npz (train_encoder)")
        parser.add_argument("--world-model", required=True, type=Path,
                            help="world-model checkpoint (train_world_model)")
    parser.add_argument("--out", required=True, type=Path, help="agent checkpoint to write")
    parser.add_argument("--metrics", required=True, type=Path, help="metrics JSON to write")
    parser.add_argument("--optimised", required=True, type=Path, metavar="ONNX",
                        help="the best graph of the real run, verified (ONNX) to write")
    parser.add_argument("--trace", required=True, type=Path, metavar="JSON",
                        help="its trace (rlflow.search-trace/1) to write")
    add_logs_argument(parser, curves)


def add_logs_argument(parser: argparse.ArgumentParser, curves: str) -> None:
    """``--logs DIR``: a training stage's dvclive folder, holding ``curves``."""
    parser.add_argument("--logs", type=Path, metavar="DIR",
                        help=f"dvclive folder: {curves} (the pipeline gives it; without it: no curves)")


def run_agent(args: argparse.Namespace, method: str) -> int:
    """An agent-training stage's run: :func:`rlflow.agents.driver.run_agent_stage` on its arguments."""
    from rlflow.agents.driver import AgentFiles, run_agent_stage

    files = AgentFiles(onnx=args.onnx, rules=args.rules, costs=args.costs, encoder=args.encoder, out=args.out,
                       metrics=args.metrics, optimised=args.optimised, trace=args.trace, logs=args.logs,
                       latents=getattr(args, "latents", None), world_model=getattr(args, "world_model", None))
    run_agent_stage(method, args.model, load_config(args.config, args.overrides), files,
                    progress=not args.no_progress)
    return 0
