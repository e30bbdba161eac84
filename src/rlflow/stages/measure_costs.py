"""Time every op signature of a model and of graphs a few rewrites away (pipeline stage ``measure_costs``): the
cache of the measured cost model (rlflow.cost.MeasuredCost), which every stage that scores graphs reads.

The graphs measured: the model itself, every graph one rewrite away (each match of each rule applied once), and
the graphs on seeded random rewrite walks from the model totalling cost.explore_steps rewrites (each step picks a
rule uniformly among those with matches, then one of its matches uniformly; a walk restarts from the model when
no rule matches or after 50 steps). Each distinct op signature (op, attributes, input types) they contain is
timed once on the device: cost.warmup untimed runs, then the median of cost.repeats runs (CUDA events on a GPU).
Ops that read weights only (folded before running) and views (Reshape, Flatten, Identity) are not timed.

Reads these config keys: seed (the walks), device, cost.warmup, cost.repeats, cost.explore_steps and cost.peak
(the analytic figure in the summary, and the calibration of unmeasured ops).
Writes the cost cache (``--out``, JSON: format, device, hardware, warmup, repeats, peak and one entry per
signature), atomically. A progress bar goes to stderr; a summary to stdout.

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


def run(args: argparse.Namespace) -> int:
    from rlflow.cost import AnalyticCost, make_cost_model
    from rlflow.stages.common import load_problem

    if args.out.exists() and args.out.is_dir():
        raise RLFlowError(f"{args.out}: --out is a folder, expected a .json file path")
    args.costs = None
    p = load_problem(args)
    steps, seed = get(p.config, "cost.explore_steps"), get(p.config, "seed")
    cost = make_cost_model(p.config, p.device, kind="measured")  # always measured, whatever cost.model says
    print(f"measure_costs: {args.model} ({len(p.graph.nodes)} nodes), {len(p.rules)} rules, device {p.device} "
          f"({cost.hardware}), warmup {cost.warmup}, repeats {cost.repeats}, explore_steps {steps}, seed {seed}",
          flush=True)
    t0 = time.perf_counter()
    stats: dict = {}
    measured = cost.measure(explore(p.graph, p.rules, steps, seed, stats), progress=not args.no_progress)
    seconds = time.perf_counter() - t0
    cost.save(args.out)
    ms = cost.graph_metrics(p.graph)
    analytic = AnalyticCost(p.device, cost.peak).graph_metrics(p.graph)
    print(f"measure_costs: {measured} op signatures measured in {seconds:.1f} s over {1 + stats['neighbours']} "
          f"graphs (the model and its {stats['neighbours']} one-rewrite neighbours) + {stats['walk_steps']} random "
          f"rewrites in {stats['walks']} walks -> {args.out}", flush=True)
    print(f"measure_costs: model cost {ms.runtime_ms:.3f} ms measured, {analytic.runtime_ms:.3f} ms analytic "
          f"({ms.flops / 1e9:.3f} GFLOP, {ms.bytes / 1e6:.1f} MB, {int(ms.launches)} kernel launches)", flush=True)
    return 0
