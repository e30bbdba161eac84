"""What the pipeline stages search_taso and search_greedy share (their modules are one-liners over this):
load the declared inputs, run the search, verify, write the optimised ONNX and the trace."""

from __future__ import annotations

import time

from rlflow.config import get
from rlflow.errors import RLFlowError
from rlflow.search.output import run_method, summary, verify_and_write
from rlflow.stages.common import load_problem


def run_stage(args, method: str, label: str) -> int:
    t0 = time.perf_counter()
    for p in (args.out, args.trace):
        if p.is_dir():
            raise RLFlowError(f"{p}: is a folder, expected a file path")
    problem = load_problem(args)
    config = problem.config
    alpha, budget, limit = get(config, "search.alpha"), get(config, "search.budget"), get(config, "search.time_limit_s")
    seed = get(config, "seed")
    cost = problem.cost
    print(f"{label}: {args.model}: {len(problem.graph.nodes)} nodes, {len(problem.rules)} rules, cost model "
          f"{cost.name} on {problem.device}" + (f", alpha {alpha}, budget {budget}" if method == "taso" else "")
          + (f", time limit {limit} s" if limit else ""), flush=True)
    result = run_method(method, problem.graph, problem.rules, cost, alpha=alpha, budget=budget, time_limit_s=limit,
                        progress=not args.no_progress)
    extra = {
        "model": args.model, "onnx": str(args.onnx), "rules": str(args.rules), "num_rules": len(problem.rules),
        "device": problem.device, "cost_model": cost.name, "cost": _describe(cost, getattr(args, "costs", None)),
        "config": config_used(config, method, alpha, budget, limit),
    }
    diff, _ = verify_and_write(problem.graph, result, args.out, args.trace, extra, seed=seed, device=problem.device)
    print(summary(result, diff, label))
    print(f"{label}: wrote {args.out} and {args.trace} ({time.perf_counter() - t0:.1f} s in all)", flush=True)
    return 0


def config_used(config: dict, method: str, alpha: float, budget: int, limit: float) -> dict:
    """The config values a search ran with, by dotted key."""
    used = {"seed": config.get("seed"), "device": config.get("device"),
            "cost.model": config.get("cost", {}).get("model"), "search.time_limit_s": limit}
    if method == "taso":
        used.update({"search.alpha": alpha, "search.budget": budget})
    return used


def _describe(cost, costs_path) -> dict:
    d = dict(cost.describe())
    if costs_path is not None:
        d["cache"] = str(costs_path)
    table = getattr(cost, "table", None)
    if table is not None:
        d["measured_signatures"] = len(table)
    return d
