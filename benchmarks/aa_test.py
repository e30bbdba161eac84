"""Can the measurement protocol be trusted? False positives (A/A) and power, on paper-size models.

A/A mode (default): for each model, ``--repeats`` independent A/A comparisons: the original graph against its A/A
copy (exported and imported again through the IR: the same computation) under the measurement protocol
(rlflow.evaluation.protocol; sessions, warm-up and rounds from the config's ``timing`` section, ``--budget``
seconds per comparison), each with its own seed. Every "faster"/"slower" verdict is a false positive. Prints per
model the false-positive rate (the issue's goal: <= 5%) and the median smallest detectable effect (goal: <= 2% on
bert within 60 s per comparison).

Power mode (``--power``): InceptionV3 with every parallel Conv and MatMul merge applied (the project's own verified
builtin rules conv-merge and matmul-merge, applied until none matches; checked equal to the original) against the
original, ``--repeats`` times. Prints how many comparisons call the merged graph slower (the issue's goal: >= 19
of 20, from its measurement of 4.5% slower on onnxruntime) and the median ratio with its interval.

Use a quiet machine for the figures: the protocol's intervals account for session and run noise, not for other
jobs starting and stopping in the middle of a comparison.

  python benchmarks/aa_test.py                                   # bert and resnet18, 20 A/A each, 60 s each (~45 min)
  python benchmarks/aa_test.py --power                           # InceptionV3 merged vs original, 20 x 60 s (~25 min)
  python benchmarks/aa_test.py --set timing.sessions=8           # the issue's figures: 8 sessions per graph, 60 s
  python benchmarks/aa_test.py --copy same                       # A side = the same graph (identical ONNX bytes)

The config's default (timing.sessions 4, the pipeline's, where every session of every graph builds a TensorFlow
runner too) detects about 3% on paper-size bert in 60 s; 8 sessions of the same 60 s about 1.5-2%.
  python benchmarks/aa_test.py --short                           # a check that it works: tiny sizes, 2 x 3 s each
  python benchmarks/aa_test.py --models bert --repeats 5 --budget 30 --set timing.sessions=6

The last lines: per model ``A/A <model> on <backend>: false positives k/N = x% (its 95% Clopper-Pearson interval:
with 20 comparisons a protocol at exactly 5% calls 2 or more in 26% of runs), median smallest detectable effect
y%`` and, with --power, ``power inceptionv3 ...: called slower in k/N, median ratio r``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scipy.stats import binomtest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MERGE_RULES = ("conv-merge", "matmul-merge")


def export(name: str, sizes: dict, folder: Path):
    """The zoo model at ``sizes``, exported and imported (the graph the pipeline optimises)."""
    from rlflow.graph import zoo
    from rlflow.graph.onnx_io import load_onnx

    path = folder / f"{name}.onnx"
    t0 = time.perf_counter()
    zoo.export_model(name, path, sizes)
    g = load_onnx(path)
    print(f"{name}: exported ({len(g.nodes)} nodes) in {time.perf_counter() - t0:.1f} s", flush=True)
    return g


def merge_all(graph):
    """``graph`` with every match of the merge rules applied, until none is left; (graph, merges applied)."""
    from rlflow.rewrite.builtin import verified_builtin_rules
    from rlflow.rewrite.matcher import MatchIndex

    rules = [r for r in verified_builtin_rules() if r.name in MERGE_RULES]
    index, applied = MatchIndex(graph, rules), 0
    while True:
        k = next((k for k, ms in enumerate(index.matches) if ms), None)
        if k is None:
            return index.graph, applied
        index = index.apply(k, 0)
        applied += 1


def run_comparisons(name: str, reference, other, label: str, repeats: int, base, backend: str, device: str,
                    feeds, first: int = 0) -> list:
    """``repeats`` comparisons, the k-th (from ``first``) with protocol seed ``base.seed + 1000 k``."""
    from dataclasses import replace

    from rlflow.evaluation.protocol import backend_runner, compare

    out = []
    for k in range(first, first + repeats):
        p = replace(base, seed=base.seed + 1000 * k)
        with backend_runner(backend, device) as fresh:
            c = compare([("original", reference), (label, other)], feeds, p, fresh)
        e = c[label]
        out.append(e)
        print(f"{name} {label} {k + 1}/{first + repeats}: ratio {e.interval()} -> {e.verdict}; smallest detectable "
              f"{100 * e.detectable:.2f}%; {e.runs} runs, {c.timing_s:.1f} s timing, {c.seconds:.1f} s wall",
              flush=True)
    return out


def main() -> int:
    from rlflow.config import load_config, resolve_device
    from rlflow.evaluation.protocol import FASTER, SLOWER, Protocol, aa_copy
    from rlflow.graph.exec import check_memory, make_inputs
    from rlflow.graph.exec.check import check_equal

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["bert", "resnet18"], help="A/A models (default: bert resnet18)")
    ap.add_argument("--repeats", type=int, default=20, help="independent comparisons per model (default 20)")
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per comparison (default 60)")
    ap.add_argument("--first", type=int, default=0,
                    help="index of the first comparison (its seed): --first 20 runs 20 more, independent of the "
                         "default 20 (default 0)")
    ap.add_argument("--backend", default="ort", help="backend (default ort)")
    ap.add_argument("--copy", choices=("ir", "same"), default="ir",
                    help="the A side: ir = the graph exported and imported again through the IR (the evaluation's "
                         "A/A control; its ONNX file differs in initializer names), same = the same graph (each "
                         "runner built from identical bytes: the protocol's false-positive rate alone)")
    ap.add_argument("--power", action="store_true", help="also the power test (merged InceptionV3 vs original)")
    ap.add_argument("--power-only", action="store_true", help="only the power test")
    ap.add_argument("--short", action="store_true",
                    help="a quick check that it works: tiny model sizes, 2 repeats, 3 s each (figures meaningless)")
    ap.add_argument("--config", action="append", default=None, help="config files (default: config.yaml)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. timing.sessions=6")
    a = ap.parse_args()
    if a.short:
        a.repeats, a.budget = 2, 3.0
    if a.repeats < 1 or not a.budget > 0:
        print("aa_test: need --repeats >= 1 and --budget > 0", file=sys.stderr)
        return 2
    config = load_config(a.config or [ROOT / "config.yaml"], a.sets)
    device = resolve_device(config)
    base = Protocol.from_config(config, budget_s=a.budget)
    print(f"protocol: {base.describe()}; backend {a.backend} on {device}", flush=True)

    def sizes(name):
        from rlflow.graph import zoo

        return dict(zoo.TINY_SIZES[name]) if a.short else dict(config["zoo"][name])

    summary = []
    with tempfile.TemporaryDirectory(prefix="aa-test-") as tmp:
        if not a.power_only:
            for name in a.models:
                g = export(name, sizes(name), Path(tmp))
                check_memory(g, name)
                other = aa_copy(g) if a.copy == "ir" else g
                est = run_comparisons(name, g, other, "A/A", a.repeats, base, a.backend, device,
                                      make_inputs(g, base.seed), a.first)
                fp = sum(e.verdict in (FASTER, SLOWER) for e in est)
                det = statistics.median(e.detectable for e in est)
                ci = binomtest(fp, len(est)).proportion_ci(0.95)  # Clopper-Pearson
                logs = [math.log(e.ratio) for e in est]
                summary.append(f"A/A {name} on {a.backend}: false positives {fp}/{len(est)} = "
                               f"{100 * fp / len(est):.1f}% (95% CI {100 * ci.low:.1f}-{100 * ci.high:.1f}%; "
                               f"{sum(e.verdict == FASTER for e in est)} faster, "
                               f"{sum(e.verdict == SLOWER for e in est)} slower; geometric mean ratio "
                               f"{math.exp(statistics.fmean(logs)):.4f}), median smallest detectable effect "
                               f"{100 * det:.2f}% "
                               f"({a.budget:g} s per comparison, {base.sessions} sessions per graph, A side: "
                               f"{'IR round trip' if a.copy == 'ir' else 'the same graph'})")
        if a.power or a.power_only:
            g = export("inceptionv3", sizes("inceptionv3"), Path(tmp))
            merged, applied = merge_all(g)
            diff = check_equal(g, merged, seed=base.seed, what="inceptionv3")
            print(f"inceptionv3: {applied} merges applied ({', '.join(MERGE_RULES)}), {len(g.nodes)} -> "
                  f"{len(merged.nodes)} nodes, max output difference {diff:.1e}", flush=True)
            if applied == 0:
                print("aa_test: no merge applies to this InceptionV3: nothing to compare", file=sys.stderr)
                return 1
            est = run_comparisons("inceptionv3", g, merged, "merged", a.repeats, base, a.backend, device,
                                  make_inputs(g, base.seed), a.first)
            slower = sum(e.verdict == SLOWER for e in est)
            faster = sum(e.verdict == FASTER for e in est)
            mid = statistics.median(e.ratio for e in est)
            summary.append(f"power inceptionv3 (every parallel Conv/MatMul merge, {applied} merges) on {a.backend}: "
                           f"called slower in {slower}/{len(est)}, faster in {faster}/{len(est)}, median ratio "
                           f"{mid:.4f} ({a.budget:g} s per comparison)")
    print("")
    for line in summary:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
