"""Calibrate the device and, for a measured cost target, time every op or kernel signature of a model and of
graphs a few rewrites away (pipeline stage ``measure_costs``): the cost cache every stage that scores graphs reads.

Always: the device calibration of each CPU backend (rlflow.cost.calibration: sustained GEMM rate, bandwidth,
per-kernel overhead; a few seconds), kept in the cache's ``calibration`` section. Then, by ``cost.target``:
sim-v100/a100/h100 and analytic need nothing more (cheap); torch-eager and cuda time op signatures as below;
ort-cpu first learns onnxruntime's fusions from its optimised models of the model and of one-rewrite neighbours
(one per rule, ``cost.learn_graphs`` graphs in all), then times each kernel signature of the graphs below.

The graphs measured: the model itself, every graph one rewrite away (each match of each rule applied once), and
the graphs on seeded random rewrite walks from the model totalling cost.explore_steps rewrites (each step picks a
rule uniformly among those with matches, then one of its matches uniformly; a walk restarts from the model when
no rule matches or after 50 steps). Each distinct op signature (op, attributes, input types) they contain is
timed once on the device: cost.warmup untimed runs, then the median of cost.repeats runs (CUDA events on a GPU).
Ops that read weights only (folded before running) and views (Reshape, Flatten, Identity) are not timed.

Reads these config keys: seed (the walks), device, cost.target, cost.learn_graphs, cost.warmup, cost.repeats,
cost.explore_steps and cost.peak (fallback figures).
Writes the cost cache (``--out``, JSON: format, device, hardware, the resolved platform (rlflow.cost.platform:
target, label, device, backend, verifiable; every stage that reads the cache refuses it when its own platform
differs, e.g. a cache made on a CPU box read on a GPU box), warmup, repeats, peak and one entry per signature),
atomically. A progress bar goes to stderr; a summary to stdout.

Config: --config may be given several times; later files are deep-merged over earlier ones, then every
--set KEY=VALUE applies (VALUE is YAML or JSON). Without --config the schema defaults apply.

Examples:
  rlflow measure-costs --model bert --onnx bert.onnx --rules rules.json --out /tmp/bert-costs.json \\
      --set cost.explore_steps=0 --set cost.repeats=8
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Iterator, Sequence

from rlflow.config import get
from rlflow.errors import RLFlowError

HELP = "time every op signature of a model and its rewrites: the measured cost cache (pipeline stage measure_costs)"
SET_EXAMPLE = "cost.explore_steps=50"

#: a random walk restarts from the model after this many rewrites
WALK_LENGTH = 50


def explore(graph, rules: Sequence, steps: int, seed: int, stats: dict | None = None) -> Iterator:
    """The graphs to measure, lazily: ``graph``, each graph one rewrite away, then the graphs along seeded random
    rewrite walks totalling ``steps`` rewrites. ``stats`` (if given) receives the counts."""
    from rlflow.rewrite.matcher import MatchIndex, apply

    stats = stats if stats is not None else {}
    stats.update(neighbours=0, walk_steps=0, walks=0)
    root = MatchIndex(graph, rules)
    yield graph
    for matches in root.matches:
        for m in matches:
            stats["neighbours"] += 1
            yield apply(graph, m)
    if not any(root.counts()):
        return
    rng = random.Random(seed)
    cur, length = root, 0
    stats["walks"] = 1
    while stats["walk_steps"] < steps:
        ks = [k for k, c in enumerate(cur.counts()) if c]
        if not ks or length >= WALK_LENGTH:
            cur, length = root, 0
            stats["walks"] += 1
            continue
        k = rng.choice(ks)
        cur = cur.apply(k, rng.randrange(len(cur.matches[k])))
        length += 1
        stats["walk_steps"] += 1
        yield cur.graph


def learning_graphs(graph, rules: Sequence, count: int) -> list:
    """The model and one-rewrite neighbours, one per rule with a match (in rule order): ``count`` graphs at most."""
    from rlflow.rewrite.matcher import MatchIndex, apply

    out = [graph]
    for matches in MatchIndex(graph, rules).matches:
        if len(out) >= count:
            break
        if matches:
            out.append(apply(graph, matches[0]))
    return out


def run(args: argparse.Namespace) -> int:
    from rlflow.cost import AnalyticCost, calibration, make_cost_model, resolve_target
    from rlflow.cost.model import write_cache
    from rlflow.cost.platform import resolve_platform
    from rlflow.cost.targets import MEASURED
    from rlflow.stages.common import load_problem

    if args.out.exists() and args.out.is_dir():
        raise RLFlowError(f"{args.out}: --out is a folder, expected a .json file path")
    args.costs = None
    p = load_problem(args)
    target = resolve_target(p.config)
    steps, seed = get(p.config, "cost.explore_steps"), get(p.config, "seed")
    t0 = time.perf_counter()
    cals = {b: calibration.measure(b, "cpu") for b in calibration.BACKENDS}
    for b, c in cals.items():
        print(f"measure_costs: calibration {b}: GEMM {c.gemm_flops_per_s / 1e9:.1f} GFLOP/s, bandwidth "
              f"{c.bandwidth_bytes_per_s / 1e9:.2f} GB/s, per-kernel overhead {c.kernel_overhead_s * 1e6:.2f} us "
              f"({c.hardware})", flush=True)
    from rlflow.cost.model import describe_hardware

    platform = resolve_platform(p.config)
    print(f"measure_costs: platform {platform.describe()}", flush=True)
    # the device the cost model reads the cache on (rlflow.cost.targets.make_cost_model): the GPU for the cuda
    # target, the run's device for analytic (cuda on a GPU box), else the CPU
    device = platform.device if target in ("cuda", "analytic") else "cpu"
    header = {"device": device, "hardware": describe_hardware(device),
              "target": target, "platform": platform.as_dict(), "calibration": calibration.to_json(cals)}
    if target not in MEASURED:
        write_cache(args.out, {**header, "ops": {}, "kernels": {}, "fusion": {}})
        cost = make_cost_model(p.config, p.device, args.out, target)
        ms = cost.graph_metrics(p.graph)
        print(f"measure_costs: target {target} ({cost.label}) times nothing; calibration in "
              f"{time.perf_counter() - t0:.1f} s -> {args.out}", flush=True)
        print(f"measure_costs: model cost {ms.runtime_ms:.3f} ms [{cost.label}] ({ms.flops / 1e9:.3f} GFLOP, "
              f"{ms.bytes / 1e6:.1f} MB, {int(ms.launches)} kernel launches)", flush=True)
        return 0
    cost = make_cost_model(p.config, p.device, kind=target)
    if target == "ort-cpu":
        cost.set_calibration(cals["ort"])
        learned = cost.learn(learning_graphs(p.graph, p.rules, get(p.config, "cost.learn_graphs")))
        print(f"measure_costs: onnxruntime's fusions learned from {learned} graphs: "
              f"{', '.join(sorted('>'.join(k) for k in cost.fusable)) or 'none'}", flush=True)
    print(f"measure_costs: {args.model} ({len(p.graph.nodes)} nodes), {len(p.rules)} rules, target {target} "
          f"({cost.label}; {cost.hardware}), warmup {cost.warmup}, repeats {cost.repeats}, explore_steps {steps}, "
          f"seed {seed}", flush=True)
    stats: dict = {}
    measured = cost.measure(explore(p.graph, p.rules, steps, seed, stats), progress=not args.no_progress)
    seconds = time.perf_counter() - t0
    write_cache(args.out, header)
    cost.save(args.out)
    ms = cost.graph_metrics(p.graph)
    analytic = AnalyticCost("cpu", cals["ort"].as_peak()).graph_metrics(p.graph)
    print(f"measure_costs: {measured} {'kernel' if target == 'ort-cpu' else 'op'} signatures measured in "
          f"{seconds:.1f} s over {1 + stats['neighbours']} graphs (the model and its {stats['neighbours']} "
          f"one-rewrite neighbours) + {stats['walk_steps']} random rewrites in {stats['walks']} walks -> {args.out}",
          flush=True)
    print(f"measure_costs: model cost {ms.runtime_ms:.3f} ms {target}, {analytic.runtime_ms:.3f} ms analytic "
          f"({ms.flops / 1e9:.3f} GFLOP, {ms.bytes / 1e6:.1f} MB, {int(ms.launches)} kernel launches)", flush=True)
    return 0
