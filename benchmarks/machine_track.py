"""The machine track over the zoo: what each method finds when it optimises for this machine's own target, and
what that graph is worth here, verified end to end on onnxruntime with the measurement protocol.

For each model (paper size by default): export it (`rlflow export-model`), make the machine target's cost cache
(`rlflow measure-costs --set cost.target=machine`: ort-cpu on a CPU box, with the pipeline's measure_costs_machine
settings), then run taso, greedy and eqsat with that cost model (the config's search and eqsat settings, with the
pipeline's machine-track time limit for taso and greedy: registry MACHINE_SEARCH_SETS), and onnxruntime's
offline transformer optimizer where it applies (bert, taso-bert, vit, gpt2). Every graph is checked equal to the
original under onnxruntime. Each graph that differs from the original is then timed against it under the
measurement protocol (rlflow.evaluation.protocol, the config's timing section, --budget-s seconds per comparison,
default 60), the A/A control (the original re-exported) in the same comparison: the ratio [95% CI] and verdict.
No never-slower gate: the figure is that of the graph the method found (the gate would keep the original where
the verdict is not "faster"). A graph equal to the original is reported "unchanged" without timing.

Resumable: each model's results go to OUT_DIR/<model>.json when the model is done and are read back (not redone)
on the next run; delete a file to redo that model. The table (every model in --models with a results file) and
the wall time are the last lines.

  python benchmarks/machine_track.py                                 # the 9 zoo models at paper size, 60 s each
  python benchmarks/machine_track.py --models bert taso-bert --budget-s 120
  python benchmarks/machine_track.py --models squeezenet --sizes tiny --budget-s 5 --out-dir /tmp/mt   # a check
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rlflow.cli import main as cli_main  # noqa: E402
from rlflow.config import get, load_config, resolve_device  # noqa: E402
from rlflow.cost import make_cost_model  # noqa: E402
from rlflow.cost.targets import resolve_target  # noqa: E402
from rlflow.evaluation.protocol import AA, Protocol, aa_copy, backend_runner, compare  # noqa: E402
from rlflow.graph import load_onnx, zoo  # noqa: E402
from rlflow.graph.exec import make_inputs  # noqa: E402
from rlflow.graph.exec.check import check_equal  # noqa: E402
from rlflow.pipeline.registry import MACHINE_COSTS_SETS, MACHINE_SEARCH_SETS  # noqa: E402
from rlflow.rewrite import load_rules  # noqa: E402
from rlflow.search.ort_optimizer import model_type, ort_optimizer  # noqa: E402
from rlflow.search.output import run_method  # noqa: E402
from rlflow.stages.search_common import eqsat_settings  # noqa: E402

SEARCHES = ("taso", "greedy", "eqsat")
METHODS = (*SEARCHES, "ort_optimizer")


def cli(*argv: str) -> None:
    code = cli_main([str(a) for a in argv])
    if code:
        raise SystemExit(f"machine_track: `rlflow {' '.join(map(str, argv))}` failed (exit {code})")


def run_model(name: str, args, config_files: list[str], work: Path) -> dict:
    """One model: export, cost cache, the methods' graphs, their comparisons with the original."""
    t0 = time.perf_counter()
    # the pipeline's machine-track settings (cost cache, search time limit), then the command line's --set
    sets = [f"{k}={v}" for k, v in (*MACHINE_COSTS_SETS, *MACHINE_SEARCH_SETS)] + args.set
    config = load_config(config_files, sets)
    device, seed = resolve_device(config), get(config, "seed")
    conf = [a for f in config_files for a in ("--config", f)] + [a for s in sets for a in ("--set", s)]
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    onnx, costs = folder / "model.onnx", folder / "costs-machine.json"
    if not onnx.is_file():
        cli("export-model", *conf, "--model", name, "--out", onnx)
    if not costs.is_file():
        cli("measure-costs", *conf, "--model", name, "--onnx", onnx, "--rules", args.rules, "--out", costs,
            "--set", "cost.target=machine", "--no-progress")
    target = resolve_target(config, "machine")
    cost = make_cost_model(config, device, costs, kind=target)
    original = load_onnx(onnx)
    rules = load_rules(args.rules)
    found: dict[str, dict] = {}
    graphs = {}
    for method in METHODS:
        if method == "ort_optimizer" and model_type(name) is None:
            found[method] = {"applies": False}
            continue
        s0 = time.perf_counter()
        if method == "ort_optimizer":
            sizes = config["zoo"][name]
            result = ort_optimizer(original, onnx, model_type(name), cost, int(sizes.get("heads", 0)),
                                   int(sizes.get("hidden", 0)))
        else:
            result = run_method(method, original, rules, cost, alpha=get(config, "search.alpha"),
                                budget=get(config, "search.budget"), time_limit_s=get(config, "search.time_limit_s"),
                                eqsat=eqsat_settings(config))
        seconds = time.perf_counter() - s0
        diff = check_equal(original, result.graph, seed=seed, device=device, what=f"{name} ({method})")
        same = aa_copy(original).structural_hash() == aa_copy(result.graph).structural_hash()
        found[method] = {"applies": True, "search_s": seconds, "nodes_before": result.nodes_before,
                         "nodes_after": result.nodes_after, "estimate_before_ms": result.initial.runtime_ms,
                         "estimate_after_ms": result.final.runtime_ms, "max_rel_diff": diff, "unchanged": same}
        print(f"machine_track: {name} {method}: estimate {result.initial.runtime_ms:.4f} -> "
              f"{result.final.runtime_ms:.4f} ms ({target}), nodes {result.nodes_before} -> {result.nodes_after}, "
              f"{seconds:.1f} s" + (" (unchanged)" if same else ""), flush=True)
        if not same:
            graphs[method] = result.graph
    protocol = Protocol.from_config(config, budget_s=args.budget_s)
    feeds = make_inputs(original, seed)
    for method, graph in graphs.items():
        with backend_runner(args.backend, device) as fresh:
            c = compare([("original", original), (AA, aa_copy(original)), (method, graph)], feeds, protocol, fresh)
        e = c[method]
        found[method].update(ratio=e.ratio, ci_low=e.ci_low, ci_high=e.ci_high, verdict=e.verdict,
                             detectable=e.detectable, runs=e.runs, too_noisy=c.too_noisy, aa_ratio=c[AA].ratio,
                             aa_ci=[c[AA].ci_low, c[AA].ci_high], timing_s=c.timing_s)
        print(f"machine_track: {name} {method}: {e.interval()} on {args.backend}, {e.verdict}"
              + (" (too noisy: the A/A control's interval excludes 1)" if c.too_noisy else ""), flush=True)
    return {"model": name, "target": target, "backend": args.backend, "device": device, "sizes": args.sizes,
            "protocol": protocol.describe(), "budget_s": args.budget_s, "methods": found,
            "seconds": time.perf_counter() - t0, "machine": platform.platform(), "processor": platform.processor()}


def cell(r: dict) -> str:
    if not r.get("applies", True):
        return "n/a"
    if r["unchanged"]:
        return "unchanged"
    if "ratio" not in r:
        return "not timed"
    verdict = "no difference" if r["verdict"] == "no detectable difference" else r["verdict"]
    flag = " (noisy)" if r.get("too_noisy") else ""
    return f"{r['ratio']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] {verdict}{flag}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(zoo.MODEL_NAMES), choices=zoo.MODEL_NAMES)
    p.add_argument("--sizes", choices=("paper", "tiny"), default="paper",
                   help="paper: config.yaml's sizes and settings; tiny: tests/configs/tiny.yaml merged over them")
    p.add_argument("--budget-s", type=float, default=60.0, help="seconds of timing per comparison (default 60)")
    p.add_argument("--backend", default="ort", help="the backend that verifies the graphs (default ort)")
    p.add_argument("--rules", type=Path,
                   help="rules file (default: OUT_DIR/rules.json, made first with the config's rules settings)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "results" / "benchmarks" / "machine_track",
                   help="one <model>.json per finished model (existing ones are skipped); work files in work/")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    config_files = [str(ROOT / "config.yaml")] + ([str(ROOT / "tests" / "configs" / "tiny.yaml")]
                                                   if args.sizes == "tiny" else [])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.rules = args.rules or args.out_dir / "rules.json"
    if not args.rules.is_file():
        cli("generate-rules", *[a for f in config_files for a in ("--config", f)], "--out", args.rules, "--no-progress")
    results = {}
    for name in args.models:
        path = args.out_dir / f"{name}.json"
        if path.is_file():
            results[name] = json.loads(path.read_text())
            print(f"machine_track: {name}: done before ({path}), skipped", flush=True)
            continue
        results[name] = run_model(name, args, config_files, args.out_dir / "work")
        path.write_text(json.dumps(results[name], indent=1) + "\n")
    first = next(iter(results.values()))
    print(f"\nmachine track: target {first['target']}, verified on {first['backend']} ({first['device']}), "
          f"{first['protocol']}; sizes {args.sizes}")
    print("ratio = the method's graph's latency / the original's [95% CI]; 'no difference': no detectable difference; "
          "'unchanged': the method found nothing; 'n/a': the optimizer does not apply")
    print(f"{'model':<12}" + "".join(f"{m:<38}" for m in METHODS) + "model s")
    for name, r in results.items():
        print(f"{name:<12}" + "".join(f"{cell(r['methods'][m]):<38}" for m in METHODS) + f"{r['seconds']:.0f}")
    own = sum(r["seconds"] for r in results.values())
    print(f"total wall time: {time.perf_counter() - t0:.1f} s this run; {own:.1f} s over the models' own runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
