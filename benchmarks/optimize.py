"""TASO search on the zoo models: estimated cost and measured onnxruntime latency before and after.

For each model: export it (or reuse results/<model>/model.onnx at the default sizes), time its ops on the CPU
(MeasuredCost.measure), run taso_search with the measured cost model, check the result equal to the original
under onnxruntime, and time both graphs end to end under onnxruntime (run.warmup / run.repeats of the schema
defaults; --rounds rounds alternating original and optimised, the median of the rounds' medians). The table
comes last.

With --eqsat, equality saturation (rlflow.search.eqsat, the config's eqsat section) runs on the same graph
with the same cost model; its final cost and optimisation time are printed beside TASO's (a second table).
--target picks the cost target (sim-h100, ...; default: the measured per-op torch cost on this CPU); a measured
target (ort-cpu: this machine's onnxruntime) is prepared per model by `rlflow measure-costs` first, as in the
pipeline (a few minutes per model; --costs-dir keeps the caches for the next run).
With --eqsat --time-pairs K, both searches run K more times per model, interleaved (TASO first in even pairs,
eqsat first in odd ones), and eqsat's optimisation time over TASO's is printed as a ratio with its 95% interval
(Student's t over the pairs, as the measurement protocol's ``ratio_interval``).

  python benchmarks/optimize.py --sizes tiny                       # quick check, all 8 models
  python benchmarks/optimize.py --models bert resnet18 squeezenet  # paper sizes, budget 1000
  python benchmarks/optimize.py --short                            # eqsat vs TASO: tiny bert and resnet18, sim-h100
  python benchmarks/optimize.py --eqsat --target sim-h100          # eqsat vs TASO, every model at paper size
  python benchmarks/optimize.py --eqsat --target ort-cpu --costs-dir /tmp/costs   # ... on this machine's target
  python benchmarks/optimize.py --eqsat --target sim-h100 --models bert inceptionv3 resnext50 --time-pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rlflow.config import load_config  # noqa: E402
from rlflow.cli import main as cli_main  # noqa: E402
from rlflow.cost import MeasuredCost, make_cost_model  # noqa: E402
from rlflow.cost.targets import MEASURED  # noqa: E402
from rlflow.evaluation.protocol import ratio_interval  # noqa: E402
from rlflow.graph import load_onnx, zoo  # noqa: E402
from rlflow.graph.exec import get_runner, make_inputs, time_runner  # noqa: E402
from rlflow.graph.exec.check import check_equal  # noqa: E402
from rlflow.rewrite import load_rules  # noqa: E402
from rlflow.search import taso_search  # noqa: E402
from rlflow.search.eqsat import eqsat_search  # noqa: E402
from rlflow.stages.search_common import eqsat_settings  # noqa: E402


def measured_cost(name: str, path: Path, args, folder: Path):
    """A measured target's cost model as the pipeline prepares it: `rlflow measure-costs` (calibration, and for
    ort-cpu onnxruntime's fusions learned and the kernels of the model and its neighbours timed) writes the cost
    cache FOLDER/<model>.<target>.json once; later runs with the same --costs-dir reuse it."""
    cache = folder / f"{name}.{args.target}.json"
    if not cache.is_file():
        code = cli_main(["measure-costs", "--model", name, "--onnx", str(path), "--rules", str(args.rules),
                         "--out", str(cache), "--no-progress", "--set", f"cost.target={args.target}",
                         *(x for o in args.overrides for x in ("--set", o))])
        if code:
            raise SystemExit(f"measure-costs failed for {name} (exit {code})")
    return make_cost_model(load_config(None, [*args.overrides, f"cost.target={args.target}"]), "cpu", cache,
                           args.target)


def bench_model(name: str, path: Path, rules, args, cfg, folder: Path) -> dict:
    g = load_onnx(path)
    t0 = time.perf_counter()
    if args.target is None:
        cost = MeasuredCost("cpu", cfg["cost"]["peak"]["cpu"], warmup=cfg["cost"]["warmup"],
                            repeats=cfg["cost"]["repeats"])
    elif args.target in MEASURED:
        cost = measured_cost(name, path, args, folder)
    else:
        cost = make_cost_model(cfg, "cpu", kind=args.target)
    if not isinstance(cost, MeasuredCost):
        measured = 0
    elif args.explore is None:
        measured = cost.measure([g])
    else:  # as the measure_costs stage does: also the graphs one rewrite away and on random rewrite walks
        from rlflow.stages.measure_costs import explore

        measured = cost.measure(explore(g, rules, args.explore, cfg["seed"]))
    t_measure = time.perf_counter() - t0  # (a cost cache reused from --costs-dir: nothing measured now)
    r = taso_search(g, rules, cost, alpha=args.alpha, budget=args.budget, time_limit_s=args.time_limit,
                    progress=args.progress)
    diff = check_equal(g, r.graph)
    feeds = make_inputs(g)
    warm, reps = cfg["run"]["warmup"], cfg["run"]["repeats"]
    runners = get_runner(g, "ort"), get_runner(r.graph, "ort")
    rounds: list[list[float]] = [[], []]
    for _ in range(args.rounds):  # alternate, so that load from elsewhere on the machine hits both alike
        for k, run in enumerate(runners):
            rounds[k].append(time_runner(run, feeds, warm, reps)["median_ms"])
    before, after = (statistics.median(x) for x in rounds)
    eq = {}
    if args.eqsat:
        e = eqsat_search(g, rules, cost, **eqsat_settings(cfg))
        st = e.stats
        eq = {"eqsat_cost_ms": e.final.runtime_ms, "eqsat_s": e.seconds, "eqsat_stop": e.stop_reason,
              "eqsat_enodes": st["egraph_nodes"], "eqsat_iterations": st["iterations"],
              "eqsat_extraction": st["extraction"], "eqsat_ilp_optimal": st.get("ilp_optimal"),
              "eqsat_saturation_s": st["saturation_seconds"], "eqsat_extraction_s": st["extraction_seconds"],
              "eqsat_max_rel_diff": check_equal(g, e.graph)}
    if args.eqsat and args.time_pairs >= 2:
        taso_s, eqsat_s = [], []
        for k in range(args.time_pairs):
            runs = [("taso", lambda: taso_search(g, rules, cost, alpha=args.alpha, budget=args.budget,
                                                  time_limit_s=args.time_limit).seconds),
                    ("eqsat", lambda: eqsat_search(g, rules, cost, **eqsat_settings(cfg)).seconds)]
            for which, run in runs if k % 2 == 0 else runs[::-1]:
                (taso_s if which == "taso" else eqsat_s).append(run())
        ratio, lo, hi, _ = ratio_interval([[t] for t in taso_s], [[e] for e in eqsat_s])
        eq.update(time_pairs={"taso_s": taso_s, "eqsat_s": eqsat_s, "ratio": ratio, "ci": [lo, hi]})
    return {**eq, "model": name, "nodes_before": r.nodes_before, "nodes_after": r.nodes_after,
            "cost_before_ms": r.initial.runtime_ms, "cost_after_ms": r.final.runtime_ms,
            "ort_before_ms": before, "ort_after_ms": after, "rules_applied": len(r.trace),
            "rules": [s.rule_name for s in r.trace], "expansions": r.expansions, "generated": r.generated,
            "kept": r.kept, "search_s": r.seconds, "ms_per_expansion": r.ms_per_expansion,
            "stop": r.stop_reason, "max_rel_diff": diff, "ops_measured": measured, "measure_s": t_measure}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(zoo.MODEL_NAMES), choices=zoo.MODEL_NAMES)
    ap.add_argument("--sizes", choices=("tiny", "default"), default="default")
    ap.add_argument("--budget", type=int, default=1000)
    ap.add_argument("--alpha", type=float, default=None, help="default: search.alpha of the schema (1.05)")
    ap.add_argument("--time-limit", type=float, default=0, help="seconds per search (0: none)")
    ap.add_argument("--rules", type=Path, default=ROOT / "results/rules/rules.json")
    ap.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    ap.add_argument("--explore", type=int, metavar="STEPS",
                    help="also time the ops of every graph one rewrite away and of STEPS random rewrites (as the "
                         "measure_costs stage does); default: only the model's own ops")
    ap.add_argument("--rounds", type=int, default=3,
                    help="latency rounds, original and optimised alternating (median of the rounds' medians)")
    ap.add_argument("--progress", action="store_true", help="search progress bar on stderr")
    ap.add_argument("--target", help="cost target (sim-h100, ort-cpu, analytic, ...; default: measured per op on the "
                                     "CPU)")
    ap.add_argument("--costs-dir", type=Path, metavar="DIR",
                    help="with a measured --target (ort-cpu, torch-eager): keep each model's cost cache here "
                         "(made by rlflow measure-costs, as the pipeline does, on first use; default: a temporary "
                         "folder)")
    ap.add_argument("--eqsat", action="store_true", help="also run equality saturation (config section eqsat)")
    ap.add_argument("--time-pairs", type=int, default=0, metavar="K",
                    help="with --eqsat: K more interleaved TASO/eqsat runs per model, for eqsat's time ratio "
                         "with a 95%% interval (K >= 2)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override, e.g. eqsat.node_limit=20000")
    ap.add_argument("--short", action="store_true",
                    help="quick eqsat check: tiny bert and resnet18, sim-h100, budget 100, 1 latency round")
    args = ap.parse_args()
    if args.short:
        args.models, args.sizes, args.budget, args.rounds, args.eqsat = ["bert", "resnet18"], "tiny", 100, 1, True
        args.target = args.target or "sim-h100"
    cfg = load_config(None, args.overrides)
    args.alpha = cfg["search"]["alpha"] if args.alpha is None else args.alpha
    rules = load_rules(args.rules)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            cached = ROOT / "results" / name / "model.onnx"
            if args.sizes == "default" and cached.is_file():
                path = cached
            else:
                path = Path(tmp) / f"{name}.onnx"
                zoo.export_model(name, path, zoo.TINY_SIZES[name] if args.sizes == "tiny" else None)
            if args.costs_dir:
                args.costs_dir.mkdir(parents=True, exist_ok=True)
            row = bench_model(name, path, rules, args, cfg, args.costs_dir or Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()}-core CPU ({platform.processor() or 'cpu'}), "
          f"python {platform.python_version()}; {len(rules)} rules; sizes: {args.sizes}; taso alpha {args.alpha}, "
          f"budget {args.budget}; cost: {args.target or 'measured per op on the CPU'} "
          f"({'rlflow measure-costs per model' if args.target in MEASURED else 'model ops only' if args.explore is None else f'model + neighbours + {args.explore} walk steps'}); "
          f"ort latency: median of {args.rounds} "
          f"alternating rounds, each the median of {cfg['run']['repeats']} runs")
    head = (f"{'model':<12}{'nodes':>11}{'cost ms':>20}{'ort ms':>18}{'rules':>6}{'exp.':>6}{'search s':>9}"
            f"{'ms/exp':>8}{'max diff':>10}")
    print(head)
    for r in rows:
        print(f"{r['model']:<12}{r['nodes_before']:>5} -> {r['nodes_after']:<4}"
              f"{r['cost_before_ms']:>9.3f} -> {r['cost_after_ms']:<8.3f}"
              f"{r['ort_before_ms']:>8.3f} -> {r['ort_after_ms']:<7.3f}{r['rules_applied']:>5}{r['expansions']:>6}"
              f"{r['search_s']:>9.1f}{r['ms_per_expansion']:>8.1f}{r['max_rel_diff']:>10.1e}")
    if args.eqsat:
        e = cfg["eqsat"]
        print(f"\neqsat vs taso (cost target: {args.target or 'measured per op, cpu'}; eqsat node limit "
              f"{e['node_limit']}, {e['iter_limit']} iterations, {e['time_limit_s']} s, extraction {e['extraction']}, "
              f"ILP limit {e['ilp_time_limit_s']} s and {e['ilp_node_limit']} nodes; 0: none)")
        print(f"{'model':<12}{'cost before':>12}{'taso':>10}{'eqsat':>10}{'eqsat/taso':>11}{'taso s':>8}{'eqsat s':>8}"
              f"{'time ratio':>11}{'e-nodes':>8}{'iters':>6}  stop / extraction")
        for r in rows:
            print(f"{r['model']:<12}{r['cost_before_ms']:>12.4f}{r['cost_after_ms']:>10.4f}{r['eqsat_cost_ms']:>10.4f}"
                  f"{r['eqsat_cost_ms'] / r['cost_after_ms']:>11.4f}{r['search_s']:>8.1f}{r['eqsat_s']:>8.1f}"
                  f"{r['eqsat_s'] / max(r['search_s'], 1e-9):>11.3f}{r['eqsat_enodes']:>8}{r['eqsat_iterations']:>6}  "
                  f"{r['eqsat_stop']} / {r['eqsat_extraction']}{' (optimal)' if r['eqsat_ilp_optimal'] else ''}")
        paired = [r for r in rows if r.get("time_pairs")]
        if paired:
            print(f"\neqsat / taso optimisation time, {args.time_pairs} interleaved pairs per model "
                  "(ratio, 95% interval: Student's t over the pairs)")
            for r in paired:
                tp = r["time_pairs"]
                print(f"{r['model']:<12} {tp['ratio']:.3f} [{tp['ci'][0]:.3f}, {tp['ci'][1]:.3f}]  "
                      f"(taso median {statistics.median(tp['taso_s']):.1f} s, eqsat median "
                      f"{statistics.median(tp['eqsat_s']):.1f} s)")


if __name__ == "__main__":
    main()
