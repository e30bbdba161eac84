"""Matching speed and coverage: for each zoo model, how many (rule, location) pairs the rule set offers on the
initial graph, how many distinct rules match, and how long it takes to enumerate all matches from scratch, to
apply one match, and to update all matches incrementally after that apply (checked equal to a from-scratch
enumeration of the new graph).

  python benchmarks/matching.py --rules results/rules/rules.json            # default (paper) sizes
  python benchmarks/matching.py --rules results/rules/rules.json --tiny --models bert resnet18

Goals (issue B), on bert: from scratch <= 50 ms, incremental <= 5 ms, apply <= 2 ms.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rlflow.graph import load_onnx, zoo  # noqa: E402
from rlflow.rewrite import load_rules  # noqa: E402
from rlflow.rewrite.matcher import MatchIndex, _apply  # noqa: E402


def median_ms(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rules", default=str(ROOT / "results/rules/rules.json"))
    ap.add_argument("--models", nargs="+", default=list(zoo.MODEL_NAMES), choices=zoo.MODEL_NAMES)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rules = load_rules(args.rules)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = Path(tmp) / f"{name}.onnx"
            zoo.export_model(name, path, zoo.TINY_SIZES[name] if args.tiny else None)
            g = load_onnx(path)
            path.unlink()
            t_scratch, idx = median_ms(lambda: MatchIndex(g, rules), args.repeats)
            counts = idx.counts()
            pairs, distinct = sum(counts), sum(1 for c in counts if c)
            row = {"model": name, "nodes": len(g.nodes), "pairs": pairs, "rules": distinct, "scratch": t_scratch,
                   "apply": float("nan"), "incremental": float("nan"), "equal": None}
            if pairs:
                # a deterministic, typical action: the middle match of the rule with the most matches
                k = max(range(len(counts)), key=lambda i: (counts[i], -i))
                j = counts[k] // 2
                row["apply"], _ = median_ms(lambda: _apply(g, idx.matches[k][j]), args.repeats)
                t_total, new_idx = median_ms(lambda: idx.apply(k, j), args.repeats)
                row["incremental"] = max(0.0, t_total - row["apply"])
                scratch = MatchIndex(new_idx.graph, rules)
                row["equal"] = all([(m.nodes, m.bindings) for m in a] == [(m.nodes, m.bindings) for m in b]
                                   for a, b in zip(new_idx.matches, scratch.matches))
            rows.append(row)
            print(row, flush=True)
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}; "
          f"{len(rules)} rules from {args.rules}; sizes: {'tiny' if args.tiny else 'default (paper)'}; "
          f"median of {args.repeats}")
    print(f"{'model':<12}{'nodes':>6}{'pairs':>8}{'rules':>7}{'scratch ms':>12}{'apply ms':>10}{'incr. ms':>10}"
          f"{'incr==scratch':>15}")
    for r in rows:
        print(f"{r['model']:<12}{r['nodes']:>6}{r['pairs']:>8}{r['rules']:>7}{r['scratch']:>12.2f}{r['apply']:>10.3f}"
              f"{r['incremental']:>10.3f}{str(r['equal']):>15}")
    bert = [r for r in rows if r["model"] == "bert"]
    if bert:
        b = bert[0]
        print(f"bert_scratch_ms={b['scratch']:.2f} bert_incremental_ms={b['incremental']:.3f} "
              f"bert_apply_ms={b['apply']:.3f}")


if __name__ == "__main__":
    main()
