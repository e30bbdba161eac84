"""The environment's observation as a PyTorch Geometric graph (``torch_geometric.data.Data``).

One observation (see :mod:`rlflow.env.observation`) becomes::

    x           [V, F]  float32   node features: one-hot type, then log1p(runtime_ms) in the last column
    edge_index  [2, E]  int64     producer -> reader
    edge_attr   [E, R]  float32   log1p of the value's shape dims (R = MAX_RANK, right-aligned, 0 = absent)
    u           [1, 4]  float32   log1p of the global metrics [runtime_ms, flops, bytes, launches]

plus optional training targets ``y_metrics`` [1, 4] (log1p metrics, float32) and ``y_counts`` [1, N] (log1p
match counts per rule, float32). ``Batch.from_data_list`` (or ``torch_geometric.loader.DataLoader``) stacks the
``[1, ...]`` graph-level tensors into ``[B, ...]`` and concatenates the nodes and edges (``batch`` [sum V] maps a
node to its graph).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch_geometric.data import Batch, Data


def log_metrics(metrics: Sequence[float] | np.ndarray) -> np.ndarray:
    """log1p of metrics [..., 4] (non-negative), float64."""
    return np.log1p(np.maximum(np.asarray(metrics, np.float64), 0.0))


def to_data(obs: dict, counts: np.ndarray | None = None) -> Data:
    """An environment observation (``obs["graph"]`` a GraphInstance, ``obs["global"]`` [4]) -> ``Data``;
    ``counts`` (N,) (matches per rule), when given, adds the targets ``y_metrics`` and ``y_counts``."""
    g = obs["graph"]
    x = np.array(g.nodes, np.float32, copy=True)
    if len(x):
        x[:, -1] = np.log1p(np.maximum(x[:, -1], 0.0))
    edges = np.log1p(np.maximum(np.asarray(g.edges, np.float32), 0.0)).astype(np.float32)
    links = np.asarray(g.edge_links, np.int64).reshape(-1, 2)
    u = log_metrics(obs["global"]).astype(np.float32).reshape(1, -1)
    data = Data(x=torch.from_numpy(x), edge_index=torch.from_numpy(np.ascontiguousarray(links.T)),
                edge_attr=torch.from_numpy(edges.reshape(len(links), -1)), u=torch.from_numpy(u))
    if counts is not None:
        data.y_metrics = data.u.clone()
        data.y_counts = torch.from_numpy(np.log1p(np.asarray(counts, np.float64)).astype(np.float32).reshape(1, -1))
    return data


def batch(datas: Sequence[Data]) -> Batch:
    """Stack graphs into one ``Batch`` (x [sum V, F], edge_index [2, sum E], u [B, 4], batch [sum V])."""
    return Batch.from_data_list(list(datas))
