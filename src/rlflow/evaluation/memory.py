"""A deterministic activation-memory estimate: the peak total size of the live intermediate tensors when a graph
runs node by node in its (topological) node order.

The model (one buffer per value, freed as early as possible):

* a node allocates all its outputs before any of its inputs is freed, so at node ``i`` the live set is every
  value still needed plus node ``i``'s outputs: that sum is a candidate for the peak;
* after node ``i``, every value whose last reader is node ``i`` is freed, and so is an output of node ``i`` that
  nothing reads (a dead value); graph outputs are never freed (the caller receives them);
* weights are excluded: the graph's constants, and every value computed from constants alone (a weight-only
  subgraph, e.g. a transposed weight: onnxruntime, Grappler and XLA fold them once, before running);
* graph inputs are excluded too: the caller owns them, and they are the same for every rewrite of a model.

No buffer is shared or reused in place (``Reshape`` and ``Identity`` count as copies), so the figure is an upper
bound on what an executor with in-place views needs, and the same model for every graph it compares.
"""

from __future__ import annotations

from rlflow.graph.ir import Graph

MB = float(2**20)
"""Bytes per MB in every memory column of the evaluation (MiB, as ``rlflow run`` prints them)."""


def weight_values(graph: Graph) -> set[str]:
    """The constants and every value computed from constants alone (all of its node's inputs are weights)."""
    weights = set(graph.constants)
    for n in graph.nodes:
        if all(v in weights for v in n.inputs if v):
            weights.update(n.outputs)
    return weights


def activation_memory_bytes(graph: Graph) -> int:
    """The peak of live intermediate tensor bytes over the graph's node order (see the module docstring)."""
    weights = weight_values(graph)
    keep = set(graph.outputs)
    last_use: dict[str, int] = {}
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            if v:
                last_use[v] = i
    live = peak = 0
    alive: set[str] = set()
    for i, n in enumerate(graph.nodes):
        outs = [v for v in n.outputs if v and v not in weights]
        if not outs:
            continue  # a weight-only node
        for v in outs:
            alive.add(v)
            live += graph.types[v].nbytes
        peak = max(peak, live)
        dead = {v for v in n.inputs if v in alive and last_use[v] == i}
        dead |= {v for v in outs if v not in last_use}
        for v in dead - keep:
            alive.discard(v)
            live -= graph.types[v].nbytes
    return peak


def activation_memory_mb(graph: Graph) -> float:
    return activation_memory_bytes(graph) / MB
