"""Optimise an ONNX model with the verified rewrite rules and write the result.

Methods (default: eqsat, the strongest on this machine's target in the project's measurements: optimising for
ort-cpu, eqsat made paper-size taso-bert run 0.800 [0.794, 0.805] of the original's latency on onnxruntime
(interleaved, 60 rounds; FLOPs 4.43 -> 3.49 G) where TASO's search left it unchanged, and bert 0.989
[0.985, 0.993]; equality saturation keeps the results of all rewrites at once, where TASO and greedy follow
paths of one rewrite at a time):
  taso    TASO's cost-based backtracking search (--alpha, --budget)
  greedy  apply the best cost-lowering rewrite until none lowers the cost
  eqsat   equality saturation over the rules (Tensat), then the cheapest graph the e-graph holds, extracted by
          an ILP (HiGHS), cycles filtered out during saturation (config section eqsat: node_limit, iter_limit, time_limit_s,
          multi_iterations, extraction, ilp_time_limit_s; set them with --set eqsat.node_limit=...)
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
written. Then it is checked never slower: the measurement protocol (rlflow.evaluation.protocol; config section
timing: several fresh sessions per graph, randomised interleaved rounds, budget timing.budget_s) compares it with
the original on --backend (default: the backend that verifies the target, on its device: ort for ort-cpu, torch
on the GPU for cuda); unless the protocol calls it faster, OUT.onnx gets the ORIGINAL graph and one line says so
("kept the original: no significant speedup, ratio 1.004 [0.991, 1.017] on ort"). A target this machine cannot
verify (--target sim-h100 on a CPU box) is not checked unless --backend names one: the graph found is written and
labelled "simulated target: not verifiable on this machine". The trace records the check (speed_check) and the
resolved platform (target, backend, device); the summary's first line names them. --no-speed-check skips the
check. Errors (a missing or damaged checkpoint, a rule set that does not match, ...) are one line, exit 2.

Cost target (--target; default: the cost.target of --config/--set if they give one, else `machine`, this
machine's runtime: cuda on a GPU box, else ort-cpu):
  ort-cpu      what onnxruntime will run here: its fusions learned from its optimised model, each kernel timed
               once (a few seconds; cached in --costs if given), the calibrated per-kernel overhead; kernels the
               rewrites create are estimated from the calibrated roofline scaled by measured ratios
  torch-eager  each distinct op timed as a torch eager call (the old --cost-model measured)
  cuda         each op timed on the GPU with CUDA events (needs a GPU)
  sim-v100 | sim-a100 | sim-h100   a simulated GPU (spec figures; results labelled "simulated <GPU>")
  analytic     roofline per op; no timing, fully deterministic

Defaults without --config are the schema defaults (alpha 1.05, budget 1000, no time limit, device auto, seed
0). The rules default to results/rules/rules.json (made by `snakemake results/rules/rules.json`).

  rlflow optimize bert.onnx --out bert.opt.onnx
  rlflow optimize model.onnx --out fast.onnx --method greedy --cost-model analytic --trace trace.json
  rlflow optimize bert.onnx --out opt.onnx --input-shape input_ids=1x128 --budget 200 --time-limit 60 --json
  rlflow optimize model.onnx --out opt.onnx --method rlflow --agent results/bert/controller/controller.pt \\
      --rules results/rules/rules.json --trace trace.json
  rlflow optimize model.onnx --out opt.onnx --backend tf --set timing.budget_s=60     (check on TensorFlow, longer)
  rlflow optimize bert.onnx --out opt.onnx --method taso       (TASO's search instead of the default eqsat)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlflow.commands.common import add_model_arguments

NAME = "optimize"
HELP = "optimise an ONNX model with TASO search, greedy search or a trained RLFlow agent over the verified rules"
#: methods of --method: the two searches and the learned agent
METHODS = ("taso", "greedy", "eqsat", "rlflow", "ort-optimizer")
DEFAULT_RULES = Path("results/rules/rules.json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rlflow.config import add_config_arguments

    add_model_arguments(p)
    p.add_argument("--out", required=True, type=Path, metavar="OUT.onnx", help="where to write the optimised model")
    p.add_argument("--method", choices=METHODS, default="eqsat",
                   help="taso | greedy | eqsat (searches) | rlflow (a trained agent, needs --agent) | ort-optimizer "
                        "(baseline: onnxruntime's offline transformer optimizer, BERT-type fusions into its contrib "
                        "ops, which only onnxruntime runs; needs no rules) (default: eqsat, "
                        "the strongest measured on this machine's target: on ort-cpu it made taso-bert 0.800 "
                        "[0.794, 0.805] of the original's latency on onnxruntime, where taso changed nothing)")
    p.add_argument("--agent", type=Path, metavar="CKPT",
                   help="rlflow: the agent checkpoint (controller.pt of train_controller or model_free.pt of "
                        "train_model_free)")
    add_config_arguments(p, "search.alpha=1.0")
    p.add_argument("--rules", type=Path, metavar="JSON",
                   help=f"rules file (default: {DEFAULT_RULES}, in the current folder or the rlflow checkout)")
    p.add_argument("--costs", type=Path, metavar="JSON",
                   help="cost cache to read and extend (created if missing; the measured targets only)")
    p.add_argument("--target", metavar="TARGET",
                   help="cost target: ort-cpu | torch-eager | cuda | sim-v100 | sim-a100 | sim-h100 | analytic | "
                        "auto | machine (default: cost.target of --config/--set, else machine)")
    p.add_argument("--cost-model", choices=("measured", "analytic"), help="old spelling of --target")
    p.add_argument("--alpha", type=float, help="taso: keep candidates cheaper than alpha x best (default: search.alpha)")
    p.add_argument("--budget", type=int, help="taso: graphs to expand (default: search.budget)")
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="stop the search after this many seconds (default: search.time_limit_s; eqsat: eqsat.time_limit_s, saturation only; 0 = none)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest allowed output difference, relative to output magnitude (default: 1e-4)")
    p.add_argument("--trace", type=Path, metavar="JSON", help="also write the search trace (rules applied, costs)")
    from rlflow.graph.exec import BACKENDS

    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="the never-slower check's backend: keep the optimised graph only if the measurement protocol "
                        "calls it faster here (default: the backend that verifies the target: ort for ort-cpu, "
                        "torch on the GPU for cuda)")
    p.add_argument("--no-speed-check", action="store_true",
                   help="write the optimised graph without the never-slower check")
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


def _target(args, config: dict) -> str:
    from rlflow.cost import resolve_target
    from rlflow.cost.targets import MEASURED

    explicit = args.config or any(o.startswith(("cost.target=", "cost.model=")) for o in args.overrides)
    # without a config naming one, optimise for this machine's runtime (the pipeline's `auto` simulates a GPU)
    kind = resolve_target(config, args.target or args.cost_model or (None if explicit else "machine"))
    if args.costs is not None and kind not in MEASURED:
        raise _err(f"--costs is a cache of the measured targets ({', '.join(MEASURED)}); the target is {kind}")
    return kind


#: searches again at most this often after timing the kernels of the graph found (a measured target)
MEASURE_ROUNDS = 3


def _timed_choice(args, config: dict, kind: str, cost, result, progress: bool, search):
    """On a measured target a kernel the graph found has that the cost model has not timed is only estimated,
    and a search takes an optimistic estimate for a gain: time the found graph's untimed kernels (ops) and search
    again, until the graph found has none (``MEASURE_ROUNDS`` at most). Returns (result, signatures timed)."""
    from rlflow.cost.targets import MEASURED

    timed = 0
    if kind not in MEASURED:
        return result, timed
    for _ in range(MEASURE_ROUNDS):
        n = cost.measure([result.graph], progress=progress)
        if not n:
            break
        timed += n
        result = search()
    if timed and args.costs is not None:
        from rlflow.cost.platform import record_in_cache, resolve_platform

        cost.save(args.costs)
        record_in_cache(args.costs, resolve_platform(config, kind))
    return result, timed


def _cost_model(args, config: dict, device: str, graph, kind: str, progress: bool):
    """The target's cost model; a measured one first times the graph's untimed ops or kernels (and updates
    --costs); ort-cpu also learns the graph's fusions and uses this machine's calibration.
    Returns (cost model, number of signatures timed)."""
    from rlflow.cost import make_cost_model
    from rlflow.cost.targets import MEASURED

    cost = make_cost_model(config, device, args.costs if args.costs is not None and args.costs.exists() else None,
                           kind=kind)
    measured = 0
    if kind in MEASURED:
        from rlflow.graph.exec import backend_errors

        backend = "ort" if kind == "ort-cpu" else "torch"
        with backend_errors(graph, backend, what=str(args.model)):  # the user's ops: a failing one is one line
            if kind == "ort-cpu":
                from rlflow.cost.calibration import load_or_measure

                if cost.calibration is None:
                    cost.set_calibration(load_or_measure("ort", "cpu"))
                if not cost.fusion:
                    cost.learn([graph])
            measured = cost.measure([graph], progress=progress)
        if args.costs is not None and measured:
            from rlflow.cost.platform import record_in_cache, resolve_platform

            cost.save(args.costs)
            record_in_cache(args.costs, resolve_platform(config, kind))
    return cost, measured


def _speed_check(args, config: dict, platform):
    """The never-slower check for verify_and_write (None with --no-speed-check): on --backend, else on the
    platform's backend; a platform this machine cannot verify keeps the graph found, labelled."""
    if args.no_speed_check:
        return None
    from rlflow.cost.platform import chosen_backend
    from rlflow.evaluation.protocol import Protocol, never_slower
    from rlflow.stages.search_common import not_verifiable_check

    chosen = chosen_backend(args.backend, platform)
    if chosen is None:
        return not_verifiable_check(platform)
    return never_slower(Protocol.from_config(config), chosen[0], chosen[1], config.get("seed", 0))


def _platform(args, config: dict, kind: str):
    """The resolved platform of target ``kind``; a --costs cache made for another platform, or before caches
    recorded theirs, is refused."""
    from rlflow.cost.platform import check_cache, resolve_platform

    platform = resolve_platform(config, kind)
    if args.costs is not None:
        check_cache(args.costs, platform, remake=f"delete {args.costs} and rerun this command (it remakes it)")
    return platform


def _platform_line(args, platform) -> str:
    """``target ort-cpu (onnxruntime CPU (kernels timed)) on cpu; never-slower check: ort`` (printed before the
    summary: a run that fails prints only its error)."""
    check = "none (--no-speed-check)" if args.no_speed_check else (
        args.backend or platform.backend or "none (simulated target: not verifiable on this machine)")
    return f"target {platform.target} ({platform.label}) on {platform.device}; never-slower check: {check}"


def _log(args):
    """Where the check's line goes: stdout, or stderr with --json (stdout is the JSON document)."""
    import sys

    return (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print


def _labelled(text: str, cost) -> str:
    """The summary with the target named (a simulated GPU's figures say so on every line)."""
    if cost.name.startswith("sim-"):
        return "\n".join(f"{line}   [{cost.label}]" if line.strip() else line for line in text.splitlines())
    return f"cost target: {cost.label} ({cost.name})\n{text}"


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
    from rlflow.stages.search_common import config_used, eqsat_settings

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
    rules_path = None if args.method == "ort-optimizer" else find_rules(args.rules)
    kind = _target(args, config)
    platform = _platform(args, config, kind)
    seed = get(config, "seed")
    device = resolve_device(config)
    graph = load_onnx(args.model, args.input_shape)
    check_memory(graph, str(args.model), note=True)
    rules = [] if rules_path is None else load_rules(rules_path)
    progress = not args.no_progress and not args.json
    cost, measured = _cost_model(args, config, device, graph, kind, progress)
    if args.method == "eqsat" and (args.alpha is not None or args.budget is not None):
        raise _err("--alpha, --budget: TASO's settings (add --method taso); --method eqsat, the default, reads the "
                   "config's eqsat section (--set eqsat.node_limit=...)")
    settings = eqsat_settings(config)
    if args.method == "eqsat" and args.time_limit is not None:
        settings["time_limit_s"] = args.time_limit
    if args.method == "ort-optimizer":  # onnxruntime's transformer optimizer (BERT-type fusions; no rules)
        from rlflow.search.ort_optimizer import ort_optimizer

        result = ort_optimizer(graph, args.model, "bert", cost, input_shapes=args.input_shape)
    else:
        result = run_method(args.method, graph, rules, cost, alpha=alpha, budget=budget, time_limit_s=limit,
                            progress=progress, eqsat=settings)
        result, more = _timed_choice(args, config, kind, cost, result, progress, lambda: run_method(
            args.method, graph, rules, cost, alpha=alpha, budget=budget, time_limit_s=limit, progress=progress,
            eqsat=settings))
        measured += more
    used = config_used(config, args.method, alpha, budget, limit)
    if args.method == "eqsat":
        used["eqsat.time_limit_s"] = settings["time_limit_s"]
    used["cost.target"] = kind
    used["timing.check_backend"] = None if args.no_speed_check else (args.backend or platform.backend)
    extra = {"model": str(args.model), "rules": rules_path and str(rules_path), "num_rules": len(rules),
             "device": device,
             "cost_model": cost.name, "target": cost.name, "cost": cost.describe(), "config": used,
             "platform": platform.as_dict()}
    diff, doc = verify_and_write(graph, result, args.out, args.trace, extra, seed=seed, device=device,
                                 tol=args.tolerance, speed_check=_speed_check(args, config, platform), log=_log(args))
    if args.json:
        doc = {k: v for k, v in doc.items() if k != "steps"}
        doc.update(out=str(args.out), trace=None if args.trace is None else str(args.trace), ops_measured=measured,
                   rule_names=[s.rule_name for s in result.trace], total_seconds=time.perf_counter() - t0)
        print(json.dumps(doc, indent=2))
    else:
        print(_platform_line(args, platform))
        print(_labelled(summary(result, diff, args.method), cost))
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
    kind = _target(args, config)
    platform = _platform(args, config, kind)
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
             "cost_model": cost.name, "target": cost.name, "cost": cost.describe(),
             "config": {"seed": seed, "device": config.get("device"), "cost.target": kind},
             "platform": platform.as_dict(),
             "agent": str(args.agent), "agent_method": agent.method, "agent_env": agent.env,
             "agent_trained_on": agent.info.get("model"),
             "real_interactions": {"evaluation": episode["steps"], "total": episode["steps"]}}
    diff, doc = verify_and_write(graph, result, args.out, args.trace, extra, seed=seed, device=device,
                                 tol=args.tolerance, speed_check=_speed_check(args, config, platform), log=_log(args))
    if args.json:
        doc = {k: v for k, v in doc.items() if k != "steps"}
        doc.update(out=str(args.out), trace=None if args.trace is None else str(args.trace), ops_measured=measured,
                   rule_names=[s.rule_name for s in result.trace], total_seconds=time.perf_counter() - t0)
        print(json.dumps(doc, indent=2))
    else:
        print(_platform_line(args, platform))
        print(_labelled(agent_summary(result, diff, label), cost))
        print(f"wrote {args.out}" + (f" and {args.trace}" if args.trace else "")
              + f" ({time.perf_counter() - t0:.1f} s in all)")
    sys.stdout.flush()
    return 0
