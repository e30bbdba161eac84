"""Optimise an ONNX model with the verified rewrite rules and write the result.

Methods:
  taso    TASO's cost-based backtracking search (--alpha, --budget)
  greedy  apply the best cost-lowering rewrite until none lowers the cost
  rlflow  a trained agent (--agent CKPT) chooses the rewrites in the rewrite environment, from your graph, for
          at most the horizon it was trained with, keeping the cheapest graph seen: the model-free agent one
          greedy episode; the controller as many as it was trained to (controller.eval_episodes: the first
          greedy, the others sampled with a fixed seed, so a rerun gives the same graph). CKPT is
          the checkpoint of the pipeline's train_controller stage (RLFlow's controller, trained in the world
          model's dream: results/<model>/controller/controller.pt) or of train_model_free (the model-free PPO
          baseline: results/<model>/model_free/model_free.pt); it holds the policy, the graph encoder and (the
          controller) the world model. The agent only runs with the rule set it was trained with (same rules,
          same order: checked); any ONNX model works, not only the one it was trained on.
The optimised graph, weight-only nodes folded, is checked equal to the original under onnxruntime on random
inputs (largest relative difference <= --tolerance) before OUT.onnx is written; if the check fails nothing is
written. Errors (a missing or damaged checkpoint, a rule set that does not match, ...) are one line, exit 2.

Cost model (--cost-model, default: the config's cost.model, whose default is measured):
  measured  each distinct op of the model is timed once on the device (a few seconds; cached in --costs if
            given, and read from it next time); ops the rewrites create are estimated from the roofline
            scaled by their op type's measured/roofline ratio
  analytic  roofline per op from the config's peak figures (cost.peak); no timing, fully deterministic

Defaults without --config are the schema defaults (alpha 1.05, budget 1000, no time limit, device auto, seed
0). The rules default to results/rules/rules.json (made by `snakemake results/rules/rules.json`).

  rlflow optimize bert.onnx --out bert.opt.onnx
  rlflow optimize model.onnx --out fast.onnx --method greedy --cost-model analytic --trace trace.json
  rlflow optimize bert.onnx --out opt.onnx --input-shape input_ids=1x128 --budget 200 --time-limit 60 --json
  rlflow optimize model.onnx --out opt.onnx --method rlflow --agent results/bert/controller/controller.pt \\
      --rules results/rules/rules.json --trace trace.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlflow.commands.common import add_model_arguments

NAME = "optimize"
HELP = "optimise an ONNX model with TASO search, greedy search or a trained RLFlow agent over the verified rules"
#: methods of --method: the two searches and the learned agent
METHODS = ("taso", "greedy", "rlflow")
DEFAULT_RULES = Path("results/rules/rules.json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rlflow.config import add_config_arguments

    add_model_arguments(p)
    p.add_argument("--out", required=True, type=Path, metavar="OUT.onnx", help="where to write the optimised model")
    p.add_argument("--method", choices=METHODS, default="taso",
                   help="taso | greedy (searches) | rlflow (a trained agent, needs --agent) (default: taso)")
    p.add_argument("--agent", type=Path, metavar="CKPT",
                   help="rlflow: the agent checkpoint (controller.pt of train_controller or model_free.pt of "
                        "train_model_free)")
    add_config_arguments(p, "search.alpha=1.0")
    p.add_argument("--rules", type=Path, metavar="JSON",
                   help=f"rules file (default: {DEFAULT_RULES}, in the current folder or the rlflow checkout)")
    p.add_argument("--costs", type=Path, metavar="JSON",
                   help="measured cost cache to read and extend (created if missing; only with the measured model)")
    p.add_argument("--cost-model", choices=("measured", "analytic"),
                   help="cost model (default: cost.model of the config; schema default measured)")
    p.add_argument("--alpha", type=float, help="taso: keep candidates cheaper than alpha x best (default: search.alpha)")
    p.add_argument("--budget", type=int, help="taso: graphs to expand (default: search.budget)")
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="stop the search after this many seconds (default: search.time_limit_s; 0 = none)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest allowed output difference, relative to output magnitude (default: 1e-4)")
    p.add_argument("--trace", type=Path, metavar="JSON", help="also write the search trace (rules applied, costs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def find_rules(path: Path | None) -> Path:
    if path is not None:
        if not path.is_file():
            raise _err(f"{path}: rules file not found")
        return path
    checkout = Path(__file__).resolve().parents[3] / DEFAULT_RULES
    for p in (DEFAULT_RULES, checkout):
        if p.is_file():
            return p
    raise _err(f"no rules file at {DEFAULT_RULES}: make it with `snakemake results/rules/rules.json` "
               "(in the rlflow checkout) or give --rules")


def _cost_model(args, config: dict, device: str, graph, kind: str, progress: bool):
    """The configured cost model; a measured one first times the graph's unmeasured ops (and updates --costs).
    Returns (cost model, number of op signatures timed)."""
    from rlflow.cost import make_cost_model

    cost = make_cost_model(config, device, args.costs if args.costs is not None and args.costs.exists() else None,
                           kind=kind)
    measured = 0
    if kind == "measured":
        from rlflow.graph.exec import backend_errors

        with backend_errors(graph, "torch", what=str(args.model)):  # the user's ops: a failing one is one line
            measured = cost.measure([graph], progress=progress)
        if args.costs is not None and measured:
            cost.save(args.costs)
    return cost, measured


def _err(msg: str):
    from rlflow.errors import RLFlowError

    return RLFlowError(msg)


def run(args: argparse.Namespace) -> int:
    import sys
    import time

    from rlflow.config import get, load_config, resolve_device
    from rlflow.graph import load_onnx
    from rlflow.graph.exec import check_memory
    from rlflow.rewrite.rule import load_rules
    from rlflow.search.output import run_method, summary, verify_and_write
    from rlflow.stages.search_common import config_used

    t0 = time.perf_counter()
    if args.method == "rlflow":
        return run_agent(args, t0)
    if args.agent is not None:
        raise _err(f"--agent is the trained agent of --method rlflow; --method {args.method} is a search and "
                   "takes none")
    config = load_config(args.config, args.overrides)
    alpha = get(config, "search.alpha") if args.alpha is None else args.alpha
    budget = get(config, "search.budget") if args.budget is None else args.budget
    limit = get(config, "search.time_limit_s") if args.time_limit is None else args.time_limit
    if alpha < 1.0 or budget < 1 or limit < 0 or not args.tolerance >= 0:
        raise _err("need --alpha >= 1, --budget >= 1, --time-limit >= 0 and --tolerance >= 0")
    for p in (args.out, args.trace):
        if p is not None and p.is_dir():
            raise _err(f"{p}: is a folder, expected a file path")
    rules_path = find_rules(args.rules)
    kind = args.cost_model or get(config, "cost.model")
    if args.costs is not None and kind != "measured":
        raise _err("--costs is a measured cost cache: use it with --cost-model measured")
    seed = get(config, "seed")
    device = resolve_device(config)
    graph = load_onnx(args.model, args.input_shape)
    check_memory(graph, str(args.model), note=True)
    rules = load_rules(rules_path)
    progress = not args.no_progress and not args.json
    cost, measured = _cost_model(args, config, device, graph, kind, progress)
    result = run_method(args.method, graph, rules, cost, alpha=alpha, budget=budget, time_limit_s=limit,
                        progress=progress)
    used = config_used(config, args.method, alpha, budget, limit)
    used["cost.model"] = kind
    extra = {"model": str(args.model), "rules": str(rules_path), "num_rules": len(rules), "device": device,
             "cost_model": cost.name, "cost": cost.describe(), "config": used}
    diff, doc = verify_and_write(graph, result, args.out, args.trace, extra, seed=seed, device=device,
                                 tol=args.tolerance)
    if args.json:
        doc = {k: v for k, v in doc.items() if k != "steps"}
        doc.update(out=str(args.out), trace=None if args.trace is None else str(args.trace), ops_measured=measured,
                   rule_names=[s.rule_name for s in result.trace], total_seconds=time.perf_counter() - t0)
        print(json.dumps(doc, indent=2))
    else:
        print(summary(result, diff, args.method))
        print(f"wrote {args.out}" + (f" and {args.trace}" if args.trace else "")
              + f" ({time.perf_counter() - t0:.1f} s in all)")
    sys.stdout.flush()
    return 0


def run_agent(args: argparse.Namespace, t0: float) -> int:
    """--method rlflow: load the agent, check it fits the rules, run it on the model, verify, write."""
    import sys
    import time

    from rlflow.agents.checkpoint import load_agent
    from rlflow.agents.real_env import agent_summary
    from rlflow.config import get, load_config, resolve_device
    from rlflow.graph import load_onnx
    from rlflow.graph.exec import check_memory
    from rlflow.rewrite.rule import load_rules
    from rlflow.search.output import verify_and_write

    if args.agent is None:
        raise _err("--method rlflow needs --agent CKPT (results/<model>/controller/controller.pt of train_controller "
                   "or results/<model>/model_free/model_free.pt of train_model_free)")
    given = [f for f, v in (("--alpha", args.alpha), ("--budget", args.budget), ("--time-limit", args.time_limit))
             if v is not None]
    if given:
        raise _err(f"{', '.join(given)}: search options; --method rlflow runs one episode of the agent and takes none")
    if not args.tolerance >= 0:
        raise _err("need --tolerance >= 0")
    for p in (args.out, args.trace):
        if p is not None and p.is_dir():
            raise _err(f"{p}: is a folder, expected a file path")
    config = load_config(args.config, args.overrides)
    kind = args.cost_model or get(config, "cost.model")
    if args.costs is not None and kind != "measured":
        raise _err("--costs is a measured cost cache: use it with --cost-model measured")
    seed = get(config, "seed")
    device = resolve_device(config)
    rules_path = find_rules(args.rules)
    agent = load_agent(args.agent, device)
    rules = load_rules(rules_path)
    agent.check_rules(rules, str(rules_path))
    graph = load_onnx(args.model, args.input_shape)
    check_memory(graph, str(args.model), note=True)
    progress = not args.no_progress and not args.json
    cost, measured = _cost_model(args, config, device, graph, kind, progress)
    result, episode = agent.optimise(graph, rules, cost, device)
    label = "rlflow" if agent.method == "rlflow" else "rlflow (model-free agent)"
    extra = {"model": str(args.model), "rules": str(rules_path), "num_rules": len(rules), "device": device,
             "cost_model": cost.name, "cost": cost.describe(),
             "config": {"seed": seed, "device": config.get("device"), "cost.model": kind},
             "agent": str(args.agent), "agent_method": agent.method, "agent_env": agent.env,
             "agent_trained_on": agent.info.get("model"),
             "real_interactions": {"evaluation": episode["steps"], "total": episode["steps"]}}
    diff, doc = verify_and_write(graph, result, args.out, args.trace, extra, seed=seed, device=device,
                                 tol=args.tolerance)
    if args.json:
        doc = {k: v for k, v in doc.items() if k != "steps"}
        doc.update(out=str(args.out), trace=None if args.trace is None else str(args.trace), ops_measured=measured,
                   rule_names=[s.rule_name for s in result.trace], total_seconds=time.perf_counter() - t0)
        print(json.dumps(doc, indent=2))
    else:
        print(agent_summary(result, diff, label))
        print(f"wrote {args.out}" + (f" and {args.trace}" if args.trace else "")
              + f" ({time.perf_counter() - t0:.1f} s in all)")
    sys.stdout.flush()
    return 0
