"""Agents run zero-shot (no training) on graphs they were not trained on: other input shapes of their model, other
models (X-RLflow's claim; issue K). :func:`score_graph` scores agents on one graph beside greedy (and TASO), with
every agent graph checked equal to its original; :func:`zero_shot` does it for a model and its variants (stage
``generalise``, ``benchmarks/generalise.py``); the multi-model agent's stage scores its models with it too.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path
from typing import Callable

from rlflow.config import get
from rlflow.errors import RLFlowError

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


def trained_row(graph, cost, agent_traces: dict, greedy_trace) -> dict:
    """The :func:`score_graph` row of the shape the agents were trained on, read from their stages' own runs
    instead of running them again: each agent stage optimises the model with the same
    :meth:`rlflow.agents.checkpoint.Agent.optimise` and checks its graph against the original, and search_greedy
    runs greedy on it. ``agent_traces``: method -> :class:`rlflow.evaluation.traces.TraceSummary`; the figures are
    the graph each found (``searched``), before the never-slower check. Every trace must start from ``graph``
    under ``cost`` (its initial cost and node count): otherwise a one-line RLFlowError naming it."""
    initial = cost.graph_metrics(graph)
    for t in [*agent_traces.values(), greedy_trace]:
        ms = t.initial["runtime_ms"]
        if t.initial["nodes"] != len(graph.nodes) or abs(ms - initial.runtime_ms) > 1e-9 * max(abs(ms), 1.0):
            raise RLFlowError(f"{t.path}: its graph starts at {int(t.initial['nodes'])} nodes and {ms:.6g} ms, the "
                              f"model here at {len(graph.nodes)} nodes and {initial.runtime_ms:.6g} ms: the trace "
                              f"was made with another model or cost model")
    pct = lambda t: (t.initial["runtime_ms"] - t.searched["runtime_ms"]) / t.initial["runtime_ms"] * 100  # noqa: E731
    row = {"nodes": len(graph.nodes), "initial_ms": initial.runtime_ms, "agents": {}, "greedy_pct": pct(greedy_trace),
           "from_traces": True}
    for method, t in agent_traces.items():
        p = pct(t)
        row["agents"][method] = {"improvement_pct": p, "kept": 1.0 if p > 0 else None,
                                 "final_ms": t.searched["runtime_ms"], "max_rel_diff": t.max_rel_diff,
                                 "seconds": t.optimisation_s, "real_steps": t.expansions,
                                 "vs_greedy": p / row["greedy_pct"] if row["greedy_pct"] > 0 else None}
    return row


#: what :func:`_score_variant` works with: set by :func:`zero_shot`, and in each of its worker processes by
#: :func:`_start_worker`
_JOB: dict = {}


def _start_worker(job: dict) -> None:
    """A worker process of :func:`zero_shot` (spawned: a forked one can inherit a lock another thread holds) gets
    the job once: agents, rules, cost model and config, pickled. One torch thread, whatever OMP_NUM_THREADS says:
    Snakemake sets it to the job's cores (2), and two workers with two threads each on two cores ran the agents
    4x slower (86 s instead of 20 s per bert variant)."""
    import torch

    torch.set_num_threads(1)
    _JOB.update(job)


def _score_variant(i: int) -> tuple[dict, str]:
    """Export variant ``i`` of ``_JOB`` (1-based: 0 is the trained shape) and score it: (row, its log line)."""
    from rlflow.graph import load_onnx, zoo

    j = _JOB
    name, overrides = j["variants"][i - 1]
    label = variant_label(name, overrides, j["model"])
    config = j["config"]
    sizes = {**get(config, f"zoo.{name}"), **overrides}
    path = Path(j["tmp"]) / f"variant-{i}.onnx"
    try:
        zoo.export_model(name, path, sizes, opset=get(config, "export.opset"),
                         exporter=get(config, "export.exporter"), seed=get(config, "seed"))
    except (ValueError, RLFlowError) as e:
        raise RLFlowError(f"generalise variant {label}: cannot export with these sizes: {e}") from None
    row = {"graph": label, "model": name, "sizes": overrides, "trained": False,
           **score_graph(j["agents"], load_onnx(path), j["rules"], j["cost"], config, j["base"], j["device"],
                         j["taso"], label)}
    return row, row_line(label, row)


def zero_shot(agents: dict, model: str, graph, variants: list[tuple[str, dict[str, int]]], rules, cost,
              config: dict, device: str = "cpu", taso: bool = False,
              log: Callable[[str], None] = print, trained: dict | None = None, workers: int = 1) -> list[dict]:
    """One row per graph -- ``graph`` (the shape the agents were trained on) first, then each variant exported
    with its sizes over the config's ``zoo.<name>`` -- from :func:`score_graph`: each agent's improvement and
    ``kept``, greedy's (and TASO's with ``taso``). ``agents``: method -> :class:`rlflow.agents.checkpoint.Agent`.

    ``trained``: the trained shape's row when it is known already (:func:`trained_row`, from the agent stages'
    traces), else it is scored here. ``workers`` > 1 scores the variants in that many processes at once (on the
    CPU; one torch thread each); each run is deterministic, so the rows are the same."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if trained is None:
        trained = score_graph(agents, graph, rules, cost, config, None, device, taso, variant_label(model, {}, model))
        for a in trained["agents"].values():
            a["kept"] = 1.0 if a["improvement_pct"] > 0 else None
    label = variant_label(model, {}, model)
    rows = [{"graph": label, "model": model, "sizes": {}, "trained": True, **trained}]
    log(row_line(label, rows[0]))
    base = {m: a["improvement_pct"] for m, a in trained["agents"].items()}
    with tempfile.TemporaryDirectory() as tmp:
        job = dict(agents=agents, model=model, variants=list(variants), rules=rules, cost=cost, config=config,
                   device=device, taso=taso, base=base, tmp=tmp)
        _JOB.update(job)
        try:
            n = range(1, len(variants) + 1)
            workers = min(workers, len(variants)) if device == "cpu" else 1
            if workers > 1:
                with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_start_worker, initargs=(job,)) as pool:
                    done = pool.map(_score_variant, n)
                    for row, line in done:
                        rows.append(row)
                        log(line)
            else:
                for i in n:
                    row, line = _score_variant(i)
                    rows.append(row)
                    log(line)
        finally:
            _JOB.clear()
    return rows
