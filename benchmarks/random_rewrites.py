"""Correctness of the rule set and the engine, at scale: random sequences of random (rule, location) choices
applied to every zoo model must give graphs whose onnxruntime outputs equal the original's; and after every
apply the incrementally updated matches must equal a from-scratch enumeration.

  python benchmarks/random_rewrites.py --rules results/rules/rules.json --sequences 1000 --steps 8

Prints each failure (model, sequence, step, rule ids applied) and, last, the totals.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rlflow.graph import load_onnx, zoo  # noqa: E402
from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff  # noqa: E402
from rlflow.graph.fold import fold_constants  # noqa: E402
from rlflow.rewrite import load_rules  # noqa: E402
from rlflow.rewrite.matcher import MatchIndex  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rules", default=str(ROOT / "results/rules/rules.json"))
    ap.add_argument("--models", nargs="+", default=list(zoo.MODEL_NAMES), choices=zoo.MODEL_NAMES)
    ap.add_argument("--sequences", type=int, default=1000, help="in total, spread over the models")
    ap.add_argument("--steps", type=int, default=8, help="rewrites per sequence (fewer if no match is left)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=1e-4)
    args = ap.parse_args()
    rules = load_rules(args.rules)
    rng = np.random.default_rng(args.seed)
    applied: Counter = Counter()
    totals = Counter()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for mi, name in enumerate(args.models):
            path = Path(tmp) / f"{name}.onnx"
            zoo.export_model(name, path, zoo.TINY_SIZES[name])
            g0 = load_onnx(path)
            feeds = make_inputs(g0, seed=1)
            ref = get_runner(g0, "ort")(feeds)
            base = MatchIndex(g0, rules)
            n_seq = args.sequences // len(args.models) + (mi < args.sequences % len(args.models))
            for s in range(n_seq):
                idx, trail = base, []
                for step in range(args.steps):
                    choices = [k for k, c in enumerate(idx.counts()) if c]
                    if not choices:
                        break
                    k = int(rng.choice(choices))
                    j = int(rng.integers(idx.counts()[k]))
                    trail.append(rules[k].id)
                    idx = idx.apply(k, j)
                    applied[rules[k].id] += 1
                    totals["steps"] += 1
                    scratch = MatchIndex(idx.graph, rules)
                    if idx.keys() != scratch.keys():  # the matches, and those blocked as cycles
                        totals["incremental_mismatch"] += 1
                        print(f"INCREMENTAL MISMATCH {name} seq {s} step {step}: {trail}", flush=True)
                        idx = scratch
                g = fold_constants(idx.graph)
                g.validate()
                diff = max_rel_diff(ref, get_runner(g, "ort")(feeds))
                totals["sequences"] += 1
                if not diff <= args.tolerance:
                    totals["wrong_outputs"] += 1
                    print(f"WRONG OUTPUTS {name} seq {s}: diff {diff:.2e} after {trail}", flush=True)
            print(f"{name}: {n_seq} sequences done ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\nrules applied at least once: {len(applied)} of {len(rules)}; most applied: {applied.most_common(5)}")
    print(f"sequences={totals['sequences']} steps={totals['steps']} wrong_outputs={totals['wrong_outputs']} "
          f"incremental_mismatches={totals['incremental_mismatch']} seconds={time.perf_counter() - t0:.0f}")


if __name__ == "__main__":
    main()
