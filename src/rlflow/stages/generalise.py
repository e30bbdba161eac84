"""Do the trained agents generalise? Zero-shot runs on other input shapes (pipeline stage ``generalise``).

X-RLflow's claim: an agent trained once on a model optimises other input shapes of that model with no further
training. Each agent of the model -- ``model_free`` (train_model_free's model_free.pt) and ``rlflow`` (the
controller of train_controller) -- optimises, with no training on it, the model's own graph (the shape it was
trained on) and every variant of ``generalise.variants.<model>``: the zoo model exported with some sizes
changed (``seq=64``, ``batch=8``), or another zoo model (``vit:image=224``; the agent's action space is the rule
set, so it runs on any graph). Beside the agents, greedy search on the same graph and cost target. For each
agent and graph: its improvement of the cost-target runtime and ``kept`` = improvement(variant) /
improvement(trained shape) (issue K's goal: >= 0.9 at bert seq 64 and 256).

Every agent's zero-shot graph is checked equal to its original under onnxruntime (``evaluate.tolerance``): the
stage fails, naming the graph, if one differs.

The trained shape's row comes from the agents' own stages when their traces are given (``--model-free-trace``,
``--rlflow-trace``, and ``--greedy-trace`` for greedy; the pipeline passes all three): those stages optimise the
model with the same :meth:`~rlflow.agents.checkpoint.Agent.optimise` and check the graph, so running them again
here would give the same figures. Without them the trained shape is scored here too. The variants are scored in
parallel, at most ``cores`` of the stage's registry entry (2) at once, on the CPU.

Reads: seed, device, cost.*, export.opset, export.exporter, zoo (the sizes of every model a variant names),
generalise.variants.<model>, evaluate.tolerance; the traces, when given. Writes ``--out`` (JSON
``rlflow.generalise/1``), atomically. The same rows are printed by ``benchmarks/generalise.py`` for any
checkpoint. The code that runs and scores the agents: :mod:`rlflow.agents.zero_shot`.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from rlflow.config import get
from rlflow.errors import RLFlowError

HELP = ("run the trained agents zero-shot on other input shapes of their model (pipeline stage generalise); the "
        "shape they trained on is read from their stages' traces when given")
SET_EXAMPLE = "generalise.variants.bert=[seq=64,seq=256]"

FORMAT = "rlflow.generalise/1"


#: the smallest graph whose variants are scored in parallel processes: a worker starts a fresh interpreter, whose
#: imports (torch and the rest) take 5-10 s on a 2-core CPU, longer than a small graph's variant takes to score here
#: (tiny bert, 72 nodes, 2 variants: the stage took 37 s with two workers, 20 s without)
PARALLEL_MIN_NODES = 200


def run(args: argparse.Namespace) -> int:
    from rlflow.agents.checkpoint import load_agent
    from rlflow.atomic import write_text
    from rlflow.cost.targets import resolve_target
    from rlflow.agents.zero_shot import parse_variant, trained_row, variant_label, zero_shot
    from rlflow.evaluation.traces import load_trace
    from rlflow.pipeline.registry import stage
    from rlflow.stages.common import load_problem

    if args.out.is_dir():
        raise RLFlowError(f"{args.out}: is a folder, expected a file path")
    traces = {"model_free": args.model_free_trace, "rlflow": args.rlflow_trace}
    given = [p is not None for p in (*traces.values(), args.greedy_trace)]
    if any(given) and not all(given):
        raise RLFlowError("generalise: give all three traces (--model-free-trace, --rlflow-trace, --greedy-trace) "
                          "or none")
    problem = load_problem(args)
    config = problem.config
    variants = [parse_variant(v, args.model) for v in (get(config, "generalise.variants") or {}).get(args.model, [])]
    agents = {}
    for method, path in (("model_free", args.model_free), ("rlflow", args.controller)):
        agents[method] = load_agent(path, problem.device)
        agents[method].check_rules(problem.rules, str(args.rules))
    trained = None
    if all(given):
        trained = trained_row(problem.graph, problem.cost, {m: load_trace(p) for m, p in traces.items()},
                              load_trace(args.greedy_trace))
    workers = max(1, min(stage("generalise").cores, os.cpu_count() or 1))
    if len(problem.graph.nodes) < PARALLEL_MIN_NODES:
        workers = 1
    t0 = time.perf_counter()
    print(f"generalise: {args.model}: {len(variants)} variant(s), agents {', '.join(agents)}, cost target "
          f"{resolve_target(config)} ({problem.cost.label}); the trained shape "
          f"{'read from the agent stages' if trained else 'scored here'}, at most {workers} variant(s) at once",
          flush=True)
    rows = zero_shot(agents, args.model, problem.graph, variants, problem.rules, problem.cost, config,
                     device=problem.device, log=lambda line: print(f"generalise: {line}", flush=True),
                     trained=trained, workers=workers)
    doc = {"format": FORMAT, "model": args.model, "cost_target": resolve_target(config), "cost_label": problem.cost.label,
           "variants": [variant_label(n, o, args.model) for n, o in variants], "rows": rows,
           "seconds": time.perf_counter() - t0}
    write_text(args.out, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    print(f"generalise: wrote {args.out} ({doc['seconds']:.1f} s)", flush=True)
    return 0
