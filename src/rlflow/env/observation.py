"""The environment's graph observation: node features, edge features and links (a ``gymnasium.spaces.Graph``).

Nodes are the graph's inputs, then its weights (constants), then its operators in graph order. A node's features
are a one-hot of its type (:data:`NODE_TYPES`: every IR op, Opaque, Input, Weight) and its estimated runtime in
ms. One edge per value an operator reads, from the value's producer (operator, input or weight) to the reader;
its features are the value's shape, right-aligned in :data:`MAX_RANK` slots (a scalar is all zeros).
"""

from __future__ import annotations

import numpy as np

from rlflow.graph.ir import Graph
from rlflow.graph.ops import OPS

NODE_TYPES: tuple[str, ...] = (*sorted(OPS), "Opaque", "Input", "Weight")
TYPE_INDEX = {t: i for i, t in enumerate(NODE_TYPES)}
NODE_FEATURES = len(NODE_TYPES) + 1     # one-hot type, runtime_ms
MAX_RANK = 6                            # edge features: the value's shape (ranks above this keep the last dims)


_ROWS: dict[tuple[int, ...], tuple[int, ...]] = {}  # shape -> its row (a model has a few dozen shapes)


def _shape_row(shape: tuple[int, ...]) -> tuple[int, ...]:
    row = _ROWS.get(shape)
    if row is None:
        s = shape[-MAX_RANK:]
        row = _ROWS[shape] = (0,) * (MAX_RANK - len(s)) + tuple(s)
    return row


def graph_features(graph: Graph, node_runtimes: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(nodes [V, NODE_FEATURES] float32, edges [E, MAX_RANK] float32, edge_links [E, 2] int64) of ``graph``;
    ``node_runtimes`` gives each operator's runtime (graph order)."""
    n_in, n_w, n_op = len(graph.inputs), len(graph.constants), len(graph.nodes)
    index: dict[str, int] = {}
    for i, v in enumerate(graph.inputs):
        index[v] = i
    for i, v in enumerate(graph.constants, n_in):
        index[v] = i
    base = n_in + n_w
    types = [TYPE_INDEX["Input"]] * n_in + [TYPE_INDEX["Weight"]] * n_w
    src, dst, shapes = [], [], []
    gt = graph.types
    for j, node in enumerate(graph.nodes, base):
        types.append(TYPE_INDEX[node.op])
        for v in node.inputs:
            if v:
                src.append(index[v])
                dst.append(j)
                shapes.append(_shape_row(gt[v].shape))
        for v in node.outputs:
            index[v] = j
    nodes = np.zeros((base + n_op, NODE_FEATURES), np.float32)
    nodes[np.arange(base + n_op), types] = 1.0
    nodes[base:, -1] = node_runtimes
    edges = np.asarray(shapes, np.float32).reshape(-1, MAX_RANK)
    links = np.stack([np.asarray(src, np.int64), np.asarray(dst, np.int64)], axis=1) if src else \
        np.zeros((0, 2), np.int64)
    return nodes, edges, links
