"""Cost targets vs end-to-end latency (issue 13, item 4): X-RLflow's "cost model vs E2E" table for every target,
then a sign test over graphs reached by rewrite sequences.

**Table.** For each zoo model and each target -- ``ort-cpu`` (onnxruntime's fusions learned from the model and
its one-rewrite neighbours, ``cost.learn_graphs`` graphs, as the measure_costs stage does; its kernels timed),
``torch-eager`` (each op timed as a torch eager call), ``analytic`` (the roofline of this device's onnxruntime
calibration) and ``sim-h100`` (labelled "simulated H100") -- the estimate beside the end-to-end onnxruntime
latency (the smallest of 3 sessions' medians of ``--repeats`` runs after ``--warmup``, each one ``OrtRunner`` as
the evaluation makes it), and
the discrepancy ``|estimate - E2E| / E2E x 100``, with its mean over the models per target (X-RLflow's GPU
figures: 5-24%). A simulated GPU has no local end-to-end latency: its estimate is shown, no discrepancy.

**Sign test.** ``--graphs`` graphs reached from inceptionv3, resnext50, squeezenet and bert by the project's rules
(the builtin rules, or ``--rules``) and engine (``MatchIndex``), taken round-robin over the models from each
model's list: every parallel Conv/MatMul merge applied until none is left (InceptionV3's branch merges among
them), all Conv+ReLU fusions, the first merge of each merge rule, one rewrite of each rule that matches, and
seeded random rewrite walks of 2, 4, 8, 16 and 32 steps. Each graph is timed against its original on onnxruntime
with issue G's protocol (:mod:`rlflow.evaluation.protocol`: fresh sessions, interleaved randomised rounds,
Student-t interval over sessions of the round-paired latency ratio; config section ``timing``, ``--budget-s`` seconds per
comparison), with the A/A control (the original re-imported) in the same comparison: a comparison whose A/A
interval excludes 1 is too noisy and its verdict is not counted. For every pair the protocol calls significant
(faster or slower), a target *hits* when its estimate moves the same way (lower for faster, higher for slower; an
unchanged estimate is a miss). The ort-cpu and torch-eager estimates are computed after timing every kernel / op
signature of the graphs (as measure_costs does for the graphs its search will meet).

The last line is ``mean_abs_diff_pct_ort_cpu=<x> mean_abs_diff_pct_torch_eager=<y> mean_abs_diff_pct_analytic=<z>
sign_hits_ort_cpu=<h>/<n> sign_hits_torch_eager=<h>/<n>``. CPU timings need a quiet machine: the load average is
printed at the start and the end.

  python benchmarks/cost_model.py --sizes tiny --graphs 30 --budget-s 1      # a short check (kernels/ops: 2 + 10 runs)
  python benchmarks/cost_model.py --sizes paper --graphs 40 --budget-s 20 --out /tmp/cost_model.json
  python benchmarks/cost_model.py --models bert resnet18 --graphs 0           # the table only

**Held-out exports** (benchmarks/heldout_exports.py; skipped with ``--heldout-sizes``): ort-cpu's estimate of
transformers exports (BERT, ViT, GPT-2 at ``--heldout-sizes``) it never learned from, beside their end-to-end
latency; its mean discrepancy is the very last line (``heldout_mean_abs_diff_pct_as_rlflow_cost=...``), to read
beside the zoo's ``mean_abs_diff_pct_ort_cpu`` on the line before it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rlflow.config import get, load_config  # noqa: E402
from rlflow.cost import AnalyticCost, make_cost_model  # noqa: E402
from rlflow.cost.calibration import measure as calibrate  # noqa: E402
from rlflow.cost.model import describe_hardware  # noqa: E402
from rlflow.evaluation import protocol as proto  # noqa: E402
from rlflow.graph import load_onnx, zoo  # noqa: E402
from rlflow.graph.exec import make_inputs, time_runner  # noqa: E402
from rlflow.graph.exec.ort_exec import OrtRunner  # noqa: E402
from rlflow.rewrite.matcher import MatchIndex, apply  # noqa: E402

#: the targets of the table, in print order; the estimate of a sim-* target is labelled with the cost's label
TABLE_TARGETS = ("ort-cpu", "torch-eager", "analytic", "sim-h100")
#: targets whose estimate is compared with local end-to-end latency
LOCAL = ("ort-cpu", "torch-eager", "analytic")
#: the sign test's models
SIGN_MODELS = ("inceptionv3", "resnext50", "squeezenet", "bert")
#: the rule names of the parallel merges and of the Conv+ReLU fusion (rlflow.rewrite.builtin)
MERGES = ("conv-merge", "conv-enlarge-merge", "matmul-merge")
FUSION = ("conv-relu-fuse",)
WALKS = (2, 4, 8, 16, 32)


def load_model(name: str, sizes: str, tmp: Path):
    """The zoo model at ``sizes`` (``paper``: results/<model>/model.onnx when present, else exported)."""
    path = ROOT / "results" / name / "model.onnx"
    if sizes == "tiny" or not path.is_file():
        path = tmp / f"{name}.onnx"
        zoo.export_model(name, path, zoo.TINY_SIZES[name] if sizes == "tiny" else None)
    return load_onnx(path)


def load_rule_list(path: str | None) -> list:
    if path:
        from rlflow.rewrite import load_rules

        return load_rules(path)
    from rlflow.rewrite.builtin import builtin_rules

    return [r for r, _ in builtin_rules()]


# ---------------------------------------------------------------------------------------------- the table
def e2e_ort(graph, warmup: int, repeats: int, sessions: int = 3) -> float | None:
    """End-to-end onnxruntime latency (ms): the fastest of ``sessions`` fresh sessions' medians, as the ort-cpu
    target times its kernels (this machine's speed moves in bursts of seconds: InceptionV3's median of 5 runs
    went from 42 to 78 ms and back within a minute, nothing else running)."""
    try:
        return min(time_runner(OrtRunner(graph, "cpu"), make_inputs(graph), warmup, repeats)["median_ms"]
                   for _ in range(sessions))
    except Exception as e:  # noqa: BLE001 - a benchmark row, not a crash
        print(f"  onnxruntime failed: {e.__class__.__name__}: {e}", file=sys.stderr)
        return None


def make_targets(config, cal, graph, rules) -> dict:
    """The table's cost models for ``graph``: ort-cpu learned and timed on it, torch-eager timed on it."""
    from rlflow.stages.measure_costs import learning_graphs

    ort = make_cost_model(config, "cpu", kind="ort-cpu")
    ort.set_calibration(cal)
    ort.learn(learning_graphs(graph, rules, get(config, "cost.learn_graphs")))
    torch_eager = make_cost_model(config, "cpu", kind="torch-eager")
    return {"ort-cpu": ort, "torch-eager": torch_eager, "analytic": AnalyticCost("cpu", cal.as_peak()),
            "sim-h100": make_cost_model(config, "cpu", kind="sim-h100")}


def pct(est: float, ref: float | None) -> float | None:
    return None if ref is None or not ref > 0 else abs(est - ref) / ref * 100.0


def fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


class Models:
    """Each model loaded, and its cost models built (ort-cpu's fusions learned), once for both parts."""

    def __init__(self, args, config, cal, rules, tmp: Path):
        self.args, self.config, self.cal, self.rules, self.tmp = args, config, cal, rules, tmp
        self.cache: dict[str, tuple] = {}

    def __call__(self, name: str) -> tuple:
        if name not in self.cache:
            g = load_model(name, self.args.sizes, self.tmp)
            self.cache[name] = (g, make_targets(self.config, self.cal, g, self.rules))
        return self.cache[name]


def table(args, models: Models) -> list[dict]:
    rows = []
    for name in args.models:
        t0 = time.perf_counter()
        g, costs = models(name)
        timed = {k: costs[k].measure([g]) for k in ("ort-cpu", "torch-eager")}
        est = {k: c.graph_metrics(g).runtime_ms for k, c in costs.items()}
        e2e = e2e_ort(g, args.warmup, args.repeats)
        row = {"model": name, "nodes": len(g.nodes), "e2e_ort_ms": e2e, "estimate_ms": est,
               "diff_pct": {k: pct(est[k], e2e) for k in LOCAL}, "timed": timed,
               "labels": {k: c.label for k, c in costs.items()}}
        rows.append(row)
        print(f"[{name}] e2e ort {fmt(e2e, '.3f')} ms; " + ", ".join(f"{k} {v:.3f} ms" for k, v in est.items())
              + f" ({timed['ort-cpu']} kernels, {timed['torch-eager']} ops timed; {time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
    return rows


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def print_table(rows: list[dict]) -> dict:
    sim_label = rows[0]["labels"]["sim-h100"] if rows else "simulated H100"
    print("cost target estimate vs end-to-end onnxruntime latency (ms); d = |estimate - E2E| / E2E x 100 (%)")
    head = (f"{'model':<12} {'E2E ort':>9} {'ort-cpu':>9} {'d%':>6} {'torch-eager':>11} {'d%':>6} {'analytic':>9} "
            f"{'d%':>6} {sim_label:>15}")
    print(head)
    print("-" * len(head))
    for r in rows:
        e, d = r["estimate_ms"], r["diff_pct"]
        print(f"{r['model']:<12} {fmt(r['e2e_ort_ms'], '9.3f')} {e['ort-cpu']:9.3f} {fmt(d['ort-cpu'], '6.1f')} "
              f"{e['torch-eager']:11.3f} {fmt(d['torch-eager'], '6.1f')} {e['analytic']:9.3f} "
              f"{fmt(d['analytic'], '6.1f')} {e['sim-h100']:15.4f}")
    print("-" * len(head))
    means = {k: mean(r["diff_pct"][k] for r in rows) for k in LOCAL}
    print(f"{'mean d%':<12} {'':>9} {'':>9} {fmt(means['ort-cpu'], '6.1f')} {'':>11} "
          f"{fmt(means['torch-eager'], '6.1f')} {'':>9} {fmt(means['analytic'], '6.1f')} "
          f"{'(no local E2E)':>15}")
    return means


# ---------------------------------------------------------------------------------------------- sign test
def closure(graph, rules, names, cap: int = 2000):
    """``graph`` with the rules named ``names`` applied (first match) until none matches; None if none did."""
    sub = [r for r in rules if r.name in names]
    if not sub:
        return None
    idx, steps = MatchIndex(graph, sub), 0
    while steps < cap:
        ks = [k for k, c in enumerate(idx.counts()) if c]
        if not ks:
            break
        idx = idx.apply(ks[0], 0)
        steps += 1
    return (idx.graph, steps) if steps else None


def candidates(graph, rules, seed: int):
    """(label, graph) reached from ``graph``, in the order the sign test takes them (see the module docstring)."""
    c = closure(graph, rules, MERGES)
    if c:
        yield f"all merges ({c[1]})", c[0]
    c = closure(graph, rules, FUSION)
    if c:
        yield f"all conv-relu fusions ({c[1]})", c[0]
    root = MatchIndex(graph, rules)
    firsts = [(rules[k], m[0]) for k, m in enumerate(root.matches) if m]
    for r, m in firsts:
        if r.name in MERGES:
            yield f"one {r.id}", apply(graph, m)
    rng = random.Random(seed)
    walks = iter(WALKS)
    for r, m in firsts:
        if r.name not in MERGES:
            yield f"one {r.id}", apply(graph, m)
        n = next(walks, None)
        if n is not None:
            w = walk(root, n, rng)
            if w is not None:
                yield f"walk of {w[1]}", w[0]
    for n in walks:
        w = walk(root, n, rng)
        if w is not None:
            yield f"walk of {w[1]}", w[0]


def walk(root, steps: int, rng: random.Random):
    cur, done = root, 0
    for _ in range(steps):
        ks = [k for k, c in enumerate(cur.counts()) if c]
        if not ks:
            break
        k = rng.choice(ks)
        cur = cur.apply(k, rng.randrange(len(cur.matches[k])))
        done += 1
    return (cur.graph, done) if done else None


def sign_test(args, config, rules, loaded: Models) -> list[dict]:
    models = [m for m in SIGN_MODELS if m in args.sign_models]
    originals = {m: loaded(m)[0] for m in models}
    gens = {m: candidates(originals[m], rules, config.get("seed", 0)) for m in models}
    picked: list[tuple[str, str, object]] = []
    while len(picked) < args.graphs and gens:
        for m in list(gens):
            item = next(gens[m], None)
            if item is None:
                del gens[m]
            elif len(picked) < args.graphs:
                picked.append((m, *item))
    protocol = proto.Protocol.from_config(config, budget_s=args.budget_s)
    make_runner = proto.backend_runner("ort", "cpu")
    costs = {m: loaded(m)[1] for m in models}
    for m in models:
        mine = [originals[m]] + [g for mm, _, g in picked if mm == m]
        for k in ("ort-cpu", "torch-eager"):
            costs[m][k].measure(mine)
    print(f"sign test: {len(picked)} graphs on onnxruntime, {protocol.describe()}; A/A control in each comparison",
          file=sys.stderr, flush=True)
    rows = []
    for i, (m, what, g) in enumerate(picked):
        g0 = originals[m]
        cmp = proto.compare([("original", g0), (proto.AA, proto.aa_copy(g0)), ("rewritten", g)], make_inputs(g0),
                            protocol, make_runner)
        e = cmp["rewritten"]
        est = {k: (costs[m][k].graph_metrics(g0).runtime_ms, costs[m][k].graph_metrics(g).runtime_ms)
               for k in ("ort-cpu", "torch-eager", "sim-h100")}
        row = {"model": m, "graph": what, "nodes": [len(g0.nodes), len(g.nodes)], "ratio": e.ratio,
               "latency_ms": [cmp["original"].latency_ms, e.latency_ms], "ci": [e.ci_low, e.ci_high], "verdict": e.verdict, "too_noisy": cmp.too_noisy,
               "aa": cmp[proto.AA].interval(), "estimate_ms": est}
        row["significant"] = e.verdict in (proto.FASTER, proto.SLOWER) and not cmp.too_noisy
        row["hit"] = {k: hits(e.verdict, *est[k]) for k in ("ort-cpu", "torch-eager")}
        rows.append(row)
        print(f"  [{i + 1}/{len(picked)}] {m}: {what}: ratio {e.interval()} {e.verdict}"
              + (" (too noisy: A/A " + cmp[proto.AA].interval() + ")" if cmp.too_noisy else "")
              + "; estimate ratio " + ", ".join(f"{k} {b / a:.3f}" for k, (a, b) in est.items() if a > 0),
              file=sys.stderr, flush=True)
    make_runner.close()  # (its ONNX files)
    return rows


def hits(verdict: str, before: float, after: float) -> bool:
    return (verdict == proto.FASTER and after < before) or (verdict == proto.SLOWER and after > before)


def print_sign(rows: list[dict]) -> dict:
    print("sign test: end-to-end change (onnxruntime, issue G protocol) vs the estimate's change; "
          "ratio = rewritten / original")
    head = f"{'model':<12} {'graph':<34} {'E2E ratio [CI]':<26} {'verdict':<25} {'ort-cpu':>8} {'torch':>8} {'hit':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        est = r["estimate_ms"]
        ratio = (f"{r['ratio']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]" if r["ratio"] is not None else "n/a")
        verdict = r["verdict"] + (" (noisy)" if r["too_noisy"] else "")
        hit = ("/".join("y" if r["hit"][k] else "n" for k in ("ort-cpu", "torch-eager"))
               if r["significant"] else "-")
        print(f"{r['model']:<12} {r['graph'][:34]:<34} {ratio:<26} {verdict[:25]:<25} "
              f"{est['ort-cpu'][1] / est['ort-cpu'][0]:8.3f} {est['torch-eager'][1] / est['torch-eager'][0]:8.3f} "
              f"{hit:>9}")
    sig = [r for r in rows if r["significant"]]
    out = {k: (sum(r["hit"][k] for r in sig), len(sig)) for k in ("ort-cpu", "torch-eager")}
    noisy = sum(r["too_noisy"] for r in rows)
    print(f"significant pairs: {len(sig)} of {len(rows)} ({noisy} comparisons too noisy by the A/A control); sign "
          f"predicted: ort-cpu {out['ort-cpu'][0]}/{len(sig)}, torch-eager {out['torch-eager'][0]}/{len(sig)} "
          "(hit/miss columns: ort-cpu/torch-eager)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(zoo.MODEL_NAMES), choices=zoo.MODEL_NAMES,
                    help="models of the table (default: all 8)")
    ap.add_argument("--sign-models", nargs="+", default=list(SIGN_MODELS), choices=SIGN_MODELS,
                    help="models of the sign test (default: inceptionv3 resnext50 squeezenet bert)")
    ap.add_argument("--sizes", choices=("paper", "tiny"), default="paper")
    ap.add_argument("--graphs", type=int, default=32, help="graphs of the sign test (default 32; 0: no sign test)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds per comparison of the sign test (default: the config's timing.budget_s)")
    ap.add_argument("--warmup", type=int, default=5, help="table: end-to-end untimed runs (default 5)")
    ap.add_argument("--repeats", type=int, default=30, help="table: end-to-end timed runs (default 30)")
    ap.add_argument("--op-warmup", type=int, help="untimed runs per kernel / op (default: cost.warmup, 8)")
    ap.add_argument("--op-repeats", type=int, help="timed runs per kernel / op (default: cost.repeats, 32)")
    ap.add_argument("--rules", help="rules file (default: the builtin rules)")
    ap.add_argument("--config", help="config file (default: the schema defaults)")
    ap.add_argument("--out", type=Path, help="also write the results as JSON here")
    ap.add_argument("--heldout-sizes", nargs="*", default=["small", "medium"], choices=("small", "medium"),
                    help="sizes of the held-out transformers exports (default: small medium; none given: skip)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch's CPU threads (default 0: all cores); 1 keeps torch-eager op timings stable when "
                         "other processes share the machine (oversubscribed OpenMP waits inflate them)")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.sizes == "tiny":  # a quick check: fewer timed runs per kernel / op unless asked for
        args.op_warmup = 2 if args.op_warmup is None else args.op_warmup
        args.op_repeats = 10 if args.op_repeats is None else args.op_repeats
    overrides = [f"cost.{k}={v}" for k, v in (("warmup", args.op_warmup), ("repeats", args.op_repeats))
                 if v is not None]
    config = load_config(args.config, overrides)
    rules = load_rule_list(args.rules)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    cal = calibrate("ort", "cpu")  # measured now, beside the timings (a cached one may be from a busier hour)
    with tempfile.TemporaryDirectory() as tmp:
        loaded = Models(args, config, cal, rules, Path(tmp))
        rows = table(args, loaded) if args.models else []
        signs = sign_test(args, config, rules, loaded) if args.graphs > 0 else []
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import heldout_exports  # its e2e_ort is this module's

    heldout = heldout_exports.heldout_rows(config, cal, sizes=args.heldout_sizes, warmup=args.warmup,
                                           repeats=args.repeats) if args.heldout_sizes else []
    hw = describe_hardware("cpu")
    print(f"{hw} ({os.cpu_count()} cores), sizes {args.sizes}; calibration (ort): GEMM "
          f"{cal.gemm_flops_per_s / 1e9:.1f} GFLOP/s, {cal.bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
          f"{cal.kernel_overhead_s * 1e6:.2f} us per kernel; kernels/ops: warmup {get(config, 'cost.warmup')}, "
          f"repeats {get(config, 'cost.repeats')}, profiler {(cal.profiler_overhead_s or 0) * 1e6:.2f} us per "
          f"kernel; E2E fastest of 3 sessions' medians of {args.repeats} (warmup {args.warmup}); load "
          f"average {load0:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; {time.perf_counter() - t0:.0f} s")
    means = print_table(rows) if rows else {k: None for k in LOCAL}
    sign = print_sign(signs) if signs else {k: (0, 0) for k in ("ort-cpu", "torch-eager")}
    heldout_line = heldout_exports.print_rows(heldout) if heldout else None
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"hardware": hw, "cores": os.cpu_count(), "sizes": args.sizes,
                                        "calibration": cal.as_peak(), "table": rows, "mean_diff_pct": means,
                                        "sign_test": signs, "sign_hits": sign, "heldout": heldout}, indent=1,
                                       default=str) + "\n")
    print(f"mean_abs_diff_pct_ort_cpu={fmt(means['ort-cpu'], '.1f')} "
          f"mean_abs_diff_pct_torch_eager={fmt(means['torch-eager'], '.1f')} "
          f"mean_abs_diff_pct_analytic={fmt(means['analytic'], '.1f')} "
          f"sign_hits_ort_cpu={sign['ort-cpu'][0]}/{sign['ort-cpu'][1]} "
          f"sign_hits_torch_eager={sign['torch-eager'][0]}/{sign['torch-eager'][1]}")
    if heldout_line:
        print(heldout_line)


if __name__ == "__main__":
    main()
