"""Equality saturation over the rule set (Tensat: Yang et al., MLSys 2021), with ILP extraction.

    result = eqsat_search(graph, rules, cost_model, node_limit=50_000, iter_limit=15, time_limit_s=60)

The pieces follow egg's seams (egraph.rs, run.rs, extract.rs), each module's docstring telling its part:

- :mod:`~rlflow.search.eqsat.egraph`: the typed e-graph (every value an e-class with its shape; an e-node per
  output of an op instance), rebuild (congruence closure) and Tensat's cycle filtering;
  :func:`graph_to_egraph` makes one from an IR graph.
- :mod:`~rlflow.search.eqsat.pattern`: rules are data: one generic e-matcher for every rule's source pattern
  (multi-pattern rules included), the whole-match checks, and applying a match.
- :mod:`~rlflow.search.eqsat.runner`: :class:`Runner` iterates match, apply, rebuild under a :class:`Scheduler`
  (:class:`BackoffScheduler`: egg's backoff scheduler with Tensat's limit on multi-pattern rules; an agent
  choosing rules per iteration is another) until a :class:`StopReason`, with semi-naive matching, and keeps one
  :class:`IterationRecord` per iteration.
- :mod:`~rlflow.search.eqsat.extract`: the cheapest graph the e-graph represents under the cost model, by ILP
  (HiGHS; lazy cycle cuts) or greedily, re-extracted with context costs on a target that fuses kernels.

**The search.** :func:`eqsat_search` saturates the input's e-graph with the backoff scheduler (egg's, with
RULE_MATCH_LIMIT and BAN_LENGTH as set here) and extracts. The result is folded; if it costs more than the input
under the cost model (extraction sums per-op costs; a target's graph-level fusions can differ) the input is
returned instead, so eqsat never returns a costlier graph. Its statistics (``SearchResult.stats``, read by the
report and the benchmarks) total the runner's iteration records (:func:`saturation_stats`).
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

from rlflow.cost.model import CostModel
from rlflow.graph.ir import Graph
from rlflow.rewrite.rule import Rule
from rlflow.search.common import finish
from rlflow.search.eqsat.egraph import EGraph, Key, _Filtered, graph_to_egraph
from rlflow.search.eqsat.extract import (EXTRACTION_ROUNDS, TIE_COST_MS, _Costs, extract_best, find_cycles,
                                         free_choice, graph_instances, greedy_extract, ilp_candidates, ilp_extract,
                                         to_graph)
from rlflow.search.eqsat.pattern import Pattern
from rlflow.search.eqsat.runner import (BAN_LENGTH, RULE_MATCH_LIMIT, BackoffScheduler, IterationRecord, Runner,
                                        Scheduler, StopReason)
from rlflow.search.result import SearchResult

_Pattern = Pattern  # the name it had when eqsat was one module (code on other branches imports it)

__all__ = ["BAN_LENGTH", "EXTRACTION_ROUNDS", "RULE_MATCH_LIMIT", "TIE_COST_MS", "BackoffScheduler", "EGraph",
           "IterationRecord", "Key", "Pattern", "Runner", "Scheduler", "StopReason", "_Costs", "_Filtered", "_Pattern",
           "eqsat_search", "extract_best", "find_cycles", "free_choice", "graph_instances", "graph_to_egraph",
           "greedy_extract", "ilp_candidates", "ilp_extract", "saturate", "saturation_stats", "to_graph"]


def eqsat_search(graph: Graph, rules: Sequence[Rule], cost_model: CostModel, node_limit: int = 50_000,
                 iter_limit: int = 15, time_limit_s: float = 60.0, ilp_time_limit_s: float = 60.0,
                 multi_iterations: int = 2, extraction: str = "ilp", scheduler: Scheduler | None = None,
                 method: str = "eqsat", ilp_node_limit: int = 0) -> SearchResult:
    """Equality saturation then extraction; see the module docstring. ``time_limit_s`` (saturation) and
    ``ilp_time_limit_s`` (the ILP) are clocks, ``ilp_node_limit`` the ILP's branch-and-bound nodes per solve; 0
    is no limit for each. Deterministic for given inputs unless a clock cuts saturation or the ILP: with both
    clocks 0 (a *clock-free budget*; bound the ILP by ``ilp_node_limit`` instead) the answer does not depend on
    the machine's speed or load. ``scheduler``: which rules run in each iteration (default: the backoff scheduler
    with ``multi_iterations``; :mod:`rlflow.search.eqsat_rl` passes its agent's), ``method`` the result's method
    name."""
    if node_limit < 1 or iter_limit < 0 or time_limit_s < 0 or ilp_time_limit_s < 0 or ilp_node_limit < 0 \
            or multi_iterations < 0 or extraction not in ("ilp", "greedy"):
        raise ValueError("eqsat_search: need node_limit >= 1, iter_limit, time limits, ilp_node_limit, "
                         "multi_iterations >= 0 and extraction ilp | greedy")
    t0 = time.perf_counter()
    initial = cost_model.graph_metrics(graph)
    eg, roots = graph_to_egraph(graph)
    nodes0, classes0 = eg.n_nodes, eg.n_classes
    # a rule whose target needs a newer opset than the graph's (constraints.min_opset) does not run
    runner = Runner(eg, [r for r in rules if r.min_opset <= graph.opset], scheduler or _backoff(multi_iterations),
                    node_limit=node_limit, iter_limit=iter_limit,
                    deadline=t0 + time_limit_s if time_limit_s else math.inf)
    stop = runner.run()
    t_sat = time.perf_counter() - t0
    roots = [eg.find(c) for c in roots]
    extracted, extracted_ms, ext = extract_best(eg, roots, graph, cost_model, extraction, ilp_time_limit_s,
                                                ilp_node_limit)
    t_ext = time.perf_counter() - t0 - t_sat
    final_graph, final = finish(extracted, cost_model)
    kept_input = False
    if final.runtime_ms > initial.runtime_ms:
        (final_graph, final), kept_input = finish(graph, cost_model), True
    sat = saturation_stats(runner.iterations, rules)
    joined = [p for p in map(Pattern, rules) if p.joined]  # (counted over every rule, whatever its min_opset)
    stats = {"egraph_nodes_initial": nodes0, "egraph_classes_initial": classes0, "egraph_nodes": eg.n_nodes,
             "egraph_classes": eg.n_classes, "saturation_seconds": t_sat, "extraction_seconds": t_ext,
             "rules": len(rules), "rules_translated": len(joined), "multi_pattern_rules": sum(p.multi for p in joined),
             "rules_skipped": len(rules) - len(joined), **sat, **ext,
             "extracted_cost_ms": extracted_ms, "kept_input": kept_input}
    return SearchResult(
        method=method, graph=final_graph, initial=initial, final=final, trace=[], expansions=sat["iterations"],
        seconds=time.perf_counter() - t0, generated=sat["matches"], kept=sat["applied"], stop_reason=stop.value,
        nodes_before=len(graph.nodes), nodes_after=len(final_graph.nodes),
        settings={"node_limit": node_limit, "iter_limit": iter_limit, "time_limit_s": time_limit_s,
                  "ilp_time_limit_s": ilp_time_limit_s, "ilp_node_limit": ilp_node_limit,
                  "multi_iterations": multi_iterations, "extraction": extraction},
        stats=stats)


def _backoff(multi_iterations: int) -> BackoffScheduler:
    """The backoff scheduler with this package's RULE_MATCH_LIMIT and BAN_LENGTH (read when called)."""
    return BackoffScheduler(multi_iterations, match_limit_base=RULE_MATCH_LIMIT, ban_length=BAN_LENGTH)


def saturation_stats(records: Sequence[IterationRecord], rules: Sequence[Rule]) -> dict[str, Any]:
    """The totals of a run's iteration records, as ``SearchResult.stats`` (and the report) name them;
    ``rules_fired`` counts by rule name (the rules a run had: variants of a rule share its name)."""
    name = {r.id: r.name for r in rules}
    fired: dict[str, int] = {}
    for r in records:
        for rid, n in r.fired.items():
            fired[name[rid]] = fired.get(name[rid], 0) + n
    return {"iterations": len(records), "matches": sum(r.matches for r in records),
            "applied": sum(r.applied for r in records), "merges": sum(r.merges for r in records),
            "match_cap_hits": sum(len(r.rules_over_limit) for r in records),
            "cycle_enodes_removed": sum(r.cycle_enodes_removed for r in records),
            "filtered": sum(r.filtered for r in records), "rules_fired": fired}


def saturate(eg: EGraph, rules: Sequence[Rule], node_limit: int, iter_limit: int, deadline: float,
             multi_iterations: int, semi_naive: bool = True) -> dict[str, Any]:
    """Saturate ``eg`` as :func:`eqsat_search` does (a :class:`Runner` with the backoff scheduler); returns
    :func:`saturation_stats` and ``"stop"`` (the stop reason's value)."""
    runner = Runner(eg, rules, _backoff(multi_iterations), node_limit=node_limit, iter_limit=iter_limit,
                    deadline=deadline, semi_naive=semi_naive)
    stop = runner.run()
    return {**saturation_stats(runner.iterations, rules), "stop": stop.value}
