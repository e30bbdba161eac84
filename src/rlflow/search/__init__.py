"""The search baselines (no learning): TASO's cost-based backtracking search and greedy search.

    result = taso_search(graph, rules, cost_model, alpha=1.05, budget=1000)
    result = greedy_search(graph, rules, cost_model)
    result.graph, result.initial, result.final, result.trace, result.to_json()

Both are deterministic for a given graph, rule list and cost model, and return the best graph with its
weight-only nodes folded into constants.
"""

from rlflow.search.greedy import greedy_search
from rlflow.search.result import TRACE_FORMAT, SearchResult, TraceStep
from rlflow.search.taso import taso_search

METHODS = ("taso", "greedy")

__all__ = ["METHODS", "TRACE_FORMAT", "SearchResult", "TraceStep", "greedy_search", "taso_search"]
