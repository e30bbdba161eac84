"""Cost model vs end-to-end latency: how well does the sum of per-op costs predict a model's real runtime?

For each zoo model: the measured cost model's estimate (after timing the model's op signatures on the CPU, as
`rlflow measure-costs` does; cost.warmup / cost.repeats of the schema defaults, or --op-warmup / --op-repeats)
and the analytic estimate (roofline + launch, the default cpu peak figures), against the end-to-end latency
measured on onnxruntime and on the torch executor (``time_runner``: the median of --repeats runs after --warmup;
torch first, then onnxruntime, whose worker threads spin after running). The difference is |cost - e2e| / e2e x 100, as in X-RLflow's table of
cost-model error (their GPU figures: 5-24%).

Reuses results/<model>/model.onnx when it exists and the sizes are the default (paper) sizes; otherwise the
model is exported to a temporary folder. The last lines printed are the table and
``mean_abs_diff_pct_ort=<x> mean_abs_diff_pct_torch=<y>`` (measured cost model, over the models).

  python benchmarks/cost_model.py                           # all 8 models, paper sizes: several minutes
  python benchmarks/cost_model.py --sizes tiny              # a quick check
  python benchmarks/cost_model.py --models bert resnet18 --repeats 50 --out /tmp/cost_model.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rlflow.config import load_config  # noqa: E402
from rlflow.cost import make_cost_model  # noqa: E402
from rlflow.cost.model import describe_hardware  # noqa: E402
from rlflow.graph import load_onnx, zoo  # noqa: E402
from rlflow.graph.exec import get_runner, make_inputs, time_runner  # noqa: E402
from rlflow.graph.exec.ort_exec import OrtRunner  # noqa: E402


def e2e(graph, backend: str, warmup: int, repeats: int, threads: int) -> dict:
    """Median end-to-end latency of one backend (``time_runner``); runtime errors are reported, not raised."""
    try:
        if backend == "ort":
            runner = OrtRunner(graph, "cpu", threads=threads)
        else:
            runner = get_runner(graph, backend, "cpu")
        return time_runner(runner, make_inputs(graph), warmup, repeats)
    except Exception as e:  # noqa: BLE001 - a benchmark row, not a crash
        return {"error": f"{e.__class__.__name__}: {e}"}


def pct(cost: float, ref: float | None) -> float | None:
    return None if ref is None else abs(cost - ref) / ref * 100.0


def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(zoo.MODEL_NAMES), choices=zoo.MODEL_NAMES)
    ap.add_argument("--sizes", choices=("default", "tiny"), default="default")
    ap.add_argument("--warmup", type=int, default=5, help="end-to-end untimed runs (default 5)")
    ap.add_argument("--repeats", type=int, default=20, help="end-to-end timed runs (default 20)")
    ap.add_argument("--op-warmup", type=int, help="untimed runs per op (default: cost.warmup, 8)")
    ap.add_argument("--op-repeats", type=int, help="timed runs per op (default: cost.repeats, 32)")
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads of torch (ops and e2e) and onnxruntime (default 0: the libraries' defaults, "
                         "all cores); 1 keeps timings stable when other processes share the machine")
    ap.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    overrides = []
    if args.op_warmup is not None:
        overrides.append(f"cost.warmup={args.op_warmup}")
    if args.op_repeats is not None:
        overrides.append(f"cost.repeats={args.op_repeats}")
    config = load_config(None, overrides)
    analytic = make_cost_model(config, "cpu", kind="analytic")
    rows = []
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            t_start = time.perf_counter()
            path = ROOT / "results" / name / "model.onnx"
            if args.sizes == "tiny" or not path.is_file():
                path = Path(tmp) / f"{name}.onnx"
                zoo.export_model(name, path, zoo.TINY_SIZES[name] if args.sizes == "tiny" else None)
            g = load_onnx(path)
            measured = make_cost_model(config, "cpu", kind="measured")  # a fresh table per model
            t0 = time.perf_counter()
            n_sigs = measured.measure([g])
            t_measure = time.perf_counter() - t0
            m, a = measured.graph_metrics(g), analytic.graph_metrics(g)
            # torch first: onnxruntime's worker threads spin for a while after each run
            runs = {b: e2e(g, b, args.warmup, args.repeats, args.threads) for b in ("torch", "ort")}
            del g
            ms = {b: r.get("median_ms") for b, r in runs.items()}
            row = {"model": name, "onnx": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else "(exported)",
                   "signatures": n_sigs, "measure_s": t_measure, "measured_ms": m.runtime_ms,
                   "analytic_ms": a.runtime_ms, "gflop": m.flops / 1e9, "launches": m.launches,
                   "ort_ms": ms["ort"], "torch_ms": ms["torch"],
                   "ort_iqr_ms": runs["ort"].get("iqr_ms"), "torch_iqr_ms": runs["torch"].get("iqr_ms"),
                   "diff_pct_ort": pct(m.runtime_ms, ms["ort"]), "diff_pct_torch": pct(m.runtime_ms, ms["torch"]),
                   "analytic_diff_pct_ort": pct(a.runtime_ms, ms["ort"]),
                   "analytic_diff_pct_torch": pct(a.runtime_ms, ms["torch"]),
                   "errors": {b: r["error"] for b, r in runs.items() if "error" in r}}
            rows.append(row)
            print(f"[{name}] {n_sigs} signatures timed in {t_measure:.1f} s; measured {m.runtime_ms:.2f} ms, "
                  f"analytic {a.runtime_ms:.2f} ms, ort {fmt(ms['ort'], '.2f')} ms, torch {fmt(ms['torch'], '.2f')} "
                  f"ms ({time.perf_counter() - t_start:.0f} s)" + (f" errors: {row['errors']}" if row["errors"] else ""),
                  file=sys.stderr, flush=True)

    def mean(key: str) -> float | None:
        xs = [r[key] for r in rows if r[key] is not None]
        return sum(xs) / len(xs) if xs else None

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"hardware": describe_hardware("cpu"), "cores": os.cpu_count(),
                                        "sizes": args.sizes, "rows": rows}, indent=1) + "\n")
    print(f"cost model vs end-to-end latency; {describe_hardware('cpu')} ({os.cpu_count()} cores), "
          f"threads {args.threads or 'default'}, sizes {args.sizes}; e2e median of {args.repeats} (warmup "
          f"{args.warmup}); ops: warmup {measured.warmup}, repeats {measured.repeats}; load average "
          f"{load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end (other processes distort CPU timings)")
    print("ms: cost estimates and e2e medians; d: measured cost model vs e2e, a: analytic vs e2e, in % "
          "(|cost - e2e| / e2e x 100)")
    head = (f"{'model':<12} {'sigs':>5} {'meas s':>6} {'measured':>9} {'analytic':>9} {'ort':>9} {'torch':>9} "
            f"{'d ort%':>7} {'d torch%':>8} {'a ort%':>7} {'a torch%':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<12} {r['signatures']:5d} {r['measure_s']:6.1f} {r['measured_ms']:9.2f} "
              f"{r['analytic_ms']:9.2f} {fmt(r['ort_ms'], '9.2f')} {fmt(r['torch_ms'], '9.2f')} "
              f"{fmt(r['diff_pct_ort'], '7.1f')} {fmt(r['diff_pct_torch'], '8.1f')} "
              f"{fmt(r['analytic_diff_pct_ort'], '7.1f')} {fmt(r['analytic_diff_pct_torch'], '8.1f')}")
    print("-" * len(head))
    print(f"{'mean':<12} {'':>5} {'':>6} {'':>9} {'':>9} {'':>9} {'':>9} {fmt(mean('diff_pct_ort'), '7.1f')} "
          f"{fmt(mean('diff_pct_torch'), '8.1f')} {fmt(mean('analytic_diff_pct_ort'), '7.1f')} "
          f"{fmt(mean('analytic_diff_pct_torch'), '8.1f')}")
    print(f"mean_abs_diff_pct_ort={fmt(mean('diff_pct_ort'), '.1f')} "
          f"mean_abs_diff_pct_torch={fmt(mean('diff_pct_torch'), '.1f')}")


if __name__ == "__main__":
    main()
