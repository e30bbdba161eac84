"""Arguments and the run shared by the agent-training stages (train_controller, which the sweeps run too, and
train_model_free): both are argument parsing plus one call to :func:`rlflow.agents.driver.run_agent_stage`.
Kept apart from :mod:`rlflow.stages.common` so that only these stages depend on the agents' code."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlflow.config import load_config
from rlflow.stages.common import add_logs_argument, add_problem_arguments


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


def run_agent(args: argparse.Namespace, method: str) -> int:
    """An agent-training stage's run: :func:`rlflow.agents.driver.run_agent_stage` on its arguments."""
    from rlflow.agents.driver import AgentFiles, run_agent_stage

    files = AgentFiles(onnx=args.onnx, rules=args.rules, costs=args.costs, encoder=args.encoder, out=args.out,
                       metrics=args.metrics, optimised=args.optimised, trace=args.trace, logs=args.logs,
                       latents=getattr(args, "latents", None), world_model=getattr(args, "world_model", None))
    from rlflow.stages.search_common import e2e_meter, never_slower_check

    config = load_config(args.config, args.overrides)
    run_agent_stage(method, args.model, config, files, progress=not args.no_progress,
                    speed_check=lambda device: never_slower_check(config, device),
                    latency_meter=lambda device: e2e_meter(config, device))
    return 0
