"""The ``ort-cpu`` target on transformers exports it never learned from: estimate vs end-to-end onnxruntime.

The exports (tests/hf_exports.py): transformers' BertModel, ViTModel and GPT2Model with random weights, batch 1,
torch's default ONNX exporter, each at two sizes (``small``: 2 layers, hidden 128; ``medium``: 4 layers, hidden
256, ViT 192). Two estimates per export, both beside the end-to-end latency (the fastest of 3 fresh
``OrtRunner`` sessions' medians, as benchmarks/cost_model.py measures it):

- ``as rlflow cost``: what ``rlflow cost EXPORT --target ort-cpu`` computes -- the target learns onnxruntime's
  fusions and in-model kernel times from the export itself, then times its kernels;
- ``held out``: the target learned only from the zoo's transformers (``bert``, ``vit``, ``gpt2``, built by the
  project at ``--zoo-size``, with their one-rewrite neighbours as measure_costs learns), then the export's kernels
  are timed each in its own session (``measure``): no session of the export itself informs the estimate.

The discrepancy is ``|estimate - E2E| / E2E x 100``; the last line gives its mean over the exports for both, and
the smallest ratio of an estimate to the graph's roofline bound (``rlflow cost``'s, >= 1 when no estimate falls
below it). CPU timings need a quiet machine: the load average is printed at the start and the end.

  python benchmarks/heldout_exports.py                       # both sizes, default timing
  python benchmarks/heldout_exports.py --sizes small --op-repeats 10 --repeats 10   # a quick check
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from cost_model import e2e_ort, fmt, pct  # noqa: E402
from hf_exports import FAMILIES, SIZES, export  # noqa: E402

from rlflow.config import get, load_config  # noqa: E402
from rlflow.cost import make_cost_model  # noqa: E402
from rlflow.cost.calibration import measure as calibrate  # noqa: E402
from rlflow.cost.model import describe_hardware  # noqa: E402
from rlflow.graph import load_onnx, zoo  # noqa: E402

#: the zoo's transformers the held-out target learns from, and the size they are built at
ZOO_LEARN = ("bert", "vit", "gpt2")
ZOO_SIZE = {"bert": dict(layers=2, hidden=192, heads=3, ffn=768, seq=96, vocab=1000),
            "vit": dict(layers=2, hidden=160, heads=2, mlp=640, image=160),
            "gpt2": dict(layers=2, hidden=192, heads=3, ffn=768, seq=96, vocab=1000)}


def zoo_learned(config, cal, tmp: Path):
    """An ort-cpu target that learned from the zoo's transformers only."""
    from rlflow.rewrite.builtin import builtin_rules
    from rlflow.stages.measure_costs import learning_graphs

    rules = [r for r, _ in builtin_rules()]
    cost = make_cost_model(config, "cpu", kind="ort-cpu")
    cost.set_calibration(cal)
    graphs = []
    for name in ZOO_LEARN:
        path = tmp / f"zoo-{name}.onnx"
        zoo.export_model(name, path, dict(zoo.DEFAULT_SIZES[name], **ZOO_SIZE[name]))
        graphs += learning_graphs(load_onnx(path), rules, get(config, "cost.learn_graphs"))
    cost.learn(graphs)
    cost.measure(graphs)  # as measure_costs does: each kernel also alone, so its in-model / alone ratio is known
    return cost


def estimate_as_rlflow_cost(config, cal, graph) -> float:
    """What `rlflow cost --target ort-cpu` estimates without a cache: learn the graph, time its kernels."""
    cost = make_cost_model(config, "cpu", kind="ort-cpu")
    cost.set_calibration(cal)
    cost.learn([graph])
    cost.measure([graph])
    return cost.graph_metrics(graph).runtime_ms


def heldout_rows(config, cal, families=FAMILIES, sizes=("small", "medium"), warmup: int = 5, repeats: int = 30
                 ) -> list[dict]:
    """Per export: its estimates (as rlflow cost; held out), the end-to-end latency, discrepancies and bound."""
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        held = zoo_learned(config, cal, tmp)
        print(f"held-out target learned from the zoo's {', '.join(ZOO_LEARN)} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
        for fam in families:
            for size in sizes:
                t1 = time.perf_counter()
                g = load_onnx(export(fam, size, tmp / f"{fam}-{size}.onnx"))
                held.measure([g])
                est = {"rlflow cost": estimate_as_rlflow_cost(config, cal, g),
                       "held out": held.graph_metrics(g).runtime_ms}
                e2e = e2e_ort(g, warmup, repeats)
                bound = held.roofline_bound_ms(g)
                rows.append({"model": f"{fam}-{size}", "nodes": len(g.nodes), "e2e": e2e, "est": est,
                             "d": {k: pct(v, e2e) for k, v in est.items()}, "bound": bound})
                print(f"[{fam}-{size}] e2e {fmt(e2e, '.3f')} ms; as rlflow cost {est['rlflow cost']:.3f} ms, "
                      f"held out {est['held out']:.3f} ms; bound {bound:.3f} ms ({time.perf_counter() - t1:.0f} s)",
                      file=sys.stderr, flush=True)
    return rows


def print_rows(rows: list[dict]) -> str:
    """Print the table; returns the summary line (means, the smallest estimate / bound)."""
    print("ort-cpu on held-out transformers exports (ms); d = |estimate - E2E| / E2E x 100 (%)")
    head = f"{'export':<14} {'nodes':>5} {'E2E ort':>9} {'as rlflow cost':>14} {'d%':>6} {'held out':>9} {'d%':>6} " \
           f"{'bound':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<14} {r['nodes']:5d} {fmt(r['e2e'], '9.3f')} {r['est']['rlflow cost']:14.3f} "
              f"{fmt(r['d']['rlflow cost'], '6.1f')} {r['est']['held out']:9.3f} {fmt(r['d']['held out'], '6.1f')} "
              f"{r['bound']:8.3f}")
    means = {k: [r["d"][k] for r in rows if r["d"][k] is not None] for k in ("rlflow cost", "held out")}
    means = {k: sum(v) / len(v) if v else None for k, v in means.items()}
    low = min((min(r["est"].values()) / r["bound"] for r in rows if r["bound"] > 0), default=None)
    return (f"heldout_mean_abs_diff_pct_as_rlflow_cost={fmt(means['rlflow cost'], '.1f')} "
            f"heldout_mean_abs_diff_pct_zoo_learned={fmt(means['held out'], '.1f')} "
            f"min_estimate_over_bound={fmt(low, '.3f')} exports={len(rows)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--sizes", nargs="+", default=["small", "medium"], choices=("small", "medium"))
    ap.add_argument("--warmup", type=int, default=5, help="end-to-end untimed runs (default 5)")
    ap.add_argument("--repeats", type=int, default=30, help="end-to-end timed runs (default 30)")
    ap.add_argument("--op-warmup", type=int, help="untimed runs per kernel (default: cost.warmup, 8)")
    ap.add_argument("--op-repeats", type=int, help="timed runs per kernel (default: cost.repeats, 32)")
    ap.add_argument("--config", help="config file (default: the schema defaults)")
    args = ap.parse_args()
    overrides = [f"cost.{k}={v}" for k, v in (("warmup", args.op_warmup), ("repeats", args.op_repeats))
                 if v is not None]
    config = load_config(args.config, overrides)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    cal = calibrate("ort", "cpu")  # measured now, beside the timings (a cached one may be from a busier hour)
    rows = heldout_rows(config, cal, args.families, args.sizes, args.warmup, args.repeats)
    print(f"{describe_hardware('cpu')} ({os.cpu_count()} cores); calibration (ort): GEMM "
          f"{cal.gemm_flops_per_s / 1e9:.1f} GFLOP/s, {cal.bandwidth_bytes_per_s / 1e9:.2f} GB/s, profiler "
          f"{(cal.profiler_overhead_s or 0) * 1e6:.2f} us per kernel; kernels: warmup {get(config, 'cost.warmup')}, "
          f"repeats {get(config, 'cost.repeats')}; E2E fastest of 3 sessions' medians of {args.repeats}; load "
          f"average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; {time.perf_counter() - t0:.0f} s")
    print(print_rows(rows))


if __name__ == "__main__":
    main()
