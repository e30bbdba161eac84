"""The graph encoder: a computation graph -> its embedding z (X-RLflow's architecture; the attention layers are
:class:`rlflow.nn.gat.GATv2`).

Shapes: B graphs in a batch, V nodes and E edges in all (:class:`rlflow.nn.graph_data.GraphBatch`), F node
features, R edge features, G = 4 global metrics, H = hidden, Z = z_dim, N = rules.

1. Embed: h = Linear(x) [V, H], e = Linear(edge_attr) [E, H].
2. Edge-to-node update: h_i <- ELU(W [sum of the embedded features of the edges entering i || h_i]) [V, H].
3. ``layers`` GATv2 attention layers (``heads`` heads of H / heads features, concatenated; averaged heads of H
   features when heads does not divide H; edge features enter the attention), each with a residual connection
   and ELU: h <- ELU(h + GATv2(h, e)) [V, H].
4. Global update: g = ELU(W [LayerNorm(sum_i h_i) || clip((u - mean) / std, +-U_CLIP)]) [B, H] (the sum is
   layer-normalised: graphs have hundreds of nodes; the normalised metrics are clipped, see :data:`U_CLIP`).
5. z = Linear(g) [B, Z].

Prediction heads from z (trained with the encoder so that z carries what the world model must simulate):
``metrics`` [B, 4] the normalised log1p metrics ((log1p(m) - mean) / std; :meth:`GraphEncoder.metrics_from`
undoes it) and ``counts`` [B, N] log1p of the match count of every rule.

The metric normalisation (``metric_mean``, ``metric_std``, [4]) is a buffer: part of the state dict.
"""

from __future__ import annotations

import torch
from torch import nn

from rlflow.nn.gat import GATv2, scatter_sum


#: The normalised global metrics enter the network clipped to +-U_CLIP standard deviations (observation clipping,
#: as Stable-Baselines3's VecNormalize clips at 10). A metric that barely varies in the rollouts has a tiny std
#: (bert's log FLOPs: 9e-6, rewrites hardly change the FLOPs), so the same model at another input shape (bert seq
#: 64: FLOPs halved) sat 69,000 std away, z grew to norm 44,000 (4 at seq 128) and the zero-shot agent's policy
#: collapsed. No rollout step of the seven zoo models comes near the clip (at most 5.7 std), so training is as before.
U_CLIP = 10.0


class GraphEncoder(nn.Module):
    def __init__(self, node_features: int, edge_features: int, global_features: int = 4, hidden: int = 64,
                 layers: int = 5, heads: int = 4, z_dim: int = 32, n_xfers: int = 0):
        super().__init__()
        self.config = {"node_features": node_features, "edge_features": edge_features,
                       "global_features": global_features, "hidden": hidden, "layers": layers, "heads": heads,
                       "z_dim": z_dim, "n_xfers": n_xfers}
        self.node_in = nn.Linear(node_features, hidden)
        self.edge_in = nn.Linear(edge_features, hidden)
        self.edge_to_node = nn.Linear(2 * hidden, hidden)
        # heads of hidden // heads features, concatenated (width H); if heads does not divide H, averaged heads
        concat = hidden % heads == 0
        per_head = hidden // heads if concat else hidden
        self.convs = nn.ModuleList(
            GATv2(hidden, per_head, heads=heads, concat=concat, edge_dim=hidden)
            for _ in range(layers))
        self.pool_norm = nn.LayerNorm(hidden)
        self.global_update = nn.Linear(hidden + global_features, hidden)
        self.to_z = nn.Linear(hidden, z_dim)
        self.metrics_head = nn.Sequential(nn.Linear(z_dim, hidden), nn.ELU(), nn.Linear(hidden, global_features))
        self.counts_head = nn.Sequential(nn.Linear(z_dim, hidden), nn.ELU(), nn.Linear(hidden, max(n_xfers, 1)))
        self.n_xfers = n_xfers
        self.register_buffer("metric_mean", torch.zeros(global_features))
        self.register_buffer("metric_std", torch.ones(global_features))
        self.act = nn.ELU()

    def set_normalisation(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Metric normalisation [4] (of log1p metrics); std is floored at 1e-6."""
        self.metric_mean.copy_(torch.as_tensor(mean, dtype=torch.float32))
        self.metric_std.copy_(torch.as_tensor(std, dtype=torch.float32).clamp(min=1e-6))

    def normalise(self, log_metrics: torch.Tensor) -> torch.Tensor:
        """log1p metrics [..., 4] -> normalised [..., 4]."""
        return (log_metrics - self.metric_mean) / self.metric_std

    def metrics_from(self, normalised: torch.Tensor) -> torch.Tensor:
        """Normalised predictions [..., 4] -> metrics [..., 4] (runtime_ms, flops, bytes, launches)."""
        return torch.expm1(normalised * self.metric_std + self.metric_mean)

    def forward(self, data) -> torch.Tensor:
        """A :class:`GraphBatch` or one :class:`GraphData` (x [V, F], edge_index [2, E], edge_attr [E, R], u [B, 4],
        batch [V]) -> z [B, Z]."""
        x, edge_index, edge_attr = data.x, data.edge_index, data.edge_attr
        n = x.shape[0]
        index = getattr(data, "batch", None)
        if index is None:
            index = torch.zeros(n, dtype=torch.long, device=x.device)
        u = data.u.reshape(-1, self.metric_mean.shape[0])
        h = self.act(self.node_in(x))                                            # [V, H]
        e = self.act(self.edge_in(edge_attr))                                    # [E, H]
        incoming = scatter_sum(e, edge_index[1], n)                              # [V, H]
        h = self.act(self.edge_to_node(torch.cat([incoming, h], -1)))            # [V, H]
        for conv in self.convs:
            h = self.act(h + conv(h, edge_index, e))                             # [V, H]
        pooled = scatter_sum(h, index, u.shape[0])                               # [B, H]
        un = self.normalise(u).clamp(-U_CLIP, U_CLIP)                             # [B, 4]
        g = self.act(self.global_update(torch.cat([self.pool_norm(pooled), un], -1)))  # [B, H]
        return self.to_z(g)                                                      # [B, Z]

    def predict(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z [B, Z] -> (normalised log1p metrics [B, 4], log1p match counts [B, N])."""
        return self.metrics_head(z), self.counts_head(z)
