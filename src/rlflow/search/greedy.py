"""Greedy search: apply the (rule, location) that lowers the estimated cost the most, and repeat until no
rewrite lowers it. Ties go to the first in rule order, then location order, so the result is deterministic.
Every graph is scored by the target's whole-graph estimate (``Scorer``): the graph kept after a step is scored
again, and a step whose graph does not cost less than its parent is never taken, so the trace's estimate falls at
every step and the search ends; ``time_limit_s`` (0: none) also stops it. The result is never costlier than the
input on the target (after constant folding, the input itself is returned if it would be).
"""

from __future__ import annotations

import time
from typing import Sequence

from rlflow.cost.model import CostModel
from rlflow.graph.ir import Graph
from rlflow.rewrite.matcher import MatchIndex
from rlflow.rewrite.rule import Rule
from rlflow.search.common import QUANTUM_MS, Scorer, finish, progress_bar
from rlflow.search.result import SearchResult, TraceStep


def greedy_search(graph: Graph, rules: Sequence[Rule], cost_model: CostModel, time_limit_s: float = 0,
                  progress: bool = False) -> SearchResult:
    if time_limit_s < 0:
        raise ValueError("greedy_search: need time_limit_s >= 0")
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s if time_limit_s else 0.0
    rules = list(rules)
    scorer = Scorer(cost_model)
    initial = cost_model.graph_metrics(graph)
    cost = scorer.graph_cost(graph)
    index = MatchIndex(graph, rules)
    trace: list[TraceStep] = []
    expansions = generated = 0
    stop = "converged"
    bar = progress_bar(progress, None, "greedy search")
    try:
        while True:
            if deadline and time.perf_counter() > deadline:
                stop = "time_limit"
                break
            expansions += 1
            best = None
            for k, j, m, c in scorer.child_costs(index, cost, deadline):
                generated += 1
                if c < (best[0] if best else cost):
                    best = (c, k, j, m)
            if best is None:
                break
            _, k, j, m = best
            child = index.apply(k, j)
            rescored = scorer.graph_cost(child.graph)  # the graph kept, in the currency of its parent's cost
            if rescored >= cost:  # (only where a child's score and its whole-graph estimate disagree)
                stop = "no step lowers the whole-graph estimate"
                break
            cost, index = rescored, child
            trace.append(TraceStep(rules[k].id, rules[k].name, j, tuple(m.nodes),
                                   cost_model.graph_metrics(index.graph)))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(cost_ms=f"{cost * QUANTUM_MS:.3f}", refresh=False)
    finally:
        if bar is not None:
            bar.close()
    final_graph, final = finish(index.graph, cost_model)
    if final.runtime_ms > initial.runtime_ms:  # (folding) never return a costlier graph
        trace, (final_graph, final) = [], finish(graph, cost_model)
    return SearchResult(
        method="greedy", graph=final_graph, initial=initial, final=final, trace=trace, expansions=expansions,
        seconds=time.perf_counter() - t0, generated=generated, kept=len(trace), stop_reason=stop,
        nodes_before=len(graph.nodes), nodes_after=len(final_graph.nodes),
        settings={"time_limit_s": time_limit_s},
        stats={"scored_incrementally": scorer.delta_sums, "scored_from_scratch": scorer.full_sums,
               "reused_from_previous_graph": scorer.reused})
