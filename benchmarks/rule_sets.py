"""Two rule files compared on the zoo models: what TASO, greedy and eqsat find with each (issue R).

For each model (paper size, exported by the zoo as the pipeline's export stage does) and method, the search runs
once with the old and once with the new rule file, in this one process, with the pipeline's search stages'
functions and settings (rlflow.search.output.run_method; config.yaml's search.* and eqsat.*; cost target from
--target, default sim-h100, built by rlflow.cost.make_cost_model). Printed: one table (model, method, estimated
cost old -> new in ms and % below the original, search seconds old / new), and per model the rules of the new
set that the new best graphs used and the old set lacks (rule ids from the search traces; a rule is "in the old
set" when a rule with the same source, target, outputs and constraints is there, whatever its id). Equality
saturation extracts its graph from the e-graph and returns no trace, so only TASO's and greedy's graphs count there.

  python benchmarks/rule_sets.py --old /tmp/old_rules.json                  # new: the shipped default set
  python benchmarks/rule_sets.py --old OLD --new NEW --models resnet50 inceptionv3 --methods greedy taso
  python benchmarks/rule_sets.py --old OLD --models bert --methods --env-step --pairs 10
  python benchmarks/rule_sets.py --old OLD --methods --agents             # both agents, old and new rules

--reach: "no lost reach", per model: every graph the old set makes in one rewrite (matched as the matcher did
before it bound commutative ops in either order: each pattern node reads its inputs in the pattern's order), the
new set makes in at most one rewrite (the current matcher), compared up to the operand order of commutative ops
(a hash of the graph that sorts their operands' hashes). Printed per model: distinct one-step results of each set
(up to that order), how many of the old set's the new set lacks; last line: reach_lost=N over all models.

  python benchmarks/rule_sets.py --old OLD --methods --reach                # the 9 zoo models

--agents: both agents trained with each rule file (the pipeline's learning chain, benchmarks/sample_efficiency.py's
one_budget, the config's budgets, --target as the cost target): each agent's % below the original, old -> new,
and its real interactions. Seeded, so deterministic; the minutes depend on the load.

--env-step: the environment step time on bert (benchmarks/env_step.py's environment, random agent), old and new
rules in interleaved pairs (the order alternating pair by pair), and the ratio new/old of the median step time
with its 95% interval over the pairs (rlflow.evaluation.protocol.ratio_interval). Cost estimates are
deterministic; the seconds and step times depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))


from rlflow.config import get, load_config  # noqa: E402
from rlflow.cost import make_cost_model  # noqa: E402
from rlflow.graph import load_onnx, zoo  # noqa: E402
from rlflow.rewrite import load_rules  # noqa: E402
from rlflow.rewrite.matcher import MatchIndex, apply  # noqa: E402
from rlflow.rewrite.rule import DEFAULT_RULES  # noqa: E402
from rlflow.search.output import run_method  # noqa: E402
from rlflow.stages.search_common import eqsat_settings  # noqa: E402

METHODS = ("taso", "greedy", "eqsat")


def rule_key(rule) -> str:
    """What a rule does, without its id, name or verification record."""
    return json.dumps({"src": [repr(n) for n in rule.src], "dst": [repr(n) for n in rule.dst],
                       "outputs": rule.outputs, "constraints": dict(rule.constraints)}, sort_keys=True, default=str)


def load_graph(name: str, tmp: str):
    path = Path(tmp) / f"{name}.onnx"
    zoo.export_model(name, path, None)
    g = load_onnx(path)
    path.unlink()
    return g


def search(method: str, graph, rules, config: dict, target: str, budget: int, limit: float):
    cost = make_cost_model(config, "cpu", kind=target)
    eq = eqsat_settings(config)
    t0 = time.perf_counter()
    r = run_method(method, graph, rules, cost, alpha=get(config, "search.alpha"), budget=budget,
                   time_limit_s=limit, eqsat=eq)
    return r, time.perf_counter() - t0


def pct(initial: float, final: float) -> float:
    return 100.0 * (1.0 - final / initial) if initial > 0 else 0.0


def commutative_hash(g) -> str:
    """Graph.structural_hash up to the operand order of commutative ops."""
    return g.structural_hash(operand_order=False)


def in_pattern_order(match, graph_nodes: dict) -> bool:
    """Whether every matched node reads its inputs in its pattern node's order (the only matches the matcher
    found before it bound commutative ops in either order)."""
    bound = dict(match.bindings)
    nodes = [graph_nodes[name] for name in match.nodes]
    for pn, node in zip(match.rule.src, nodes):
        for ref, val in zip(pn.inputs, node.inputs):
            if ref.startswith("%"):
                k, _, j = ref[1:].partition(".")
                ref_val = nodes[int(k)].outputs[int(j or 0)]
            else:
                ref_val = bound[ref]
            if ref_val != val:
                return False
    return True


def one_step_results(graph, rules, ordered: bool) -> set[str]:
    """The commutative hashes of every graph one rewrite of ``rules`` makes (``ordered``: only the matches in
    pattern order)."""
    index = MatchIndex(graph, rules)
    by_name = {n.name: n for n in graph.nodes}
    return {commutative_hash(apply(graph, m)) for ms in index.matches for m in ms
            if not ordered or in_pattern_order(m, by_name)}


def reach(models: list[str], old, new) -> None:
    lost_total = 0
    print(f"\n{'model':<12}{'nodes':>7}{'old results':>13}{'new results':>13}{'old not in new':>16}{'seconds':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            graph = load_graph(name, tmp)
            t0 = time.perf_counter()
            same = commutative_hash(graph)
            r_old = one_step_results(graph, old, ordered=True) - {same}  # a swap: zero rewrites reach it
            r_new = one_step_results(graph, new, ordered=False) - {same}
            lost = len(r_old - r_new)
            lost_total += lost
            print(f"{name:<12}{len(graph.nodes):>7}{len(r_old):>13}{len(r_new):>13}{lost:>16}"
                  f"{time.perf_counter() - t0:>9.0f}", flush=True)
    print(f"\nreach: one-step rewrites of the old set ({len(old)} rules, matched in pattern order) that the new "
          f"set ({len(new)} rules) does not make in at most one step, up to the operand order of commutative ops, "
          f"on {len(models)} models: {lost_total}")
    print(f"reach_lost={lost_total}")


def env_step(args, config: dict) -> None:
    import numpy as np

    from env_step import load_model
    from rlflow.agents.random_agent import RandomAgent
    from rlflow.env import make_env
    from rlflow.evaluation.protocol import ratio_interval

    graph, source = load_model("bert", False)
    rule_sets = {"old": load_rules(args.old), "new": load_rules(args.new)}
    cost = make_cost_model(config, "cpu", kind=args.target)

    def median_step_ms(rules) -> float:
        env = make_env(config, graph, rules, cost, reward=True)
        agent = RandomAgent(stop_prob=0.0, rng=np.random.default_rng(0))
        times: list[float] = []
        obs, _ = env.reset()
        while len(times) < args.steps:
            action = agent.act(obs["xfer_mask"], obs["location_mask"])
            if action[0] == env.noop:
                obs, _ = env.reset()
                continue
            t0 = time.perf_counter()
            obs, _, terminated, truncated, _ = env.step(action)
            times.append((time.perf_counter() - t0) * 1e3)
            if terminated or truncated:
                obs, _ = env.reset()
        return float(np.median(times))

    runs: dict[str, list[float]] = {"old": [], "new": []}
    for i in range(args.pairs):
        for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
            runs[name].append(median_step_ms(rule_sets[name]))
        print(f"env step pair {i + 1}/{args.pairs}: old {runs['old'][-1]:.2f} ms, new {runs['new'][-1]:.2f} ms",
              flush=True)
    ratio, lo, hi, _ = ratio_interval([[x] for x in runs["old"]], [[x] for x in runs["new"]])
    print(f"\nenv step, bert ({source}), target {cost.name}, {args.steps} random-agent steps per run, "
          f"{args.pairs} interleaved pairs: median per run old {np.median(runs['old']):.2f} ms, new "
          f"{np.median(runs['new']):.2f} ms; new/old {ratio:.3f} [95% {lo:.3f}, {hi:.3f}]")
    print(f"env_step_ratio={ratio:.3f} low={lo:.3f} high={hi:.3f}")


def agents(args) -> None:
    """Both agents trained with each rule file on each model: the pipeline's learning chain
    (sample_efficiency.one_budget: rollouts, encoder, world model, controller, model-free agent), the config's
    budgets, cost target ``args.target``."""
    from sample_efficiency import one_budget

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "target.yaml"
        target.write_text(f"cost: {{target: {args.target}}}\n")
        for name in args.models:
            onnx = Path(tmp) / f"{name}.onnx"
            zoo.export_model(name, onnx, None)
            res = {}
            for label, path in (("old", args.old), ("new", args.new)):
                t0 = time.perf_counter()
                res[label] = one_budget(name, args.episodes, [args.config, str(target)], Path(tmp) / name / label,
                                        onnx=str(onnx), rules=str(Path(path).resolve()))
                print(f"  {name} agents, {label} rules: controller {res[label]['rlflow']['improvement_pct']:.2f}%, "
                      f"model-free {res[label]['model_free']['improvement_pct']:.2f}% "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
            rows.append((name, res))
    print(f"\nagents, target {args.target}, {args.episodes} rollout episodes (% below the original, real "
          "interactions), old -> new rules:")
    print(f"{'model':<12}{'controller':<40} model-free")
    for name, res in rows:
        cells = []
        for method in ("rlflow", "model_free"):
            o, n = res["old"][method], res["new"][method]
            change = ("same" if abs(n["improvement_pct"] - o["improvement_pct"]) < 1e-6 else
                      "better" if n["improvement_pct"] > o["improvement_pct"] else "WORSE")
            cells.append(f"{o['improvement_pct']:.2f} -> {n['improvement_pct']:.2f} {change} "
                         f"({o['interactions']['total']:,} / {n['interactions']['total']:,})")
        print(f"{name:<12}{cells[0]:<40} {cells[1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the old rules file")
    ap.add_argument("--new", default=str(DEFAULT_RULES), help="the new rules file (default: the shipped set)")
    ap.add_argument("--models", nargs="+", default=list(zoo.MODEL_NAMES), choices=zoo.MODEL_NAMES)
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    ap.add_argument("--config", default=str(ROOT / "config.yaml"))
    ap.add_argument("--target", default="sim-h100")
    ap.add_argument("--taso-budget", type=int, default=None, help="default: the config's search.budget")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="TASO and greedy time limit, s (default: the config's search.time_limit_s)")
    ap.add_argument("--reach", action="store_true", help="also check that the new set loses no one-step rewrite")
    ap.add_argument("--env-step", action="store_true", help="also time the env step on bert, old vs new rules")
    ap.add_argument("--agents", action="store_true",
                    help="also train both agents (the pipeline's learning chain) with each rule file; ~15 min per "
                         "paper-size transformer here")
    ap.add_argument("--episodes", type=int, default=20, help="--agents: rollout episodes (default: the pipeline's)")
    ap.add_argument("--pairs", type=int, default=5, help="--env-step: interleaved pairs (>= 2)")
    ap.add_argument("--steps", type=int, default=200, help="--env-step: timed steps per run")
    args = ap.parse_args()
    if args.env_step and args.pairs < 2:
        ap.error("--pairs must be at least 2")
    config = load_config(args.config)
    budget = args.taso_budget if args.taso_budget is not None else get(config, "search.budget")
    limit = args.time_limit if args.time_limit is not None else get(config, "search.time_limit_s")
    old, new = load_rules(args.old), load_rules(args.new)
    old_keys = {rule_key(r) for r in old}
    only_new = {r.id: r for r in new if rule_key(r) not in old_keys}
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}, python {platform.python_version()}")
    print(f"old {args.old}: {len(old)} rules; new {args.new}: {len(new)} rules, {len(only_new)} not in the old set; "
          f"target {args.target}; TASO alpha {get(config, 'search.alpha')}, budget {budget}; time limit "
          f"{limit or 'none'}; eqsat {eqsat_settings(config)}", flush=True)
    rows, used_lines = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models if args.methods else []:
            t0 = time.perf_counter()
            graph = load_graph(name, tmp)
            print(f"{name}: {len(graph.nodes)} nodes (exported in {time.perf_counter() - t0:.0f} s)", flush=True)
            used: dict[str, int] = {}
            for method in args.methods:
                res = {}
                for label, rules in (("old", old), ("new", new)):
                    res[label] = search(method, graph, rules, config, args.target, budget, limit)
                (ro, so), (rn, sn) = res["old"], res["new"]
                for step in rn.trace:
                    if step.rule_id in only_new:
                        used[f"{step.rule_id} {step.rule_name}"] = used.get(f"{step.rule_id} {step.rule_name}", 0) + 1
                row = {"model": name, "method": method, "initial": ro.initial.runtime_ms,
                       "old": ro.final.runtime_ms, "new": rn.final.runtime_ms, "s_old": so, "s_new": sn,
                       "stop": f"{ro.stop_reason}/{rn.stop_reason}"}
                rows.append(row)
                print(f"  {method}: {row['old']:.4f} -> {row['new']:.4f} ms ({so:.1f} s, {sn:.1f} s; "
                      f"stop {row['stop']}; new-only rules in the new trace: "
                      f"{sum(1 for s in rn.trace if s.rule_id in only_new)} of {len(rn.trace)} steps)", flush=True)
            line = ", ".join(f"{k} x{v}" for k, v in sorted(used.items())) or "none"
            used_lines.append(f"{name}: {line}")
    if rows:
        print(f"\n{'model':<12}{'method':<8}{'original ms':>12}  {'old ms (% below)':<20}{'new ms (% below)':<20}"
              f"{'change':>8}  {'seconds old / new':<18}")
        for r in rows:
            change = "same" if abs(r["new"] - r["old"]) < 1e-9 else ("better" if r["new"] < r["old"] else "WORSE")
            print(f"{r['model']:<12}{r['method']:<8}{r['initial']:>12.4f}  "
                  f"{r['old']:.4f} ({pct(r['initial'], r['old']):5.2f}%)   {r['new']:.4f} ({pct(r['initial'], r['new']):5.2f}%)"
                  f"   {change:>8}  {r['s_old']:.1f} / {r['s_new']:.1f}")
        print("\nrules of the new set (not in the old) that the new best graphs used (all methods, steps):")
        for line in used_lines:
            print(f"  {line}")
    if args.reach:
        reach(args.models, old, new)
    if args.env_step:
        env_step(args, config)
    if args.agents:
        agents(args)


if __name__ == "__main__":
    main()
