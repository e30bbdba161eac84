"""Fold static subgraphs: nodes whose inputs are all constants (a weight transposed, two weights concatenated,
a kernel enlarged, BatchNormalization parameters combined) become constants computed once.

Rewrites leave such nodes in the graph (cheap to apply, and the cost model can treat them as free); search
results and exported models are folded with :func:`fold_constants`, as TASO folds weight-only ops after its
search.
"""

from __future__ import annotations

import numpy as np

from rlflow.graph.ir import Constant, Graph
from rlflow.graph.ops import OPS


def static_values(graph: Graph) -> tuple[set[str], list[int]]:
    """(static values, indices of static nodes): a static node reads only constants or outputs of static nodes
    (a weight reshaped, two weights concatenated); its outputs and the constants are the static values."""
    static = set(graph.constants)
    out = []
    for i, n in enumerate(graph.nodes):
        if n.op != "Opaque" and n.inputs and all(v in static for v in n.inputs if v):
            static.update(n.outputs)
            out.append(i)
    return static, out


def static_nodes(graph: Graph) -> list[int]:
    """Indices of the nodes that read only constants or outputs of such nodes."""
    return static_values(graph)[1]


def fold_constants(graph: Graph) -> Graph:
    """The same graph with every static node replaced by constants (computed with the ops' torch semantics in
    the tensors' own dtype). Constants nobody reads any more are dropped. Returns ``graph`` itself if there is
    nothing to fold."""
    import torch

    idx = static_nodes(graph)
    if not idx:
        return graph
    values = {}
    fold = set(idx)
    constants = dict(graph.constants)
    for i in idx:
        n = graph.nodes[i]
        ins = [values[v] if v in values else torch.from_numpy(np.array(constants[v].array)) for v in n.inputs]
        with torch.inference_mode():
            outs = OPS[n.op].compute(ins, n.attrs)
        for v, t in zip(n.outputs, outs):
            values[v] = t
            constants[v] = Constant(t.contiguous().numpy().astype(graph.types[v].dtype, copy=False))
    nodes = [n for i, n in enumerate(graph.nodes) if i not in fold]
    used = {v for n in nodes for v in n.inputs} | set(graph.outputs)
    g = graph.copy()
    g.nodes = nodes
    g.constants = {k: c for k, c in constants.items() if k in used}
    g.types = {k: t for k, t in graph.types.items() if k not in constants or k in used}
    return g
