"""What the pipeline stages search_taso, search_greedy, search_eqsat and search_eqsat_rl share (their modules are
one-liners over this): load the declared inputs, run the search, verify, check it never slower, write the optimised
ONNX and the trace.

The run's platform (rlflow.cost.platform: the resolved cost target and the backend that verifies it here) decides
the check: on timing.check_backend (``auto``: the platform's backend, on the target's device) a graph not
significantly faster than the original is replaced by the original. A target this machine cannot verify (sim-h100
on a CPU box) is not gated: the graph found is written, and the trace's speed_check and the log say "simulated
target: not verifiable on this machine". The trace records the platform."""

from __future__ import annotations

import time

from rlflow.config import get
from rlflow.cost.platform import NOT_VERIFIABLE, Platform, backend_setting, resolve_platform
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
    platform = resolve_platform(config)
    alpha, budget, limit = get(config, "search.alpha"), get(config, "search.budget"), get(config, "search.time_limit_s")
    seed = get(config, "seed")
    cost = problem.cost
    print(f"{label}: {args.model}: {len(problem.graph.nodes)} nodes, {len(problem.rules)} rules, cost model "
          f"{cost.name} on {problem.device}" + (f", alpha {alpha}, budget {budget}" if method == "taso" else "")
          + (f", time limit {limit} s" if limit else ""), flush=True)
    print(f"{label}: platform {platform.describe()}", flush=True)
    result = run_method(method, problem.graph, problem.rules, cost, alpha=alpha, budget=budget, time_limit_s=limit,
                        progress=not args.no_progress, eqsat=eqsat_settings(config, method))
    extra = {
        "model": args.model, "onnx": str(args.onnx), "rules": str(args.rules), "num_rules": len(problem.rules),
        "device": problem.device, "cost_model": cost.name, "cost": _describe(cost, getattr(args, "costs", None)),
        "config": config_used(config, method, alpha, budget, limit), "platform": platform.as_dict(),
    }
    diff, _ = verify_and_write(problem.graph, result, args.out, args.trace, extra, seed=seed, device=problem.device,
                               speed_check=never_slower_check(config, platform),
                               log=lambda line: print(f"{label}: {line}", flush=True))
    print(summary(result, diff, label))
    print(f"{label}: wrote {args.out} and {args.trace} ({time.perf_counter() - t0:.1f} s in all)", flush=True)
    return 0


def never_slower_check(config: dict, platform: Platform | None = None):
    """The pipeline's never-slower check of a method's final graph: the measurement protocol on
    timing.check_backend (rlflow.evaluation.protocol.never_slower; ``auto``: the platform's backend); where the
    platform is not verifiable here, :func:`not_verifiable_check`."""
    from rlflow.evaluation.protocol import Protocol, never_slower

    platform = platform or resolve_platform(config)
    chosen = backend_setting(config, "timing.check_backend", platform)
    if chosen is None:
        return not_verifiable_check(platform)
    backend, device = chosen
    return never_slower(Protocol.from_config(config), backend, device, get(config, "seed"))


def not_verifiable_check(platform: Platform):
    """The check of a target this machine cannot verify: the graph found is kept, untimed, and labelled."""

    def check(original, optimised) -> dict:
        return {"backend": None, "ratio": None, "ci_low": None, "ci_high": None, "verdict": None,
                "detectable": None, "kept": "optimised", "not_verifiable": True,
                "line": f"{NOT_VERIFIABLE} (target {platform.target}, {platform.label}): the graph found is kept, "
                        "not gated"}

    return check


def e2e_meter(config: dict, platform: Platform | None = None):
    """The e2e reward's latency measurement: the measurement protocol on env.reward.e2e_backend (``auto``: the
    platform's backend) within timing.e2e_budget_s (rlflow.evaluation.protocol.latency_meter). A target this
    machine cannot verify has nothing to measure it with: one-line error."""
    from rlflow.evaluation.protocol import Protocol, latency_meter

    platform = platform or resolve_platform(config)
    chosen = backend_setting(config, "env.reward.e2e_backend", platform)
    if chosen is None:
        raise RLFlowError(f"env.reward.e2e_backend: auto, but the target {platform.target} ({platform.label}) cannot "
                          "be measured on this machine: name a backend (ort, torch) or set cost.target: machine")
    protocol = Protocol.from_config(config, budget_s=get(config, "timing.e2e_budget_s"))
    return latency_meter(protocol, chosen[0], chosen[1], get(config, "seed"))


def config_used(config: dict, method: str, alpha: float, budget: int, limit: float) -> dict:
    """The config values a search ran with, by dotted key."""
    chosen = backend_setting(config, "timing.check_backend", resolve_platform(config))
    used = {"seed": config.get("seed"), "device": config.get("device"),
            "cost.target": resolve_target(config), "search.time_limit_s": limit,
            "timing.check_backend": None if chosen is None else chosen[0]}
    if method == "taso":
        used.update({"search.alpha": alpha, "search.budget": budget})
    if method in ("eqsat", "eqsat-rl"):
        del used["search.time_limit_s"]
        used.update({f"eqsat.{k}": v for k, v in eqsat_settings(config, method).items()})
    return used


def eqsat_settings(config: dict, method: str = "eqsat") -> dict:
    """The config's ``eqsat`` section as keyword arguments of :func:`rlflow.search.eqsat.eqsat_search`; for
    ``eqsat-rl`` also ``rl_leaves`` (its tree search's leaves: :func:`rlflow.search.output.run_method`)."""
    keys = ("node_limit", "iter_limit", "time_limit_s", "multi_iterations", "extraction", "ilp_time_limit_s",
            "ilp_node_limit")
    return {k: get(config, f"eqsat.{k}") for k in keys + (("rl_leaves",) if method == "eqsat-rl" else ())}


def _describe(cost, costs_path) -> dict:
    d = dict(cost.describe())
    if costs_path is not None:
        d["cache"] = str(costs_path)
    table = getattr(cost, "table", None)
    if table is not None:
        d["measured_signatures"] = len(table)
    return d
