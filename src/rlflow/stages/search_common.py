"""What the pipeline stages search_taso, search_greedy and search_eqsat share (their modules are one-liners over this):
load the declared inputs, run the search, verify, check it never slower (the measurement protocol on
timing.check_backend: a graph not significantly faster than the original is replaced by the original; the trace
records the check), write the optimised ONNX and the trace."""

from __future__ import annotations

import time

from rlflow.config import get
from rlflow.cost.targets import resolve_target
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
                        progress=not args.no_progress, eqsat=eqsat_settings(config))
    extra = {
        "model": args.model, "onnx": str(args.onnx), "rules": str(args.rules), "num_rules": len(problem.rules),
        "device": problem.device, "cost_model": cost.name, "cost": _describe(cost, getattr(args, "costs", None)),
        "config": config_used(config, method, alpha, budget, limit),
    }
    diff, _ = verify_and_write(problem.graph, result, args.out, args.trace, extra, seed=seed, device=problem.device,
                               speed_check=never_slower_check(config, problem.device),
                               log=lambda line: print(f"{label}: {line}", flush=True))
    print(summary(result, diff, label))
    print(f"{label}: wrote {args.out} and {args.trace} ({time.perf_counter() - t0:.1f} s in all)", flush=True)
    return 0


def never_slower_check(config: dict, device: str):
    """The pipeline's never-slower check of a method's final graph: the measurement protocol on
    timing.check_backend (rlflow.evaluation.protocol.never_slower)."""
    from rlflow.evaluation.protocol import Protocol, never_slower

    return never_slower(Protocol.from_config(config), get(config, "timing.check_backend"), device, get(config, "seed"))


def e2e_meter(config: dict, device: str):
    """The e2e reward's latency measurement: the measurement protocol on env.reward.e2e_backend within
    timing.e2e_budget_s (rlflow.evaluation.protocol.latency_meter)."""
    from rlflow.evaluation.protocol import Protocol, latency_meter

    protocol = Protocol.from_config(config, budget_s=get(config, "timing.e2e_budget_s"))
    return latency_meter(protocol, get(config, "env.reward.e2e_backend"), device, get(config, "seed"))


def config_used(config: dict, method: str, alpha: float, budget: int, limit: float) -> dict:
    """The config values a search ran with, by dotted key."""
    used = {"seed": config.get("seed"), "device": config.get("device"),
            "cost.target": resolve_target(config), "search.time_limit_s": limit}
    if method == "taso":
        used.update({"search.alpha": alpha, "search.budget": budget})
    if method == "eqsat":
        del used["search.time_limit_s"]
        used.update({f"eqsat.{k}": v for k, v in eqsat_settings(config).items()})
    return used


def eqsat_settings(config: dict) -> dict:
    """The config's ``eqsat`` section as keyword arguments of :func:`rlflow.search.eqsat.eqsat_search`."""
    return {k: get(config, f"eqsat.{k}") for k in ("node_limit", "iter_limit", "time_limit_s", "multi_iterations",
                                                    "extraction", "ilp_time_limit_s")}


def _describe(cost, costs_path) -> dict:
    d = dict(cost.describe())
    if costs_path is not None:
        d["cache"] = str(costs_path)
    table = getattr(cost, "table", None)
    if table is not None:
        d["measured_signatures"] = len(table)
    return d
