"""What every rewriting stage and agent works on: the model, the rule set and the configured cost model, loaded
from files with one-line errors, and seeded.

    problem = load_problem(config, "results/bert/model.onnx", "results/rules/rules.json", costs_path)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlflow.config import resolve_device


@dataclass
class Problem:
    """A model to optimise, with the rules and the cost model to do it with."""

    config: dict
    device: str
    graph: object      # rlflow.graph.Graph
    rules: list        # list[rlflow.rewrite.Rule]
    cost: object       # rlflow.cost.CostModel


def load_problem(config: dict, onnx: str | Path, rules: str | Path, costs: str | Path | None = None) -> Problem:
    """Load the model, the rules and the cost model ``config`` names (a validated config; one-line errors)."""
    from rlflow.cost import make_cost_model
    from rlflow.graph.onnx_io import load_onnx
    from rlflow.rewrite.rule import load_rules

    device = resolve_device(config)
    return Problem(config, device, load_onnx(onnx), load_rules(rules), make_cost_model(config, device, costs))


def single_cpu_thread() -> None:
    """Give torch one intra-op CPU thread unless OMP_NUM_THREADS says otherwise, on a GPU box too. The training
    stages run small ops (an LSTM over batches of 16, a GNN on one graph per step, the policy's MLPs) that are
    latency-bound, and with ``device: cuda`` the environment, the policy and PPO still run on the CPU. With
    several threads, jobs side by side (Snakemake runs several) stall each other's thread hand-offs: on a busy
    2-core machine two threads made them 10-40x slower; on a lent 16-core H200 box, two model-free agents on cuda
    side by side took 18 s per PPO update each with torch's default 16 threads, and 1.2-1.8 s with one thread
    (1.3 s alone; benchmarks/agent_device.py, docs/results-history.md)."""
    import os

    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


def seed_for_training(problem: Problem) -> int:
    """What every training stage does first: one torch CPU thread (:func:`single_cpu_thread`), numpy
    and torch seeded from ``seed``; returns the seed."""
    import numpy as np
    import torch

    single_cpu_thread()
    seed = int(problem.config["seed"])
    torch.manual_seed(seed)
    np.random.seed(seed)
    return seed
