"""TASO's cost-based backtracking search (Jia et al., SOSP 2019, Algorithm 2), over this project's rules.

A priority queue holds candidate graphs ordered by estimated cost (``runtime_ms``; ties by insertion order, so
the search is deterministic). Each step takes the cheapest candidate and applies every rule at every location
where it matches; a new graph joins the queue if its cost is below ``alpha`` x the best cost so far, its
structural hash has not been seen, and it has fewer than twice the original's nodes. The best graph seen is
the result. The search stops after ``budget`` graphs have been taken from the queue, after ``time_limit_s``
seconds (0: no limit), or when the queue is empty.

Memory: a queued candidate is only (cost, parent, rule, location); the graph is rebuilt when it is taken from
the queue, with its match index updated incrementally from its parent's (the most recent parents' indices are
kept; an older one is rebuilt from scratch, which gives the same matches in the same order).
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from rlflow.cost.model import CostModel
from rlflow.graph.ir import Graph
from rlflow.rewrite.matcher import MatchIndex
from rlflow.rewrite.rule import Rule
from rlflow.search.common import QUANTUM_MS, Scorer, finish, progress_bar
from rlflow.search.result import SearchResult, TraceStep

#: match indices of recently expanded graphs kept for their children (each ~ a few hundred kB on BERT)
INDEX_CACHE = 48


@dataclass(eq=False)
class _Expanded:
    """A graph taken from the queue: how it was reached (parent, rule, location), kept for the trace."""

    parent: "_Expanded | None"
    rule: int
    location: int
    nodes: tuple[str, ...]
    graph: Graph


def taso_search(graph: Graph, rules: Sequence[Rule], cost_model: CostModel, alpha: float = 1.05,
                budget: int = 1000, time_limit_s: float = 0, progress: bool = False) -> SearchResult:
    """Run the backtracking search from ``graph``; see the module docstring. Deterministic for given inputs."""
    if alpha < 1.0 or budget < 1 or time_limit_s < 0:
        raise ValueError("taso_search: need alpha >= 1, budget >= 1 and time_limit_s >= 0")
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s if time_limit_s else 0.0
    rules = list(rules)
    scorer = Scorer(cost_model)
    initial = cost_model.graph_metrics(graph)
    max_nodes = 2 * len(graph.nodes)
    seen = {scorer.graph_hash(graph)}
    # queue entries: (cost, insertion counter, parent, rule index, location); the root has no parent. Costs are
    # integers (QUANTUM_MS units): exact sums, ties broken by insertion order
    root_cost = scorer.graph_cost(graph)
    queue: list[tuple] = [(root_cost, 0, None, -1, -1)]
    counter = 1
    best_cost = root_cost
    best: tuple = (None, -1, -1, (), graph)  # (parent, rule, location, matched nodes, graph)
    indices: OrderedDict[int, tuple[_Expanded, MatchIndex]] = OrderedDict()
    expansions = generated = kept = rebuilds = 0
    stop = "exhausted"
    bar = progress_bar(progress, budget, "taso search")
    try:
        while queue:
            if expansions >= budget:
                stop = "budget"
                break
            if deadline and time.perf_counter() > deadline:
                stop = "time_limit"
                break
            cost, _, parent, k, j = heapq.heappop(queue)
            if parent is None:
                index = MatchIndex(graph, rules)
                node = _Expanded(None, -1, -1, (), graph)
            else:
                hit = indices.get(id(parent))
                if hit is not None and hit[0] is parent:
                    indices.move_to_end(id(parent))
                    pindex = hit[1]
                else:
                    pindex = MatchIndex(parent.graph, rules)
                    rebuilds += 1
                    _remember(indices, parent, pindex)
                match = pindex.matches[k][j]
                index = pindex.apply(k, j)
                node = _Expanded(parent, k, j, match.nodes, index.graph)
            expansions += 1
            limit = best_cost * alpha
            for ck, cj, m, child, c, first in scorer.children(index, cost, deadline):
                generated += 1
                if c >= limit or len(child.nodes) >= max_nodes:
                    continue
                h = scorer.child_hash(index.graph, child, first)
                if h in seen:
                    continue
                seen.add(h)
                kept += 1
                heapq.heappush(queue, (c, counter, node, ck, cj))
                counter += 1
                if c < best_cost:
                    best_cost = c
                    limit = best_cost * alpha
                    best = (node, ck, cj, m.nodes, child)
            _remember(indices, node, index)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(best_ms=f"{best_cost * QUANTUM_MS:.3f}", queue=len(queue), refresh=False)
    finally:
        if bar is not None:
            bar.close()
    parent, k, j, nodes, best_graph = best
    trace = _trace(parent, k, j, nodes, best_graph, rules, cost_model)
    final_graph, final = finish(best_graph, cost_model)
    if final.runtime_ms > initial.runtime_ms:  # (quantization) never return a costlier graph
        trace, (final_graph, final) = [], finish(graph, cost_model)
    return SearchResult(
        method="taso", graph=final_graph, initial=initial, final=final, trace=trace, expansions=expansions,
        seconds=time.perf_counter() - t0, generated=generated, kept=kept, stop_reason=stop,
        nodes_before=len(graph.nodes), nodes_after=len(final_graph.nodes),
        settings={"alpha": alpha, "budget": budget, "time_limit_s": time_limit_s},
        stats={"queue_left": len(queue), "index_rebuilds": rebuilds, "scored_incrementally": scorer.delta_sums,
               "scored_from_scratch": scorer.full_sums})


def _remember(indices: OrderedDict, node: _Expanded, index: MatchIndex) -> None:
    indices[id(node)] = (node, index)
    indices.move_to_end(id(node))
    while len(indices) > INDEX_CACHE:
        indices.popitem(last=False)


def _trace(parent: _Expanded | None, k: int, j: int, nodes: tuple[str, ...], graph: Graph,
           rules: list[Rule], cost: CostModel) -> list[TraceStep]:
    """The rewrites from the original graph to ``graph`` (reached from ``parent`` by rule ``k`` at ``j``), each
    with the exact cost of the graph after it."""
    chain: list[tuple[int, int, tuple[str, ...], Graph]] = []
    if k >= 0:
        chain.append((k, j, nodes, graph))
    while parent is not None and parent.parent is not None:
        chain.append((parent.rule, parent.location, parent.nodes, parent.graph))
        parent = parent.parent
    steps = []
    for k, j, nodes, g in reversed(chain):
        r = rules[k]
        steps.append(TraceStep(r.id, r.name, j, tuple(nodes), cost.graph_metrics(g)))
    return steps

