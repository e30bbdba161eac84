"""Estimate a model's cost with a cost model: runtime (the sum of per-op estimates, TASO's cost), GFLOPs,
memory access (MB read and written by all ops), kernel launches, and the whole graph's roofline lower bound
(all flops at peak compute or all bytes at peak bandwidth). Ops that read weights only count nothing (they are
folded before running); views (Reshape, Flatten, Identity) launch no kernel and move no bytes.

Cost models: measured (each distinct op signature timed on the device; ops a cache lacks are estimated from the
roofline scaled by their op type's measured ratio) | analytic (roofline per op plus a launch overhead, from the
peak figures cost.peak.<device> of the config). Without --costs, the measured model times the model's ops on the
fly (cost.warmup / cost.repeats of --config; --save-cache PATH keeps them). With --costs CACHE.json it reads
the cache `rlflow measure-costs` wrote (results/costs/<device>/<model>.json).

  rlflow cost model.onnx                              (measured on the fly)
  rlflow cost model.onnx --costs results/costs/auto/bert.json --per-op
  rlflow cost model.onnx --model analytic --config config.yaml --json
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
    p.add_argument("--model", dest="cost_model", metavar="MODEL",
                   help="cost model: measured | analytic (default: cost.model of --config, else measured)")
    p.add_argument("--config", action="append", metavar="YAML",
                   help="config file(s) for cost.model, cost.warmup, cost.repeats, cost.peak and device")
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


def run(args) -> int:
    from rlflow.config import get, load_config, resolve_device
    from rlflow.cost import MeasuredCost, make_cost_model
    from rlflow.errors import RLFlowError
    from rlflow.graph import load_onnx

    config = load_config(args.config)
    kind = args.cost_model or get(config, "cost.model")
    if kind not in ("measured", "analytic"):
        raise RLFlowError(f"unknown cost model '{kind}' (choose from measured, analytic)")
    if kind == "analytic" and (args.costs or args.save_cache):
        raise RLFlowError("--costs and --save-cache apply to the measured cost model only")
    if args.costs is not None and not args.costs.is_file():
        raise RLFlowError(f"{args.costs}: no such cost cache (make one with `rlflow measure-costs`)")
    if args.save_cache is not None and args.save_cache.is_dir():
        raise RLFlowError(f"{args.save_cache}: --save-cache is a folder, expected a .json file path")
    device = resolve_device({"device": args.device or config["device"]})
    graph = load_onnx(args.model, args.input_shape)
    model = make_cost_model(config, device, args.costs, kind)

    measured, seconds = 0, 0.0
    coverage = None
    if isinstance(model, MeasuredCost):
        missing = len(model.missing([graph]))
        coverage = {"signatures": len(_signatures(model, graph)), "missing_from_cache": missing}
        if args.costs is None or args.save_cache is not None:
            from rlflow.graph.exec import backend_errors, check_memory

            check_memory(graph, str(args.model), note=True)
            t0 = time.perf_counter()
            with backend_errors(graph, "torch", what=str(args.model)):
                measured = model.measure([graph], progress=not args.no_progress and sys.stderr.isatty())
            seconds = time.perf_counter() - t0
        if args.save_cache is not None:
            model.save(args.save_cache)
    costs = model.node_costs(graph)
    m = model.graph_metrics(graph)
    bound = model.roofline_bound_ms(m)
    result = {
        "model": str(args.model),
        "cost_model": model.name,
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

    where = f"{device}, {result['hardware']}" if result["hardware"] else device
    print(f"{args.model}: {model.name} cost model ({where})")
    if coverage is not None:
        if args.costs is None:
            print(f"  measured on the fly: {measured} op signatures timed in {seconds:.1f} s "
                  f"(warmup {model.warmup}, repeats {model.repeats})"
                  + (f"; saved to {args.save_cache}" if args.save_cache else "; --save-cache PATH keeps them"))
        else:
            line = (f"  cache {args.costs}: {coverage['signatures'] - coverage['missing_from_cache']} of "
                    f"{coverage['signatures']} op signatures measured")
            if measured:
                line += f"; {measured} more timed now in {seconds:.1f} s"
            elif coverage["missing_from_cache"]:
                line += ", the rest estimated (roofline x the op type's measured ratio)"
            if args.save_cache:
                line += f"; saved to {args.save_cache}"
            print(line)
    pk = model.peak
    print(f"  runtime          {m.runtime_ms:12.3f} ms    (sum of per-op estimates)")
    print(f"  flops            {m.flops / 1e9:12.3f} GFLOP")
    print(f"  memory access    {m.bytes / 1e6:12.1f} MB")
    print(f"  kernel launches  {int(m.launches):12d}")
    print(f"  roofline bound   {bound:12.3f} ms    (all flops at {pk['gflops']:g} GFLOP/s or all bytes at "
          f"{pk['gbps']:g} GB/s, no launches)")
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


def _signatures(model, graph) -> set[str]:
    """The distinct op signatures of the graph that launch a kernel (what a measured model times)."""
    from rlflow.cost import signature

    return {signature(n, [graph.types[v] for v in n.inputs if v])
            for n, c in zip(graph.nodes, model.node_costs(graph)) if c[3]}
