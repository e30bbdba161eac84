"""How much the scale rules allow on a transformer, and in how many steps: a hand-ordered sequence of rewrites
against TASO's graph (issue K: the better RL agent should be >= 5% below TASO on bert and vit).

Each layer of bert and vit has two one-element scales: attention's ``scores / sqrt(d)`` and GELU's ``0.5``. The
builtin rules ``b-div-scalar-*`` / ``b-mul-scalar-*`` (:func:`rlflow.rewrite.builtin._scalar_scale`) move them to a
weight, where constant folding removes them. Merging Q/K/V first hides K's weight behind a Split, so the order
matters for a search without the ``-split-weight`` rules (which fold it from behind the Split). This benchmark
applies, one match at a time and in this order, the scale moves (attention's scale: into the MatMul's right
operand, across K's head split (Transpose, Reshape and the bias Add in one step), into K's weight; GELU's: out of
the product, across the output projection), then greedy
search (the merges). It prints the cost after each phase and the steps taken: the steps an agent would need
(the environment's horizon is ``env.max_steps``).

  python benchmarks/scale_folding.py --model bert     # needs results/bert/model.onnx and results/rules/rules.json

Cost target: the config's (``cost.target: auto`` = sim-h100 on a CPU). TASO's figure is read from the pipeline's
``results/<model>/taso/trace.json`` when it exists. The last line is ``scale_folding <model>: ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: rule ids: each is applied at its first match until none is left, in this order
ORDER = ("b-div-scalar-matmul-r", "b-div-scalar-head-split", "b-div-scalar-matmul-r", "b-mul-scalar-hoist",
         "b-mul-scalar-across-matmul")


def fold_scales(g, rules, cost, log=print):
    """``g`` with :data:`ORDER`'s scale moves applied one match at a time, then greedy search, constants folded:
    (graph, metrics, scale moves, greedy's trace). ``log`` gets a line per rule (None: silent)."""
    from rlflow.rewrite.matcher import apply, find_matches
    from rlflow.search.common import finish
    from rlflow.search.greedy import greedy_search

    by_id = {r.id: r for r in rules}
    moved = 0
    for rid in ORDER:
        n = 0
        while ms := find_matches(g, by_id[rid]):
            g = apply(g, ms[0])
            n += 1
        moved += n
        if log:
            log(f"  {rid:28s} x{n:3d}  cost {finish(g, cost)[1].runtime_ms:.4f} ms")
    r = greedy_search(g, rules, cost)
    final, metrics = finish(r.graph, cost)
    return final, metrics, moved, r.trace


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert", help="a model the pipeline exported (results/<model>/model.onnx)")
    ap.add_argument("--config", default=str(ROOT / "config.yaml"))
    a = ap.parse_args()
    onnx_path, rules_path = ROOT / f"results/{a.model}/model.onnx", ROOT / "results/rules/rules.json"
    if not onnx_path.is_file() or not rules_path.is_file():
        print(f"scale_folding: needs {onnx_path.relative_to(ROOT)} and results/rules/rules.json (run the "
              "pipeline's export_model and generate_rules first)", file=sys.stderr)
        return 2

    from rlflow.config import load_config, resolve_device
    from rlflow.cost.targets import make_cost_model, resolve_target
    from rlflow.graph.onnx_io import load_onnx
    from rlflow.rewrite.rule import load_rules

    cfg = load_config([a.config])
    rules = load_rules(rules_path)
    missing = sorted(set(ORDER) - {r.id for r in rules})
    if missing:
        print(f"scale_folding: {rules_path.relative_to(ROOT)} lacks {', '.join(missing)} (regenerate the rules)",
              file=sys.stderr)
        return 2
    costs = ROOT / f"results/costs/auto/{a.model}.json"  # the pipeline's cost cache (measured targets need it)
    cost = make_cost_model(cfg, resolve_device(cfg), costs if costs.is_file() else None)
    label = resolve_target(cfg)
    g = load_onnx(onnx_path)
    c0 = cost.graph_metrics(g).runtime_ms
    pct = lambda c: 100 * (1 - c / c0)  # noqa: E731
    print(f"{a.model}: {c0:.4f} ms on {label}")
    final, metrics, moved, trace = fold_scales(g, rules, cost)
    steps = moved + len(trace)
    print(f"  then greedy search: {len(trace)} rewrites ({dict(Counter(s.rule_name for s in trace))})")
    print(f"  final: {metrics.runtime_ms:.4f} ms ({pct(metrics.runtime_ms):.2f}%), {steps} steps "
          f"({moved} scale moves + {len(trace)}); ops {dict(sorted(Counter(n.op for n in final.nodes).items()))}")
    vs = ""
    taso_trace = ROOT / f"results/{a.model}/taso/trace.json"
    if taso_trace.is_file():
        t = json.loads(taso_trace.read_text())
        if t.get("num_rules") != len(rules) or t.get("cost_model") != label:
            print(f"  (TASO's trace is of {t.get('num_rules')} rules on {t.get('cost_model')}, not these {len(rules)} on "
                  f"{label}: rerun search_taso)")
        else:
            taso_ms = t["initial"]["runtime_ms"] / t["speedup"]
            vs = f", {100 * (metrics.runtime_ms / taso_ms - 1):+.2f}% against TASO's {taso_ms:.4f} ms"
            print(f"  TASO (budget {t.get('settings', {}).get('budget', '?')}): {taso_ms:.4f} ms ({pct(taso_ms):.2f}%)")
    print(f"scale_folding {a.model}: {pct(metrics.runtime_ms):.2f}% in {steps} steps{vs}; "
          f"horizon env.max_steps = {cfg['env']['max_steps']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
