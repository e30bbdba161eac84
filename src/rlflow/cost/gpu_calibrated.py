"""Calibrated GPU targets (``sim-h200``): a GPU's cost as measured inside whole-model runs on that GPU, so that a
CPU box estimates what the GPU will run end to end.

What the torch backend runs on a GPU at batch 1, op by op, is set as much by the host (each op's Python and
dispatch work, its kernel launches) as by the kernels: on a lent H200, paper-size BERT's 412 ops took 7.9 ms of
host time and 2.1 ms of kernel time in an 8.8 ms run. The ``cuda`` target (each op timed alone with CUDA events)
sees only the kernels and the spec-sheet ``sim-h100`` a fixed 5 us launch per kernel. A calibrated target sums,
per node, the larger of its host time and its kernel time, plus the backend's per-node loop overhead:

    node ms = (max(host_us, device_us) + loop_us) / 1000

``host_us`` and ``device_us`` come from the calibration file's table of op signatures (op, attributes, input
types: :func:`rlflow.cost.model.signature`), measured inside whole-model runs by
:func:`rlflow.cost.gpu_profile.profile_graph`; a signature it lacks takes its op type's median host time (else
the median of all ops) and a roofline kernel time from the rates fitted to the measured kernels.

The files live in ``rlflow/cost/gpus/<gpu>.json`` (format ``rlflow.gpu-calibration/1``), made by
``benchmarks/gpu_calibrate.py --fit`` from the recorded profiles of GPU checks; each names the GPU it was measured on,
the dates and the software. A file can pool the profiles of several GPU checks (lent machines of one GPU model
ran the same graphs 1.1-2.1x apart). Host times are normalised per profile (each profile's host times are divided
by its nodes' median ratio to the op types' medians), so the figures are those of a typical machine; a graph that
runs slower than its profile's typical node keeps that, since it is the graph's doing (inceptionv3's greedy graph,
70 Splits and 63 Concats, ran 5% slower than the original on every lent H200).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from rlflow.cost.model import CostModel, signature
from rlflow.errors import RLFlowError
from rlflow.jsondoc import read_document

CALIBRATION_FORMAT = "rlflow.gpu-calibration/1"
GPUS_DIR = Path(__file__).parent / "gpus"
#: ops whose kernels do the work at the GEMM rate (the rest move bytes)
GEMM_OPS = frozenset({"MatMul", "Gemm", "Conv", "Attention"})


def calibrated_gpus() -> tuple[str, ...]:
    """The GPUs with a calibration file (``h200``: target ``sim-h200``)."""
    return tuple(sorted(p.stem for p in GPUS_DIR.glob("*.json")))


def calibration_path(gpu: str) -> Path:
    return GPUS_DIR / f"{gpu}.json"


def gpu_of_device(name: str) -> str | None:
    """The calibrated GPU whose file was measured on a device of this name (``NVIDIA H200`` -> ``h200``)."""
    for gpu in calibrated_gpus():
        if load(calibration_path(gpu)).get("hardware") == name:
            return gpu
    return None


def load(path: str | Path) -> dict:
    """A calibration file, checked; one-line RLFlowError naming the file and what is wrong."""
    p = Path(path)
    doc = read_document(p, CALIBRATION_FORMAT, "a GPU calibration")
    for key in ("hardware", "loop_us", "default_host_us", "op_host_us", "signatures", "device"):
        if key not in doc:
            raise RLFlowError(f"{p}: GPU calibration without '{key}'")
    dev = doc["device"]
    if not all(isinstance(dev.get(k), (int, float)) and dev[k] > 0 for k in ("gemm_flops_per_us", "bytes_per_us")):
        raise RLFlowError(f"{p}: GPU calibration's device rates must be positive numbers")
    return doc


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def host_scales(graphs: Mapping[str, dict], rounds: int = 5) -> dict[str, float]:
    """Per group of nodes (``{key: {"nodes": [...]}}``: :func:`fit` passes one group per profile): how much slower
    than typical its host ran (1.0 = the median group), from the median of its nodes' host times over their op
    types' medians (iterated, since the medians depend on the scales)."""
    scale = {k: 1.0 for k in graphs}
    for _ in range(rounds):
        by_op = defaultdict(list)
        for k, g in graphs.items():
            for n in g["nodes"]:
                by_op[n["op"]].append(n["host_us"] / scale[k])
        med = {op: statistics.median(v) for op, v in by_op.items()}
        for k, g in graphs.items():
            ratios = [n["host_us"] / med[n["op"]] for n in g["nodes"] if med[n["op"]] > 0]
            scale[k] = statistics.median(ratios) if ratios else 1.0
        mid = statistics.median(scale.values())
        scale = {k: v / mid for k, v in scale.items()}
    return scale


def fit(profiles: Mapping | Sequence[Mapping], exclude: Iterable[str] = ()) -> dict:
    """A calibration from one recorded profile (``benchmarks/gpu_calibrate.py --from``'s output) or several of
    one GPU model pooled, leaving out the graphs whose name starts with one of ``exclude`` (held out to test it)."""
    profiles = [profiles] if isinstance(profiles, Mapping) else list(profiles)
    exclude = tuple(exclude)
    hardware = {p["hardware"] for p in profiles}
    if len(hardware) != 1:
        raise RLFlowError(f"cannot pool profiles of different GPUs: {', '.join(sorted(hardware))}")
    # each graph of each profile on its own (the same graph measured in two sessions is two measurements)
    graphs = {(i, k): g for i, p in enumerate(profiles) for k, g in p["graphs"].items()
              if not any(k.startswith(e) for e in exclude)}
    if not graphs:
        raise RLFlowError("no profiled graphs to calibrate from")
    # one host speed per profile (a lent machine's host ran its graphs up to 2.1x slower than another's); a graph
    # that runs slower than its profile's typical node keeps that (it is the graph, not the machine)
    sessions = {i: {"nodes": [n for (j, _), g in graphs.items() if j == i for n in g["nodes"]]}
                for i in {i for i, _ in graphs}}
    scale = host_scales(sessions)
    host, dev, by_op = defaultdict(list), defaultdict(list), defaultdict(list)
    loops, small, gemm_rates, byte_rates = [], [], [], []
    for k, g in graphs.items():
        for n in g["nodes"]:
            h = n["host_us"] / scale[k[0]]
            host[n["sig"]].append(h)
            dev[n["sig"]].append(n["device_us"])
            by_op[n["op"]].append(h)
        loops.append((statistics.median(g["e2e_ms"]) * 1e3 - sum(n["host_us"] for n in g["nodes"])) / len(g["nodes"]))
        for n in g["nodes"]:
            if n["kernels"] and n["device_us"] > 0:
                small.append(n["device_us"] / n["kernels"])
    launch = _percentile(small, 0.1) if small else 0.0  # a kernel's least time: launch and ramp (none on a CPU)
    for g in graphs.values():
        for n in g["nodes"]:
            work = n["device_us"] - launch * n["kernels"]
            if work > 5:  # kernels long enough for their rate to show
                (gemm_rates if n["op"] in GEMM_OPS else byte_rates).append(
                    (n["flops"] if n["op"] in GEMM_OPS else n["bytes"]) / work)
    sigs = {s: {"host_us": round(statistics.median(v), 3), "device_us": round(statistics.median(dev[s]), 3),
                "runs": len(v)} for s, v in host.items()}
    newest = profiles[-1]
    return {"format": CALIBRATION_FORMAT, "hardware": newest["hardware"], "torch": newest.get("torch"),
            "cuda": newest.get("cuda"),
            "measured": ", ".join(str(p.get("measured")) for p in profiles), "profiles": len(profiles),
            "graphs": sorted({k for _, k in graphs}), "loop_us": round(max(0.0, statistics.median(loops)), 3),
            "default_host_us": round(statistics.median([h for v in by_op.values() for h in v]), 3),
            "op_host_us": {op: round(statistics.median(v), 3) for op, v in sorted(by_op.items())},
            "device": {"launch_us": round(launch, 3),
                       "gemm_flops_per_us": round(_percentile(gemm_rates, 0.9), 1) if gemm_rates else 1e7,
                       "bytes_per_us": round(_percentile(byte_rates, 0.9), 1) if byte_rates else 1e6},
            "signatures": dict(sorted(sigs.items()))}


class CalibratedGpuCost(CostModel):
    """A GPU as its calibration file measured it (module docstring). Every node costs its host time, the views
    (Reshape, Transpose, ...) too: the torch backend calls each one."""

    def __init__(self, gpu: str, doc: Mapping):
        super().__init__("cuda")
        self.gpu, self.doc = gpu, doc
        self.sigs = doc["signatures"]
        self.op_host = doc["op_host_us"]
        self.dev = doc["device"]
        self.name = f"sim-{gpu}"
        self.label = f"calibrated {gpu.upper()}"

    def _launches(self, node) -> int:
        return 1

    def _runtime(self, node, in_types, flops, nbytes):
        hit = self.sigs.get(signature(node, in_types))
        if hit is not None:
            host, dev = hit["host_us"], hit["device_us"]
        else:
            host = self.op_host.get(node.op, self.doc["default_host_us"])
            rate = flops / self.dev["gemm_flops_per_us"] if node.op in GEMM_OPS else nbytes / self.dev["bytes_per_us"]
            dev = self.dev["launch_us"] + rate
        return (max(host, dev) + self.doc["loop_us"]) * 1e-3

    def describe(self):
        return {**super().describe(), "gpu": self.doc["hardware"], "calibrated": True, "simulated": True,
                "measured": self.doc.get("measured"), "signatures": len(self.sigs)}


def calibrated_cost(gpu: str) -> CalibratedGpuCost:
    return CalibratedGpuCost(gpu, load(calibration_path(gpu)))
