"""Search time of greedy, TASO and eqsat, this checkout against another one: a ratio with its 95% interval.

Each pair runs both checkouts once (a fresh process each, the order alternating pair by pair) on the same model,
rules and cost cache; the pairs are the sessions of the measurement protocol's ``ratio_interval`` (Student's t
over log ratios). Also printed: each method's steps and final estimate per checkout, since a search that finds a
better graph may take more steps, and the time per expansion. eqsat runs clock-free (no saturation or ILP clock;
``--eqsat-nodes`` e-nodes, 200 ILP branch-and-bound nodes per solve), so both checkouts must build the same
e-graph and extract the same graph: its row also prints saturation's time ratio, and the benchmark fails if the
e-graphs (sizes, matches, merges) or the graphs differ.

  git worktree add /tmp/base <older commit>
  python benchmarks/search_time.py --baseline /tmp/base --model results/bert/model.onnx \\
      --costs results/bert/costs.ort-cpu.json --rules results/rules/rules.json --pairs 5
  python benchmarks/search_time.py --baseline /tmp/base --model gpt2.onnx --costs gpt2.ort-cpu.json \
      --rules results/rules/rules.json --methods eqsat --pairs 3

The cost cache is one `rlflow measure-costs --target ort-cpu` wrote (the pipeline's measure_costs_machine stage
writes it for the machine track); both checkouts read the same file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rlflow.evaluation.protocol import ratio_interval  # noqa: E402

# run inside each checkout (its src/ first on sys.path): one search per method, timed, as JSON on stdout
WORKER = r"""
import json, sys, time
from rlflow.cost.targets import make_cost_model
from rlflow.graph import load_onnx
from rlflow.rewrite import load_rules
from rlflow.search import greedy_search, taso_search
from rlflow.search.eqsat import eqsat_search
model, costs, rules_path, target, budget, methods, enodes = sys.argv[1:8]
g = load_onnx(model)
rules = load_rules(rules_path)
out = {}
for method in methods.split(","):
    cost = make_cost_model({"cost": {"target": target}}, "cpu", costs)
    t = time.perf_counter()
    if method == "greedy":
        r = greedy_search(g, rules, cost)
    elif method == "eqsat":
        r = eqsat_search(g, rules, cost, node_limit=int(enodes), time_limit_s=0, ilp_time_limit_s=0,
                         ilp_node_limit=200)
    else:
        r = taso_search(g, rules, cost, alpha=1.05, budget=int(budget))
    out[method] = {"seconds": time.perf_counter() - t, "steps": len(r.trace), "expansions": r.expansions,
                   "initial_ms": r.initial.runtime_ms, "final_ms": r.final.runtime_ms,
                   "graph": r.graph.structural_hash()}
    if method == "eqsat":
        out[method].update({k: r.stats[k] for k in ("saturation_seconds", "egraph_nodes", "egraph_classes",
                                                       "matches", "merges", "iterations")})
print(json.dumps(out))
"""


def run(tree: Path, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    p = subprocess.run([sys.executable, "-c", WORKER, str(args.model), str(args.costs), str(args.rules),
                        args.target, str(args.taso_budget), ",".join(args.methods), str(args.eqsat_nodes)],
                       env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"search_time: the run in {tree} failed: {p.stderr.strip().splitlines()[-1]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, required=True, help="the other checkout (its src/ is imported)")
    ap.add_argument("--model", type=Path, required=True, help="an ONNX model")
    ap.add_argument("--costs", type=Path, required=True, help="the target's cost cache (rlflow measure-costs)")
    ap.add_argument("--rules", type=Path, required=True, help="rules.json")
    ap.add_argument("--target", default="ort-cpu")
    ap.add_argument("--methods", nargs="+", default=["greedy", "taso"], choices=["greedy", "taso", "eqsat"])
    ap.add_argument("--taso-budget", type=int, default=200)
    ap.add_argument("--eqsat-nodes", type=int, default=50_000, help="eqsat's e-node limit (default 50,000)")
    ap.add_argument("--pairs", type=int, default=5, help="interleaved pairs (>= 2)")
    args = ap.parse_args()
    if args.pairs < 2:
        ap.error("--pairs must be at least 2")
    for p in (args.model, args.costs, args.rules, args.baseline / "src" / "rlflow"):
        if not p.exists():
            ap.error(f"not found: {p}")
    runs: dict[str, list[dict]] = {"this": [], "baseline": []}
    for i in range(args.pairs):
        order = [("this", ROOT), ("baseline", args.baseline)]
        for name, tree in order if i % 2 == 0 else order[::-1]:
            runs[name].append(run(tree, args))
        line = "  ".join(f"{m}: {runs['this'][-1][m]['seconds']:.2f} s vs {runs['baseline'][-1][m]['seconds']:.2f} s"
                         for m in args.methods)
        print(f"pair {i + 1}/{args.pairs}: {line}", flush=True)
    print(f"\n{args.model.name}, target {args.target}, {args.pairs} interleaved pairs; this checkout / baseline "
          f"({args.baseline})")
    print(f"{'method':<8} {'time ratio [95%]':<26} {'per expansion [95%]':<26} steps (this, base)  "
          f"final estimate ms (this, base)")
    for m in args.methods:
        this = [r[m] for r in runs["this"]]
        base = [r[m] for r in runs["baseline"]]
        t = ratio_interval([[b["seconds"]] for b in base], [[a["seconds"]] for a in this])
        e = ratio_interval([[b["seconds"] / b["expansions"]] for b in base],
                           [[a["seconds"] / a["expansions"]] for a in this])
        print(f"{m:<8} {t[0]:.2f} [{t[1]:.2f}, {t[2]:.2f}]{'':<10} {e[0]:.2f} [{e[1]:.2f}, {e[2]:.2f}]{'':<10} "
              f"{this[0]['steps']}, {base[0]['steps']}{'':<12} {this[0]['final_ms']:.2f}, {base[0]['final_ms']:.2f}")
        if m == "eqsat":
            s = ratio_interval([[b["saturation_seconds"]] for b in base], [[a["saturation_seconds"]] for a in this])
            same = ("egraph_nodes", "egraph_classes", "matches", "merges", "iterations", "graph")
            print(f"eqsat saturation alone: {s[0]:.2f} [{s[1]:.2f}, {s[2]:.2f}]; e-graph "
                  f"{this[0]['egraph_nodes']:,} e-nodes, {this[0]['matches']:,} matches in {this[0]['iterations']} "
                  f"iterations")
            differ = [k for k in same if any(r[k] != base[0][k] for r in this + base)]
            if differ:
                raise SystemExit(f"search_time: eqsat differs between the checkouts (or runs) in {', '.join(differ)}")


if __name__ == "__main__":
    main()
