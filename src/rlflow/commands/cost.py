"""Estimate a model's cost on a cost target: runtime (the sum of per-kernel estimates, TASO's cost), GFLOPs,
memory access (MB read and written by all ops), kernel launches, and the whole graph's roofline lower bound
(all flops at peak compute or all bytes at peak bandwidth). Ops that read weights only count nothing (they are
folded before running); views (Reshape, Flatten, Identity) launch no kernel and move no bytes.

Targets (--target; default: cost.target of --config if given, else `machine`: cuda on a GPU, else ort-cpu):
  ort-cpu      onnxruntime on this CPU: which nodes it fuses (learned from its optimised model), each kernel timed
               in its own session (profiler), plus the calibrated per-kernel overhead
  torch-eager  each distinct op signature timed as a torch eager call (ops a cache lacks: roofline x ratio)
  cuda         each op timed on the GPU with CUDA events (8 warm-up, 32 runs); needs a GPU
  sim-v100 | sim-a100 | sim-h100   a simulated GPU from its spec figures (cost.gpus): printed "simulated <GPU>"
  analytic     roofline per op from the device calibration (in --costs), else the config's cost.peak
Without --costs, a measured target times the model's kernels on the fly (cost.warmup / cost.repeats of --config;
--save-cache PATH keeps them). With --costs CACHE.json it reads the cache `rlflow measure-costs` wrote
(results/costs/<device>/<model>.json). (--model measured|analytic is the old spelling of --target.)

`rlflow cost calibrate` measures this machine's sustained GEMM rate, memory bandwidth and per-kernel overhead for
each CPU backend (onnxruntime, torch eager) and caches them (default ~/.cache/rlflow/calibration/, or --out).

  rlflow cost model.onnx                              (ort-cpu on a CPU box, timed on the fly)
  rlflow cost model.onnx --target sim-h100 --per-op
  rlflow cost model.onnx --costs results/costs/auto/bert.json --target ort-cpu
  rlflow cost calibrate [--out calib.json] [--remeasure]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rlflow.commands.common import add_model_arguments

NAME = "cost"
HELP = "estimate a model's runtime, flops, memory access and kernel launches with a cost model"


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--target", metavar="TARGET",
                   help="cost target: ort-cpu | torch-eager | cuda | sim-v100 | sim-a100 | sim-h100 | analytic | "
                        "auto | machine (default: cost.target of --config if given, else machine)")
    p.add_argument("--model", dest="cost_model", metavar="MODEL", help="old spelling of --target (measured = "
                   "torch-eager)")
    p.add_argument("--config", action="append", metavar="YAML",
                   help="config file(s) for cost.target, cost.warmup, cost.repeats, cost.gpus, cost.peak and device")
    p.add_argument("--out", type=Path, metavar="JSON", help="calibrate: the calibration file to write")
    p.add_argument("--remeasure", action="store_true", help="calibrate: measure again even if cached")
    p.add_argument("--costs", type=Path, metavar="CACHE.json",
                   help="measured cost cache to read (from `rlflow measure-costs`); ops it lacks are estimated")
    p.add_argument("--save-cache", type=Path, metavar="PATH",
                   help="measure the ops that are not measured yet and save every measurement to PATH")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"),
                   help="device (default: device of --config, else auto)")
    p.add_argument("--per-op", action="store_true", help="also a table per op type: count, runtime and its share")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr while measuring")


def per_op_table(graph, costs) -> dict[str, dict]:
    """op type -> nodes that run (weight-only nodes excluded), launches, runtime_ms, share of the runtime,
    flops, bytes; sorted by runtime, largest first."""
    rows: dict[str, dict] = {}
    total = 0.0
    static = _static_nodes(graph)
    for i, (n, (rt, fl, by, la)) in enumerate(zip(graph.nodes, costs)):
        if i in static:
            continue
        r = rows.setdefault(n.op_type_name(), {"count": 0, "launches": 0, "runtime_ms": 0.0, "flops": 0.0,
                                               "bytes": 0.0})
        r["count"] += 1
        r["launches"] += int(la)
        r["runtime_ms"] += rt
        r["flops"] += fl
        r["bytes"] += by
        total += rt
    for r in rows.values():
        r["share"] = r["runtime_ms"] / total if total else 0.0
    return dict(sorted(rows.items(), key=lambda kv: (-kv[1]["runtime_ms"], kv[0])))


def _static_nodes(graph) -> set[int]:
    from rlflow.graph.fold import static_nodes

    return set(static_nodes(graph))


def calibrate(args) -> int:
    """`rlflow cost calibrate`: measure (or read) each CPU backend's figures and print them."""
    from rlflow.cost import calibration

    path = args.out or calibration.default_path("cpu")
    cals = {b: calibration.load_or_measure(b, "cpu", path, remeasure=args.remeasure) for b in calibration.BACKENDS}
    if args.json:
        print(json.dumps({"path": str(path), "calibration": calibration.to_json(cals)}, indent=2))
        return 0
    print(f"calibration of {next(iter(cals.values())).hardware} ({path}):")
    for b, c in cals.items():
        print(f"  {b:<6} GEMM {c.gemm_flops_per_s / 1e9:8.1f} GFLOP/s   bandwidth {c.bandwidth_bytes_per_s / 1e9:7.2f} "
              f"GB/s   per-kernel overhead {c.kernel_overhead_s * 1e6:7.2f} us")
    return 0


def run(args) -> int:
    from rlflow.config import load_config, resolve_device
    from rlflow.cost import make_cost_model, resolve_target
    from rlflow.cost.targets import MEASURED
    from rlflow.errors import RLFlowError
    from rlflow.graph import load_onnx

    if str(args.model) == "calibrate" and not Path(args.model).exists():
        return calibrate(args)
    if args.out is not None or args.remeasure:
        raise RLFlowError("--out and --remeasure belong to `rlflow cost calibrate`")
    config = load_config(args.config)
    target = resolve_target(config, args.target or args.cost_model or (None if args.config else "machine"))
    if target not in MEASURED and (args.costs or args.save_cache) and target != "analytic":
        raise RLFlowError(f"--costs and --save-cache apply to the measured targets ({', '.join(MEASURED)}) "
                          f"and analytic (its calibration), not {target}")
    if target == "analytic" and args.save_cache:
        raise RLFlowError("--save-cache applies to the measured targets only")
    if args.costs is not None and not args.costs.is_file():
        raise RLFlowError(f"{args.costs}: no such cost cache (make one with `rlflow measure-costs`)")
    if args.save_cache is not None and args.save_cache.is_dir():
        raise RLFlowError(f"{args.save_cache}: --save-cache is a folder, expected a .json file path")
    device = resolve_device({"device": args.device or config["device"]})
    graph = load_onnx(args.model, args.input_shape)
    model = make_cost_model(config, device, args.costs, target)

    measured, seconds = 0, 0.0
    coverage = None
    if target in MEASURED:
        from rlflow.graph.exec import backend_errors, check_memory

        if target == "ort-cpu" and args.costs is None:
            _prepare_ort(model, graph)
        missing = len(model.missing([graph]))
        coverage = {"signatures": len(_signatures(model, graph)), "missing_from_cache": missing}
        if args.costs is None or args.save_cache is not None:
            check_memory(graph, str(args.model), note=True)
            t0 = time.perf_counter()
            with backend_errors(graph, "ort" if target == "ort-cpu" else "torch", what=str(args.model)):
                measured = model.measure([graph], progress=not args.no_progress and sys.stderr.isatty())
            seconds = time.perf_counter() - t0
        if args.save_cache is not None:
            from rlflow.cost.platform import record_in_cache, resolve_platform

            model.save(args.save_cache)
            record_in_cache(args.save_cache, resolve_platform(config, target))  # what every reader checks
    costs = model.node_costs(graph)
    m = model.graph_metrics(graph)
    bound = model.roofline_bound_ms(graph)
    result = {
        "model": str(args.model),
        "cost_model": model.name,
        "target": model.name,
        "label": model.label,
        "device": device,
        "hardware": getattr(model, "hardware", None),
        "peak": model.peak,
        "metrics": m.as_dict(),
        "roofline_bound_ms": bound,
    }
    if coverage is not None:
        result.update(cache=str(args.costs) if args.costs else None, measured_now=measured,
                      measure_seconds=round(seconds, 3), saved_cache=str(args.save_cache) if args.save_cache else None,
                      **coverage)
    if args.per_op:
        result["per_op"] = per_op_table(graph, costs)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0

    where = f"{model.device}, {result['hardware']}" if result["hardware"] else model.device
    if model.name.startswith("sim-"):
        where = f"{model.describe()['gpu']}, not run: spec figures"
    print(f"{args.model}: {model.label} ({model.name}; {where})")
    if coverage is not None:
        if args.costs is None:
            print(f"  measured on the fly: {measured} {_unit(model)} timed in {seconds:.1f} s "
                  f"(warmup {model.warmup}, repeats {model.repeats})"
                  + (f"; saved to {args.save_cache}" if args.save_cache else "; --save-cache PATH keeps them"))
        else:
            line = (f"  cache {args.costs}: {coverage['signatures'] - coverage['missing_from_cache']} of "
                    f"{coverage['signatures']} {_unit(model)} measured")
            if measured:
                line += f"; {measured} more timed now in {seconds:.1f} s"
            elif coverage["missing_from_cache"]:
                line += ", the rest estimated (roofline x the op type's measured ratio)"
            if args.save_cache:
                line += f"; saved to {args.save_cache}"
            print(line)
    pk = model.peak
    sim = f"   [{model.label}]" if model.name.startswith("sim-") else ""
    print(f"  runtime          {m.runtime_ms:12.3f} ms    (sum of per-kernel estimates){sim}")
    print(f"  flops            {m.flops / 1e9:12.3f} GFLOP")
    print(f"  memory access    {m.bytes / 1e6:12.1f} MB")
    print(f"  kernel launches  {int(m.launches):12d}")
    print(f"  roofline bound   {bound:12.3f} ms    (the flops at {pk['gflops']:g} GFLOP/s or the inputs, outputs "
          f"and weights read once at {pk['gbps']:g} GB/s, whichever is larger){sim}")
    if args.per_op:
        rows = result["per_op"]
        print(f"  {'op type':<22} {'count':>6} {'launches':>8} {'runtime ms':>11} {'share':>7} {'GFLOP':>9} "
              f"{'MB':>9}")
        for op, r in rows.items():
            print(f"  {op:<22} {r['count']:6d} {r['launches']:8d} {r['runtime_ms']:11.3f} "
                  f"{100 * r['share']:6.1f}% {r['flops'] / 1e9:9.3f} {r['bytes'] / 1e6:9.1f}")
        n_static = len(_static_nodes(graph))
        if n_static:
            print(f"  ({n_static} weight-only nodes are not counted: they are folded before running)")
    return 0


def _unit(model) -> str:
    return "kernel signatures" if model.name == "ort-cpu" else "op signatures"


def _prepare_ort(model, graph) -> None:
    """ort-cpu without a cache: this machine's calibration (cached per device) and the fusions of the graph."""
    from rlflow.cost.calibration import load_or_measure

    model.set_calibration(load_or_measure("ort", "cpu"))
    model.learn([graph])


def _signatures(model, graph) -> set[str]:
    """The distinct op (kernel) signatures of the graph that launch a kernel (what a measured target times)."""
    from rlflow.cost import signature

    if model.name == "ort-cpu":
        return set(model.missing([graph])) | {s for s in model.kernels if s in model.signatures(graph)}

    return {signature(n, [graph.types[v] for v in n.inputs if v])
            for n, c in zip(graph.nodes, model.node_costs(graph)) if c[3]}
