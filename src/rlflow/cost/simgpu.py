"""Simulated GPU targets (``sim-v100``, ``sim-a100``, ``sim-h100``): the batch-1 landscape of the papers, where
kernel launches and SM occupancy dominate, computed from a GPU's published spec figures (config ``cost.gpus``).

Per kernel: ``launch + max(flops / (peak x efficiency), bytes / bandwidth)``.

- **Efficiency** of a GEMM or a convolution (an implicit GEMM: M = batch x output pixels, N = output channels
  per group, K = input channels per group x kernel area, one GEMM per group) comes from tile and wave
  quantisation: the output is cut into tiles of one of :data:`TILES` (each with the share of an SM's peak such a
  tile reaches), optionally split along K (:data:`SPLIT_K`) when M x N alone cannot fill the GPU; the tiles run
  in waves of one tile per SM, so ``efficiency = tile share x useful fraction of the tiles x tiles / (waves x
  SMs)``; the best choice is taken, as cuBLAS's heuristics pick a kernel. Every other op is bandwidth-bound
  (efficiency 1: its flops are few).
- **Attention** (the fused op) moves what a flash-style kernel moves: Q, K, V, the mask and the output, never the
  score matrix (its OpDef's bytes); its efficiency is that of its first GEMM, Q K^T, per batch and head.
- **Data-movement-only ops are free**, as in TASO's cost model: Reshape, Flatten, Identity, Transpose, Split,
  Slice and Concat launch nothing and cost nothing (a producer can write straight into its consumer's layout or
  buffer). Weight-only nodes are folded (free) as for every target.

Everything a simulated target computes is labelled ``simulated <GPU>`` where it is printed: no GPU ran it.
"""

from __future__ import annotations

import math
from typing import Mapping

from rlflow.cost.model import CostModel
from rlflow.errors import RLFlowError
from rlflow.graph.ir import Node, TensorType
from rlflow.graph.ops import OPS
from rlflow.graph.ops.attention import dims as attention_dims

#: ops that only move or re-view data: free on a simulated GPU (TASO's cost model)
DATA_MOVEMENT = frozenset({"Reshape", "Flatten", "Identity", "Transpose", "Split", "Slice", "Concat"})

#: output tiles (rows, columns, share of one SM's peak a tile of that size sustains): model parameters of the
#: quantisation model, in the spirit of CUTLASS's threadblock shapes (large tiles reuse operands best)
TILES = ((128, 128, 1.0), (128, 64, 0.9), (64, 64, 0.75), (64, 32, 0.6), (32, 32, 0.45))
#: split-K factors tried when the output alone gives too few tiles (each split keeps K / split >= 128)
SPLIT_K = (1, 2, 4, 8, 16)


def gemm_efficiency(m: int, n: int, k: int, batch: int, sms: int) -> float:
    """Fraction of the GPU's peak a ``batch`` x (m x k @ k x n) GEMM reaches (tile and wave quantisation)."""
    best = 0.0
    for tm, tn, share in TILES:
        tiles_mn = math.ceil(m / tm) * math.ceil(n / tn)
        useful = (m * n) / (tiles_mn * tm * tn)
        for s in SPLIT_K:
            if s > 1 and k / s < 128:
                break
            tiles = batch * tiles_mn * s
            waves = math.ceil(tiles / sms)
            best = max(best, share * useful * tiles / (waves * sms))
    return best


def gemm_shape(node: Node, in_types: list[TensorType]) -> tuple[int, int, int, int] | None:
    """(M, N, K, batch) of a MatMul, Gemm or Conv node, or of an Attention node's Q K^T; None for other ops."""
    if node.op == "MatMul":
        a, b = in_types[0].shape, in_types[1].shape
        if len(a) < 2 or len(b) < 1:
            return None
        m, k = (a[-2], a[-1])
        n = b[-1] if len(b) >= 2 else 1
        batch = math.prod(a[:-2]) if len(a) > 2 else 1
        batch = max(batch, math.prod(b[:-2]) if len(b) > 2 else 1)
        return m, n, k, batch
    if node.op == "Gemm":
        a, b = in_types[0].shape, in_types[1].shape
        m, k = (a[1], a[0]) if node.attrs.get("transA") else (a[0], a[1])
        n = b[0] if node.attrs.get("transB") else b[1]
        return m, n, k, 1
    if node.op == "Conv":
        x, w = in_types[0].shape, in_types[1].shape
        g = int(node.attrs.get("group", 1))
        strides = node.attrs.get("strides") or (1,) * (len(x) - 2)
        pads = node.attrs.get("pads") or (0,) * (2 * (len(x) - 2))
        spatial = len(x) - 2
        out = [(x[2 + i] + pads[i] + pads[i + spatial] - w[2 + i]) // strides[i] + 1 for i in range(spatial)]
        return x[0] * math.prod(out), w[0] // g, w[1] * math.prod(w[2:]), g
    if node.op == "Attention":
        b, hq, _, sq, skv, d, _ = attention_dims(in_types, node.attrs)
        return sq, skv, d, b * hq
    return None


class SimGpuCost(CostModel):
    """A simulated GPU from its spec figures (see the module docstring)."""

    def __init__(self, gpu: str, spec: Mapping):
        for k in ("tflops_fp32", "gbps", "sms", "launch_us"):
            v = spec.get(k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > (0 if k != "launch_us" else -1):
                raise RLFlowError(f"config key cost.gpus.{gpu}.{k}: needs a positive number, got {v!r}")
        super().__init__("cuda", {"gflops": spec["tflops_fp32"] * 1e3, "gbps": float(spec["gbps"]),
                                  "launch_us": float(spec["launch_us"])})
        self.gpu, self.spec = gpu, dict(spec)
        self.sms = int(spec["sms"])
        self.name = f"sim-{gpu}"
        self.label = f"simulated {gpu.upper()}"

    def _launches(self, node: Node) -> int:
        return 0 if node.op in DATA_MOVEMENT else super()._launches(node)

    def efficiency(self, node: Node, in_types: list[TensorType]) -> float:
        shape = gemm_shape(node, in_types)
        if shape is None:
            return 1.0
        return max(gemm_efficiency(*shape, self.sms), 1e-3)

    def _runtime(self, node, in_types, flops, nbytes):
        eff = self.efficiency(node, in_types)
        compute = flops / (self.peak["gflops"] * 1e9 * eff)
        memory = nbytes / (self.peak["gbps"] * 1e9)
        return max(compute, memory) * 1e3 + self.peak["launch_us"] * 1e-3

    def describe(self):
        return {**super().describe(), "gpu": self.spec.get("name", self.gpu), "sms": self.sms,
                "source": self.spec.get("source"), "simulated": True}


assert DATA_MOVEMENT <= set(OPS)  # noqa: S101 -- the registry names every op listed here
