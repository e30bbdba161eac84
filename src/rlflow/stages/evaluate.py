"""Evaluate end to end (pipeline stage ``evaluate``): the original model and every method's optimised graph on
every configured backend -- latency, memory, the cost model's estimate, the method's effort, output check.

For each graph (original, its A/A control "original-aa" = the original exported and imported again through the
IR, taso, greedy, eqsat, eqsat_rl, model_free, rlflow) and backend (evaluate.backends: ort, torch, tf, tf-xla) on
the configured device: build the runner, run it once on the same seeded random inputs and compare its outputs with the ORIGINAL
graph run by onnxruntime; then, one backend at a time, the measurement protocol (rlflow.evaluation.protocol,
config section timing): every graph in timing.sessions freshly built runners, timed interleaved in rounds of
random order within timing.budget_s for every two graphs compared (nine graphs: 4.5 times timing.budget_s, so
each ratio rests on as many rounds as a never-slower check's); per graph the latency ratio to the original with its 95%
interval (paired by round; Student's t over the sessions) and a verdict (faster / slower / no detectable
difference). When the A/A control's interval excludes 1.0 the backend is marked too noisy: its verdicts are no
findings. Methods that found the same graph share one estimate (a method that kept the original shares the A/A
control's: it is that comparison); when the runners would not fit in half the
available memory (paper-size models on TensorFlow), the methods are compared in several groups with the original.
A progress bar over the backends goes to stderr; a line per backend and the table to stdout.

Wrong results are never reported: if any optimised graph's outputs differ from the original's by more than
evaluate.tolerance (relative; rlflow.graph.exec.max_rel_diff) on any backend, the stage stops with one line naming
the method, backend and difference, exit status 1, and writes nothing. A backend known from the graph alone to
have no lowering for one of its ops (an op without a TF lowering; tf-xla and an opaque op) is reported in one line
naming the op; its row is kept with status ``unsupported`` (no latency) and the other runs go on. A backend that
raises while building or running a graph stops the stage with one line naming the method, backend and cause, exit
status 2, nothing written (a crash is never a row). Bad input (a missing or corrupt ONNX file or trace, an optimised graph whose inputs differ
from the original's) is one line and exit status 2, nothing written.

The roofline (rlflow.evaluation.roofline): each graph's lower bound at the device's calibrated GEMM rate and
bandwidth, from the cost cache's calibration (--costs, the measure_costs stage's output) or else the per-device
calibration cache (measured there first, a few seconds); on a GPU none.

Reads these config keys: seed (the inputs and the protocol's random orders), device, cost.target (the platform:
its backend is the primary one, added to evaluate.backends if missing; recorded in metrics and headline), timing.*,
evaluate.backends, evaluate.tolerance. Each method needs its optimised ONNX and its trace (rlflow.search-trace/2;
the cost estimate, rules applied, optimisation seconds, and for the RL methods training seconds and real interactions);
methods not given are left out. Writes, atomically and only once everything has run:
  --out       evaluation.csv: one row per (method, backend); columns in rlflow.evaluation.tables.COLUMNS
              (same_as_original: the method's graph is the original's, so its figures are the A/A control's)
  --metrics   metrics.json (DVC): latency, ratio to the original with interval and verdict per method and
              backend, the A/A control's noise flag, improvement vs TensorFlow (RLFlow's Table 2: original and
              method both on tf, with the interval), max output difference
  --headline  summary/<model>.json: the model's row of the cross-model summary
(their contents are documented in rlflow.evaluation.tables).

Examples:
  rlflow evaluate --model bert --onnx m.onnx --greedy g.onnx --greedy-trace g.json --set evaluate.backends=[ort] \\
      --set timing.budget_s=3 --out /tmp/e.csv --metrics /tmp/m.json --headline /tmp/h.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlflow.config import get, load_config, resolve_device
from rlflow.errors import RLFlowError
from rlflow.pipeline.registry import METHODS

HELP = ("compare the original, its A/A control and every method's graph on every backend: latency ratio with interval "
        "and verdict, memory, output check (stage evaluate)")
SET_EXAMPLE = "timing.budget_s=5"


def _flag(method: str) -> str:
    return "--" + method.replace("_", "-")


def run(args: argparse.Namespace) -> int:
    from rlflow.atomic import write_text
    from rlflow.evaluation import (activation_memory_bytes, evaluate_graphs, headline, load_trace, make_rows,
                                   metrics, to_csv)
    from rlflow.evaluation.roofline import bound_ms, device_limits
    from rlflow.evaluation.tables import summary_lines
    from rlflow.graph.onnx_io import load_onnx

    t0 = time.perf_counter()
    config = load_config(args.config, args.overrides)
    device = resolve_device(config)
    from rlflow.cost.platform import check_cache, resolve_platform
    from rlflow.evaluation.protocol import Protocol

    seed, protocol = get(config, "seed"), Protocol.from_config(config)
    backends, tolerance = list(get(config, "evaluate.backends")), float(get(config, "evaluate.tolerance"))
    platform = resolve_platform(config)
    # the primary backend verifies the run's target (its verdicts answer "is it faster where it was optimised for");
    # a target this machine cannot verify has none: every backend's verdict is a finding about this machine
    primary = platform.backend if platform.verifiable else None
    if primary is not None and primary not in backends:
        backends.insert(0, primary)
    if args.costs is not None:
        check_cache(args.costs, platform)
    for p in (args.out, args.metrics, args.headline):
        if p.is_dir():
            raise RLFlowError(f"{p}: is a folder, expected a file path")
    methods = []
    for m in METHODS:
        onnx_path, trace_path = getattr(args, m), getattr(args, f"{m}_trace")
        if (onnx_path is None) != (trace_path is None):
            raise RLFlowError(f"{m}: give both {_flag(m)} ONNX and {_flag(m)}-trace JSON, or neither")
        if onnx_path is not None:
            methods.append((m, onnx_path, trace_path))

    # -- load every input before running anything (bad input: one line, exit 2, nothing written)
    loaded: dict[Path, object] = {}

    def load(path: Path):
        key = path.resolve()
        if key not in loaded:
            loaded[key] = load_onnx(path)
        return loaded[key]

    original = load(args.onnx)
    graphs, traces = [("original", original)], {}
    for m, onnx_path, trace_path in methods:
        traces[m] = load_trace(trace_path)
        graphs.append((m, load(onnx_path)))
    print(f"evaluate: {args.model} on {device}: {len(graphs)} graphs ({', '.join(m for m, _ in graphs)}) x "
          f"{len(backends)} backends ({', '.join(backends)}), plus the A/A control; "
          f"{protocol.describe('two graphs compared; n graphs timed together get n/2 times as long')}; "
          f"tolerance {tolerance:g}; loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"evaluate: platform {platform.describe()}; primary backend "
          f"{primary or 'none (every backend is a finding about this machine)'}", flush=True)
    differ = [f"{m} {int(traces[m].final['nodes'])} -> {len(g.nodes)}" for m, g in graphs[1:]
              if int(traces[m].final["nodes"]) != len(g.nodes)]
    if differ:
        print("evaluate: note: nodes in the trace (the IR the method scored) -> in its ONNX file (what runs; fused "
              "ops export as several ONNX ops): " + ", ".join(differ) + "; the table reports the file's", flush=True)

    # -- run, check, time
    measurements = evaluate_graphs(graphs, backends, device, protocol, seed=seed, tolerance=tolerance,
                                   progress=not args.no_progress,
                                   log=lambda line: print(line, flush=True))
    limits = device_limits(device, args.costs)
    bounds = {m: bound_ms(g, limits) for m, g in graphs} if limits else {}
    if limits:
        print(f"evaluate: roofline at GEMM {limits.gemm_flops_per_s / 1e9:.1f} GFLOP/s, bandwidth "
              f"{limits.bandwidth_bytes_per_s / 1e9:.1f} GB/s ({limits.source}): the original's lower bound "
              f"{bounds['original']:.3g} ms", flush=True)
    original_hash = original.structural_hash()
    same = {m: g.structural_hash() == original_hash for m, g in graphs[1:]}  # its figures are the A/A control's
    rows = make_rows(args.model, device, measurements, nodes={m: len(g.nodes) for m, g in graphs},
                     activation_bytes={m: activation_memory_bytes(g) for m, g in graphs}, traces=traces,
                     bounds=bounds, same=same)
    table = to_csv(rows)
    dvc_metrics = json.dumps({**metrics(rows, limits.as_dict() if limits else None), "platform": platform.as_dict(),
                              "primary_backend": primary}, indent=1, allow_nan=False) + "\n"
    platforms = {m: t.platform for m, t in traces.items()}
    head_doc = headline(args.model, device, backends, tolerance, rows, traces, platforms)
    head_doc.update(platform=platform.as_dict(), primary_backend=primary)  # the run's, resolved (never auto)
    head = json.dumps(head_doc, indent=1, allow_nan=False) + "\n"
    for line in summary_lines(rows, backends):
        print("evaluate: " + line)
    # -- write (each file atomically; all three only after everything ran)
    write_text(args.out, table)
    write_text(args.metrics, dvc_metrics)
    write_text(args.headline, head)
    print(f"evaluate: wrote {args.out}, {args.metrics} and {args.headline} ({time.perf_counter() - t0:.1f} s in all)",
          flush=True)
    return 0
