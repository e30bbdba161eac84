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

Reads: seed, device, cost.*, export.opset, export.exporter, zoo (the sizes of every model a variant names),
generalise.variants.<model>, evaluate.tolerance. Writes ``--out`` (JSON ``rlflow.generalise/1``), atomically. The same rows are
printed by ``benchmarks/generalise.py`` for any checkpoint.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Callable

from rlflow.config import get
from rlflow.errors import RLFlowError

HELP = "run the trained agents zero-shot on other input shapes of their model (pipeline stage generalise)"
SET_EXAMPLE = "generalise.variants.bert=[seq=64,seq=256]"

FORMAT = "rlflow.generalise/1"
_VARIANT = re.compile(r"(?:(?P<model>[a-z0-9-]+):)?(?P<sizes>[a-z_]+=\d+(?:,[a-z_]+=\d+)*)")


def parse_variant(text: str, model: str) -> tuple[str, dict[str, int]]:
    """``seq=64`` or ``seq=64,batch=8`` (the agent's model) or ``vit:image=224`` (another zoo model) ->
    (model, size overrides)."""
    m = _VARIANT.fullmatch(text.strip())
    if not m:
        raise RLFlowError(f"generalise variant {text!r}: expected [MODEL:]KEY=INT[,KEY=INT] (e.g. seq=64)")
    sizes = dict(part.split("=") for part in m["sizes"].split(","))
    return m["model"] or model, {k: int(v) for k, v in sizes.items()}


def variant_label(name: str, overrides: dict[str, int], model: str) -> str:
    if not overrides:
        return f"{name} (trained)" if name == model else f"{name} (other model)"
    return f"{name} " + ",".join(f"{k}={v}" for k, v in overrides.items())


def improvement_pct(result) -> float:
    """A search result's improvement of the cost-target runtime, in percent of the initial runtime."""
    a, b = result.initial.runtime_ms, result.final.runtime_ms
    return (a - b) / a * 100 if a else 0.0


def score_graph(agents: dict, g, rules, cost, config: dict, base: dict[str, float] | None = None,
                device: str = "cpu", taso: bool = False, label: str = "the graph") -> dict:
    """Each agent's zero-shot run on graph ``g`` (its improvement, and ``kept`` = improvement / ``base[method]``,
    the improvement on the shape it was trained on; None without a positive base) beside greedy's improvement
    (and TASO's with ``taso``), and ``vs_greedy`` = the agent's improvement / greedy's on ``g`` (a shape's own
    potential changes ``kept`` too: greedy's improvement on bert shrinks from seq 128 to 256). Every agent's best graph is checked equal to ``g`` under onnxruntime
    (``evaluate.tolerance``; a difference is a one-line RLFlowError): its ``max_rel_diff`` is in the row."""
    from rlflow.graph.exec.check import check_equal
    from rlflow.search import greedy_search, taso_search

    row = {"nodes": len(g.nodes), "agents": {}}
    for method, agent in agents.items():
        t0 = time.perf_counter()
        result, _ = agent.optimise(g, rules, cost, device=device)
        seconds = time.perf_counter() - t0
        try:
            diff = check_equal(g, result.graph, seed=get(config, "seed"), tol=get(config, "evaluate.tolerance"),
                               device=device, what=label)
        except RLFlowError as e:
            raise RLFlowError(f"{label}: {method}'s zero-shot graph: {e}") from None
        pct = improvement_pct(result)
        b = (base or {}).get(method)
        row["initial_ms"] = result.initial.runtime_ms
        row["agents"][method] = {"improvement_pct": pct, "kept": pct / b if b and b > 0 else None,
                                 "final_ms": result.final.runtime_ms, "max_rel_diff": diff, "seconds": seconds,
                                 "real_steps": result.expansions}
    row["greedy_pct"] = improvement_pct(greedy_search(g, rules, cost))
    for a in row["agents"].values():  # how much of what greedy finds on this very graph: apart from the shape
        a["vs_greedy"] = a["improvement_pct"] / row["greedy_pct"] if row["greedy_pct"] > 0 else None
    if taso:
        row["taso_pct"] = improvement_pct(taso_search(g, rules, cost, alpha=get(config, "search.alpha"),
                                                      budget=get(config, "search.budget")))
    return row


def row_line(label: str, row: dict) -> str:
    """One terminal line of a :func:`score_graph` row."""
    num = lambda x: "n/a" if x is None else format(x, ".2f")  # noqa: E731
    return (f"{label}: {row['nodes']} nodes; "
            + ", ".join(f"{m} {a['improvement_pct']:+.3f}% (kept {num(a['kept'])}, {num(a['vs_greedy'])} x greedy's)"
                        for m, a in row["agents"].items())
            + f"; greedy {row['greedy_pct']:+.3f}%" + (f"; taso {row['taso_pct']:+.3f}%" if "taso_pct" in row else ""))


def zero_shot(agents: dict, model: str, graph, variants: list[tuple[str, dict[str, int]]], rules, cost,
              config: dict, device: str = "cpu", taso: bool = False,
              log: Callable[[str], None] = print) -> list[dict]:
    """One row per graph -- ``graph`` (the shape the agents were trained on) first, then each variant exported
    with its sizes over the config's ``zoo.<name>`` -- from :func:`score_graph`: each agent's improvement and
    ``kept``, greedy's (and TASO's with ``taso``). ``agents``: method -> :class:`rlflow.agents.checkpoint.Agent`."""
    from rlflow.graph import load_onnx, zoo

    rows: list[dict] = []
    base: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate([(model, {})] + list(variants)):
            label = variant_label(name, overrides, model)
            if i == 0:
                g = graph
            else:
                sizes = {**get(config, f"zoo.{name}"), **overrides}
                path = Path(tmp) / f"variant-{i}.onnx"
                try:
                    zoo.export_model(name, path, sizes, opset=get(config, "export.opset"),
                                     exporter=get(config, "export.exporter"), seed=get(config, "seed"))
                except (ValueError, RLFlowError) as e:
                    raise RLFlowError(f"generalise variant {label}: cannot export with these sizes: {e}") from None
                g = load_onnx(path)
            row = {"graph": label, "model": name, "sizes": overrides, "trained": i == 0,
                   **score_graph(agents, g, rules, cost, config, base if i else None, device, taso, label)}
            if i == 0:
                base = {m: a["improvement_pct"] for m, a in row["agents"].items()}
                for a in row["agents"].values():
                    a["kept"] = 1.0 if a["improvement_pct"] > 0 else None
            rows.append(row)
            log(row_line(label, row))
    return rows


def run(args: argparse.Namespace) -> int:
    from rlflow.agents.checkpoint import load_agent
    from rlflow.atomic import write_text
    from rlflow.cost.targets import resolve_target
    from rlflow.stages.common import load_problem

    if args.out.is_dir():
        raise RLFlowError(f"{args.out}: is a folder, expected a file path")
    problem = load_problem(args)
    config = problem.config
    variants = [parse_variant(v, args.model) for v in (get(config, "generalise.variants") or {}).get(args.model, [])]
    agents = {}
    for method, path in (("model_free", args.model_free), ("rlflow", args.controller)):
        agents[method] = load_agent(path, problem.device)
        agents[method].check_rules(problem.rules, str(args.rules))
    t0 = time.perf_counter()
    print(f"generalise: {args.model}: {len(variants)} variant(s), agents {', '.join(agents)}, cost target "
          f"{resolve_target(config)} ({problem.cost.label})", flush=True)
    rows = zero_shot(agents, args.model, problem.graph, variants, problem.rules, problem.cost, config,
                     device=problem.device, log=lambda line: print(f"generalise: {line}", flush=True))
    doc = {"format": FORMAT, "model": args.model, "cost_target": resolve_target(config), "cost_label": problem.cost.label,
           "variants": [variant_label(n, o, args.model) for n, o in variants], "rows": rows,
           "seconds": time.perf_counter() - t0}
    write_text(args.out, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    print(f"generalise: wrote {args.out} ({doc['seconds']:.1f} s)", flush=True)
    return 0
