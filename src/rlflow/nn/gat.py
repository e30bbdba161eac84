"""GATv2 graph attention with edge features, and the scatter reductions the encoder needs, in plain torch.

GATv2 (Brody, Alon and Yahav, "How Attentive are Graph Attention Networks?", ICLR 2022): for an edge j -> i with
features e_ji, per head (H heads of C features)::

    s_ji  = a . LeakyReLU_0.2(W_r h_i + W_l h_j + W_e e_ji)            score        [E, H]
    alpha = softmax of s over the edges entering i                      weights      [E, H]
    h_i'  = sum_j alpha_ji W_l h_j  (+ bias)                            [V, H, C] -> [V, H C] or the heads' mean [V, C]

Every node also attends to itself: self-loops are added (any already in the graph removed first), each with the
mean of the features of the edges entering its node (zeros where none enter).

The project used PyTorch Geometric's ``GATv2Conv`` for this. Importing PyG took 5-6 s per process on the 2-core
CPU (it imports torch's compiler stack and, where it is installed, transformers), paid by every agent stage; this
module computes the same function with the same parameters (names, shapes, initialisation and its random draws),
so checkpoints written before load and behave as they did (tests/test_gat.py checks both against PyG).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

#: the slope of the LeakyReLU inside the attention score (GATv2's)
NEGATIVE_SLOPE = 0.2


def scatter_sum(src: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """src [E, ...] summed into ``size`` rows by index [E] -> [size, ...] (zeros where no row maps)."""
    return src.new_zeros((size, *src.shape[1:])).index_add(0, index, src)


def scatter_mean(src: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """src [E, ...] averaged into ``size`` rows by index [E] -> [size, ...] (zeros where no row maps)."""
    count = torch.bincount(index, minlength=size).clamp(min=1).to(src.dtype)
    return scatter_sum(src, index, size) / count.view(-1, *([1] * (src.dim() - 1)))


def segment_softmax(score: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """score [E, H] -> softmax over the entries sharing an index [E] -> [E, H] (each group's maximum subtracted)."""
    group = index.view(-1, 1).expand_as(score)
    peak = score.new_zeros((size, score.shape[1])).scatter_reduce(0, group, score.detach(), "amax",
                                                                  include_self=False)
    weight = (score - peak[index]).exp()
    return weight / (scatter_sum(weight, index, size)[index] + 1e-16)


def _glorot(t: torch.Tensor) -> None:
    bound = math.sqrt(6.0 / (t.shape[-2] + t.shape[-1]))
    with torch.no_grad():
        t.uniform_(-bound, bound)


class GATv2(nn.Module):
    """One GATv2 layer: h [V, F], edge_index [2, E] (source, target), edge_attr [E, D] -> [V, H C] (``concat``)
    or [V, C] (the heads averaged).

    Parameters: ``lin_l`` (the source's, W_l), ``lin_r`` (the target's, W_r), ``lin_edge`` (W_e, no bias), ``att``
    [1, H, C] and ``bias``."""

    def __init__(self, in_features: int, out_per_head: int, heads: int, concat: bool, edge_dim: int):
        super().__init__()
        self.heads, self.out_per_head, self.concat = heads, out_per_head, concat
        width = heads * out_per_head
        self.lin_l = nn.Linear(in_features, width)
        self.lin_r = nn.Linear(in_features, width)
        self.att = nn.Parameter(torch.empty(1, heads, out_per_head))
        self.lin_edge = nn.Linear(edge_dim, width, bias=False)
        self.bias = nn.Parameter(torch.empty(width if concat else out_per_head))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot-uniform weights, biases uniform in +-1/sqrt(in_features), ``bias`` zero: PyG's initialisation,
        drawn in its order."""
        for lin in (self.lin_l, self.lin_r):
            _glorot(lin.weight)
            bound = 1.0 / math.sqrt(lin.in_features)
            with torch.no_grad():
                lin.bias.uniform_(-bound, bound)
        _glorot(self.lin_edge.weight)
        _glorot(self.att)
        with torch.no_grad():
            self.bias.zero_()

    def forward(self, h: torch.Tensor, edge_index: torch.Tensor, edge_attr: torch.Tensor) -> torch.Tensor:
        n, heads, c = h.shape[0], self.heads, self.out_per_head
        src, dst = edge_index[0], edge_index[1]
        keep = src != dst
        src, dst, edge_attr = src[keep], dst[keep], edge_attr[keep]
        loops = torch.arange(n, device=h.device)
        loop_attr = scatter_mean(edge_attr, dst, n)                               # [V, D]
        src, dst = torch.cat([src, loops]), torch.cat([dst, loops])
        edge_attr = torch.cat([edge_attr, loop_attr])                             # [E + V, D]
        xl = self.lin_l(h).view(n, heads, c)                                      # [V, H, C]
        xr = self.lin_r(h).view(n, heads, c)
        xj = xl[src]                                                              # [E + V, H, C]
        s = xr[dst] + xj + self.lin_edge(edge_attr).view(-1, heads, c)
        score = (F.leaky_relu(s, NEGATIVE_SLOPE) * self.att).sum(-1)              # [E + V, H]
        alpha = segment_softmax(score, dst, n)
        out = scatter_sum(xj * alpha.unsqueeze(-1), dst, n)                       # [V, H, C]
        out = out.reshape(n, heads * c) if self.concat else out.mean(dim=1)
        return out + self.bias
