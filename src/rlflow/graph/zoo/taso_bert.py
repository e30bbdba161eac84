"""TASO's BERT example graph (attention without softmax), as in the TASO/RLFlow benchmarks.

Architecture facts: input ``x`` float32 [seq, hidden] = [64, 1024], 8 layers, 16 heads (d_k 64).
Each layer: Q, K, V = x @ Wq, x @ Wk, x @ Wv (plain MatMul with [hidden, hidden] weights, no bias);
each reshaped to (seq, heads, d_k) and transposed to (heads, seq, d_k), K to (heads, d_k, seq);
two batched matmuls (Q @ K, then @ V) with no scaling and no softmax; transposed back to
(seq, heads, d_k), reshaped to (seq, hidden), multiplied by Wo; the next layer takes that output.
No softmax, LayerNorm or FFN.

Each layer is cubic in its input, so fixed random scales would vanish or overflow within a few
layers; after the seeded draw, each layer's Wo is rescaled once so that the layer's output on the
example input has unit RMS (a deterministic, data-dependent calibration).

Output ``output`` float32 [seq, hidden].
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rlflow.errors import RLFlowError

from ._common import Init, ModelSpec, input_generator

DEFAULT_SIZES = {"layers": 8, "seq": 64, "hidden": 1024, "heads": 16}
TINY_SIZES = {"layers": 2, "seq": 8, "hidden": 32, "heads": 2}
OUTPUT_NAME = "output"


class TasoAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.d_k = hidden // heads
        self.wq = nn.Parameter(torch.empty(hidden, hidden))
        self.wk = nn.Parameter(torch.empty(hidden, hidden))
        self.wv = nn.Parameter(torch.empty(hidden, hidden))
        self.wo = nn.Parameter(torch.empty(hidden, hidden))

    def init_extra(self, init: Init) -> None:
        std = 1.0 / math.sqrt(self.wq.shape[0])
        for w in (self.wq, self.wk, self.wv, self.wo):
            init.normal(w, std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, hidden = x.shape
        q = torch.matmul(x, self.wq).reshape(seq, self.heads, self.d_k).transpose(0, 1)  # (h, s, d)
        k = torch.matmul(x, self.wk).reshape(seq, self.heads, self.d_k).permute(1, 2, 0)  # (h, d, s)
        v = torch.matmul(x, self.wv).reshape(seq, self.heads, self.d_k).transpose(0, 1)  # (h, s, d)
        y = torch.matmul(torch.matmul(q, k), v)  # (h, s, d)
        y = y.transpose(0, 1).reshape(seq, hidden)
        return torch.matmul(y, self.wo)


class TasoBert(nn.Module):
    """``layers`` stacked softmax-free attention layers on a [seq, hidden] matrix."""

    def __init__(self, s: dict):
        super().__init__()
        if s["hidden"] % s["heads"]:
            raise RLFlowError(f"taso-bert: hidden {s['hidden']} is not divisible by heads {s['heads']}")
        self.layers = nn.ModuleList(TasoAttention(s["hidden"], s["heads"]) for _ in range(s["layers"]))

    @torch.no_grad()
    def calibrate(self, inputs: dict[str, torch.Tensor]) -> None:
        """Rescale each layer's Wo so its output on the example input has unit RMS."""
        x = inputs["x"]
        for layer in self.layers:
            y = layer(x)
            scale = 1.0 / y.square().mean().sqrt()
            layer.wo.mul_(scale)  # the layer is linear in Wo: its output becomes y * scale
            x = y * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def example_inputs(sizes: dict, seed: int) -> dict[str, torch.Tensor]:
    """``x``: float32 [seq, hidden], standard normal."""
    return {"x": torch.randn((sizes["seq"], sizes["hidden"]), generator=input_generator(seed))}


MODELS = {"taso-bert": ModelSpec(TasoBert, example_inputs, DEFAULT_SIZES, TINY_SIZES, OUTPUT_NAME)}
