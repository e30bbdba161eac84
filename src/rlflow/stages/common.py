"""Arguments and loading shared by the pipeline stages (each stage module stays a short, readable script)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from rlflow.config import load_config, resolve_device


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


@dataclass
class Problem:
    """What a rewriting stage works on, loaded from its declared inputs."""

    config: dict
    device: str
    graph: object      # rlflow.graph.Graph
    rules: list        # list[rlflow.rewrite.Rule]
    cost: object       # rlflow.cost.CostModel


def load_problem(args: argparse.Namespace) -> Problem:
    """Validate the config, then load the model, the rules and the configured cost model (one-line errors)."""
    from rlflow.cost import make_cost_model
    from rlflow.graph.onnx_io import load_onnx
    from rlflow.rewrite.rule import load_rules

    config = load_config(args.config, args.overrides)
    device = resolve_device(config)
    graph = load_onnx(args.onnx)
    rules = load_rules(args.rules)
    cost = make_cost_model(config, device, getattr(args, "costs", None))
    return Problem(config, device, graph, rules, cost)


def single_cpu_thread(device: str) -> None:
    """On the CPU, give torch one intra-op thread unless OMP_NUM_THREADS says otherwise. The training stages
    run small ops (an LSTM over batches of 16, a GNN on one graph per step, the policy's MLPs) that are
    latency-bound: on a busy 2-core machine, two threads made them 10-40x slower (thread hand-offs stall when
    another job holds the other core), and Snakemake runs several jobs side by side."""
    import os

    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


def load_seeded_problem(args: argparse.Namespace) -> Problem:
    """:func:`load_problem`, then what every training stage does first: one torch thread on the CPU
    (:func:`single_cpu_thread`) and numpy and torch seeded from ``seed``."""
    import numpy as np
    import torch

    problem = load_problem(args)
    single_cpu_thread(problem.device)
    seed = problem.config["seed"]
    torch.manual_seed(seed)
    np.random.seed(seed)
    return problem

