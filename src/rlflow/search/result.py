"""What a search returns: the best graph (folded), its cost before and after, the rewrites that lead to it, and
the search's own statistics; :meth:`SearchResult.to_json` is the ``trace.json`` the search stages write."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlflow.cost.metrics import Metrics
from rlflow.graph.ir import Graph

TRACE_FORMAT = "rlflow.search-trace/2"


@dataclass(frozen=True)
class TraceStep:
    """One rewrite on the path from the original graph to the result."""

    rule_id: str
    rule_name: str
    location: int
    """Index of the match among the rule's matches on the graph it was applied to (their deterministic order)."""
    nodes: tuple[str, ...]
    """Names of the graph nodes the match replaced."""
    metrics: Metrics
    """The cost of the graph after this rewrite."""

    def to_json(self) -> dict:
        return {"rule_id": self.rule_id, "rule_name": self.rule_name, "location": self.location,
                "nodes": list(self.nodes), "cost_ms": self.metrics.runtime_ms, "metrics": self.metrics.as_dict()}


@dataclass
class SearchResult:
    method: str
    """``taso`` or ``greedy``."""
    graph: Graph
    """The best graph found, weight-only nodes folded into constants."""
    initial: Metrics
    final: Metrics
    trace: list[TraceStep]
    expansions: int
    """Graphs whose every (rule, location) was tried (TASO: graphs taken from the queue)."""
    seconds: float
    generated: int = 0
    """Candidate graphs made (one per rule application tried)."""
    kept: int = 0
    """Candidates that passed the filters (TASO: cost < best x alpha, new hash, op limit; greedy: the step taken)."""
    stop_reason: str = ""
    """budget | time_limit | exhausted (queue empty) | converged (greedy: nothing improves)."""
    nodes_before: int = 0
    nodes_after: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    """Bookkeeping: queue left, index rebuilds, children scored incrementally vs from scratch."""

    @property
    def speedup(self) -> float:
        """Estimated cost ratio before / after."""
        return self.initial.runtime_ms / self.final.runtime_ms if self.final.runtime_ms > 0 else float("inf")

    @property
    def ms_per_expansion(self) -> float:
        return 1e3 * self.seconds / self.expansions if self.expansions else 0.0

    def to_json(self, **extra: Any) -> dict:
        """The trace document (``"format": "rlflow.search-trace/2"``); ``extra`` keys (model, device, ...) are
        added at the top level."""
        doc: dict[str, Any] = {"format": TRACE_FORMAT, "method": self.method}
        doc.update(extra)
        doc.update({
            "settings": dict(self.settings),
            "initial": {"nodes": self.nodes_before, **self.initial.as_dict()},
            "final": {"nodes": self.nodes_after, **self.final.as_dict()},
            "speedup": self.speedup,
            "steps": [s.to_json() for s in self.trace],
            "rules_applied": len(self.trace),
            "expansions": self.expansions,
            "candidates_generated": self.generated,
            "candidates_kept": self.kept,
            "stop_reason": self.stop_reason,
            "seconds": self.seconds,
            "ms_per_expansion": self.ms_per_expansion,
            "stats": dict(self.stats),
        })
        return doc
