"""How far a graph's measured latency is from the limit (issue G, item 5): its roofline lower bound at the
device's measured figures, and the share of the latency that any rewrite could still win.

The device's figures come from :mod:`rlflow.cost.calibration` (measured once per device and cached; the cost
model uses the same ones): the sustained float32 GEMM rate and memory bandwidth. Of the calibrated CPU backends
the best figure is the device's (a limit any backend could reach), so every backend's row is compared with the
same bound.

The bound of one graph is ``max(flops / gemm_rate, essential_bytes / bandwidth)``:

- ``flops``: the graph's floating-point operations (the cost model's count; weight-only subgraphs, folded before
  running, count nothing);
- ``essential_bytes`` (:func:`rlflow.cost.model.essential_bytes`, the bound ``rlflow cost`` prints too): what
  any execution of the graph must move at least once -- its inputs, its outputs and the weights its computing
  nodes read (the folded weight values; of a table only gathered from, the rows gathered); intermediate tensors
  count nothing, since a perfect fusion would keep them in registers or cache.

No rewrite that preserves the graph's arithmetic can run below it, so ``headroom = 1 - bound / latency`` is an
upper limit on what rewriting could still win on that backend; a FLOP-reducing rewrite lowers the bound itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from rlflow.cost.calibration import Calibration
from rlflow.cost.model import essential_bytes  # noqa: F401 -- (re-exported: the bound's bytes)
from rlflow.graph.ir import Graph


@dataclass(frozen=True)
class DeviceLimits:
    """The device's sustained figures the bound is computed at."""

    gemm_flops_per_s: float
    bandwidth_bytes_per_s: float
    source: str
    """Where they come from (``ort`` / ``torch`` calibration, the cache file)."""

    @classmethod
    def from_calibrations(cls, cals: Mapping[str, Calibration], where: str) -> "DeviceLimits | None":
        """The best GEMM rate and bandwidth over the calibrated backends; None when there is none."""
        if not cals:
            return None
        gemm = max(cals.values(), key=lambda c: c.gemm_flops_per_s)
        bw = max(cals.values(), key=lambda c: c.bandwidth_bytes_per_s)
        return cls(gemm.gemm_flops_per_s, bw.bandwidth_bytes_per_s,
                   f"GEMM: {gemm.backend} calibration, bandwidth: {bw.backend} calibration ({where})")

    def as_dict(self) -> dict:
        return {"gemm_gflops": self.gemm_flops_per_s / 1e9, "bandwidth_gbps": self.bandwidth_bytes_per_s / 1e9,
                "source": self.source}


def graph_flops(graph: Graph) -> float:
    """The graph's floating-point operations, as every cost model counts them."""
    from rlflow.cost.model import AnalyticCost

    return AnalyticCost("cpu").graph_metrics(graph).flops


def bound_ms(graph: Graph, limits: DeviceLimits) -> float:
    """The graph's roofline lower bound (ms) at the device's figures."""
    return max(graph_flops(graph) / limits.gemm_flops_per_s,
               essential_bytes(graph) / limits.bandwidth_bytes_per_s) * 1e3


def headroom(bound: float | None, latency_ms: float | None) -> float | None:
    """``1 - bound / latency``: the share of the measured latency above the bound (None without both)."""
    if bound is None or not latency_ms:
        return None
    return 1.0 - bound / latency_ms


def device_limits(device: str, costs: Path | None) -> DeviceLimits | None:
    """The device's limits: from the cost cache's calibration section (``costs``, the pipeline's
    ``results/costs/<device>/<model>.json``), else the per-device calibration cache (measured there first if
    missing, a few seconds). None on a device the calibration does not measure (a GPU)."""
    from rlflow.cost import calibration

    if device != "cpu":
        return None
    if costs is not None:
        cals = calibration.read(costs)
        if cals:
            return DeviceLimits.from_calibrations(cals, str(costs))
    path = calibration.default_path(device)
    return DeviceLimits.from_calibrations({"ort": calibration.load_or_measure("ort", device, path)}, str(path))
