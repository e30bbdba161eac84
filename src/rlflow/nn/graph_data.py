"""The environment's observation as a graph of tensors (:class:`GraphData`), and graphs stacked into one
(:class:`GraphBatch`) for the encoder.

One observation (see :mod:`rlflow.env.observation`) becomes::

    x           [V, F]  float32   node features: one-hot type, then log1p(runtime_ms) in the last column
    edge_index  [2, E]  int64     producer -> reader
    edge_attr   [E, R]  float32   log1p of the value's shape dims (R = MAX_RANK, right-aligned, 0 = absent)
    u           [1, 4]  float32   log1p of the global metrics [runtime_ms, flops, bytes, launches]

plus optional training targets ``y_metrics`` [1, 4] (log1p metrics, float32) and ``y_counts`` [1, N] (log1p
match counts per rule, float32). :func:`batch` stacks the ``[1, ...]`` graph-level tensors into ``[B, ...]`` and
concatenates the nodes and edges, each graph's edge indices shifted past the nodes before it (``batch`` [sum V]
maps a node to its graph), as PyTorch Geometric's ``Batch`` does (which the project used before: importing it cost
seconds per process).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

import numpy as np
import torch

#: the optional training targets, stacked only when every graph has them
TARGET_FIELDS = ("y_metrics", "y_counts")


@dataclass
class GraphData:
    """One observation's tensors (shapes in the module docstring)."""
    x: torch.Tensor
    edge_index: torch.Tensor
    edge_attr: torch.Tensor
    u: torch.Tensor
    y_metrics: torch.Tensor | None = None
    y_counts: torch.Tensor | None = None


@dataclass
class GraphBatch(GraphData):
    """B graphs stacked: x [sum V, F], edge_index [2, sum E], edge_attr [sum E, R], u [B, 4], batch [sum V] (the
    graph of each node); the targets [B, ...] when every graph has them."""
    batch: torch.Tensor | None = None
    num_graphs: int = 0

    def to(self, device) -> "GraphBatch":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


def log_metrics(metrics: Sequence[float] | np.ndarray) -> np.ndarray:
    """log1p of metrics [..., 4] (non-negative), float64."""
    return np.log1p(np.maximum(np.asarray(metrics, np.float64), 0.0))


def to_data(obs: dict, counts: np.ndarray | None = None) -> GraphData:
    """An environment observation (``obs["graph"]`` a GraphInstance, ``obs["global"]`` [4]) -> :class:`GraphData`;
    ``counts`` (N,) (matches per rule), when given, adds the targets ``y_metrics`` and ``y_counts``."""
    g = obs["graph"]
    x = np.array(g.nodes, np.float32, copy=True)
    if len(x):
        x[:, -1] = np.log1p(np.maximum(x[:, -1], 0.0))
    edges = np.log1p(np.maximum(np.asarray(g.edges, np.float32), 0.0)).astype(np.float32)
    links = np.asarray(g.edge_links, np.int64).reshape(-1, 2)
    u = log_metrics(obs["global"]).astype(np.float32).reshape(1, -1)
    data = GraphData(x=torch.from_numpy(x), edge_index=torch.from_numpy(np.ascontiguousarray(links.T)),
                     edge_attr=torch.from_numpy(edges.reshape(len(links), -1)), u=torch.from_numpy(u))
    if counts is not None:
        data.y_metrics = data.u.clone()
        data.y_counts = torch.from_numpy(np.log1p(np.asarray(counts, np.float64)).astype(np.float32).reshape(1, -1))
    return data


def batch(datas: Sequence[GraphData]) -> GraphBatch:
    """Stack graphs into one :class:`GraphBatch` (x [sum V, F], edge_index [2, sum E], u [B, 4], batch [sum V])."""
    datas = list(datas)
    if not datas:
        raise ValueError("batch: no graphs to stack")
    nodes = torch.tensor([d.x.shape[0] for d in datas])
    offsets = torch.cumsum(nodes, 0) - nodes
    stacked = {"x": torch.cat([d.x for d in datas]),
               "edge_index": torch.cat([d.edge_index + int(o) for d, o in zip(datas, offsets)], dim=1),
               "edge_attr": torch.cat([d.edge_attr for d in datas]),
               "u": torch.cat([d.u for d in datas])}
    for name in TARGET_FIELDS:
        if all(getattr(d, name) is not None for d in datas):
            stacked[name] = torch.cat([getattr(d, name) for d in datas])
    return GraphBatch(**stacked, batch=torch.repeat_interleave(torch.arange(len(datas)), nodes),
                      num_graphs=len(datas))
