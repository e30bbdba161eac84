"""Device calibration: the sustained GEMM rate, memory bandwidth and per-kernel overhead of each CPU backend
(onnxruntime ``ort``, torch eager ``torch``), measured on this machine and cached per device in a JSON file.

The analytic roofline (:class:`rlflow.cost.model.AnalyticCost`) and the ``ort-cpu`` target's estimate for kernels
it has not timed use these figures; the config's ``cost.peak`` figures are only the fallback when none were
measured. How each figure is measured (``ort``: onnxruntime sessions as the evaluation makes them; ``torch``:
eager calls under ``inference_mode``):

- ``gemm_flops_per_s``: the best rate of square float32 MatMuls (512, 1024; onnxruntime: the second operand a
  weight, prepacked as a model's are) -- 2 n^3 flops each, the fastest of the timed runs: a peak, which the
  roofline bound needs (the median of the 1024 MatMul's runs, preempted on a shared 2-core machine, came out at
  half the rate of BERT's in-model Gemms);
- ``bandwidth_bytes_per_s``: the best rate of an Add of two 8 Mi-element float32 tensors (96 MiB moved, far
  beyond the caches);
- ``kernel_overhead_s``: the slope of the runtime of a chain of k tiny Relu kernels (k = 1 and 65) per kernel --
  what each extra kernel launch costs the runtime, whatever its work;
- ``profiler_overhead_s`` (``ort`` only): what onnxruntime's profiler adds to each kernel time it reports -- the
  slope of the same chains' summed profiled kernel times per kernel, less ``kernel_overhead_s`` (a few us here,
  where a tiny kernel costs 0.2 us: on BERT-sized transformer exports, with ~100 kernels of 0.01-1 ms, it is
  10-30% of the profiled total). The ``ort-cpu`` target subtracts it from every profiled kernel time. A cached
  calibration without it gets it measured and added on first use, its other figures kept.

    from rlflow.cost.calibration import load_or_measure
    cal = load_or_measure("ort")          # cached in ~/.cache/rlflow/calibration/cpu-<hardware>.json
    cal.gemm_flops_per_s, cal.bandwidth_bytes_per_s, cal.kernel_overhead_s
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from rlflow.cost.ort_session import session
from rlflow.errors import RLFlowError

CALIBRATION_FORMAT = "rlflow.calibration/1"
#: the CPU backends that can be calibrated
BACKENDS = ("ort", "torch")


@dataclass(frozen=True)
class Calibration:
    """Measured figures of one backend on one device."""

    backend: str
    """``ort`` (onnxruntime) or ``torch`` (torch eager)."""
    device: str
    """``cpu`` (the only device measured so far)."""
    hardware: str
    """The CPU model it was measured on."""
    gemm_flops_per_s: float
    """Sustained float32 GEMM rate."""
    bandwidth_bytes_per_s: float
    """Sustained memory bandwidth (bytes read + written per second) of a large element-wise op."""
    kernel_overhead_s: float
    """Time each extra kernel adds to a run, whatever its work."""
    threads: int = 0
    """Intra-op threads (0: the library's default, all cores)."""
    profiler_overhead_s: float | None = None
    """Time onnxruntime's profiler adds to each kernel time it reports (``ort``; None: not measured)."""

    def as_peak(self) -> dict[str, float]:
        """The roofline figures of the config's ``cost.peak`` form (GFLOP/s, GB/s, µs)."""
        return {"gflops": self.gemm_flops_per_s / 1e9, "gbps": self.bandwidth_bytes_per_s / 1e9,
                "launch_us": self.kernel_overhead_s * 1e6}

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "calibration") -> "Calibration":
        names = {f.name for f in fields(cls)}
        try:
            c = cls(**{k: v for k, v in d.items() if k in names})
        except TypeError as e:
            raise RLFlowError(f"{where}: malformed calibration ({e})") from None
        for k in ("gemm_flops_per_s", "bandwidth_bytes_per_s", "kernel_overhead_s", "profiler_overhead_s"):
            v = getattr(c, k)
            if v is None and k == "profiler_overhead_s":
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise RLFlowError(f"{where}: calibration field '{k}' must be a number >= 0")
        return c


# ---------------------------------------------------------------------------------------------- measuring
def _times_s(fn: Callable[[], object], warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def _median_s(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    return statistics.median(_times_s(fn, warmup, repeats))


def _best_s(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    return min(_times_s(fn, warmup, repeats))


def _ort_model(nodes, inputs, outputs, weights=None) -> bytes:
    import onnx
    from onnx import helper, numpy_helper

    g = helper.make_graph(nodes, "calibration",
                          [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, s) for n, s in inputs],
                          [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, s) for n, s in outputs],
                          [numpy_helper.from_array(a, n) for n, a in (weights or {}).items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    return model.SerializeToString()


def _measure_ort(threads: int, repeats: int) -> tuple[float, float, float, float]:
    from onnx import helper

    rng = np.random.default_rng(0)
    rate = 0.0
    for n in (512, 1024):
        b = rng.standard_normal((n, n), np.float32)
        s = session(_ort_model([helper.make_node("MatMul", ["a", "b"], ["c"])], [("a", [n, n])],
                                    [("c", [n, n])], {"b": b}), threads)
        feeds = {"a": rng.standard_normal((n, n), np.float32)}
        rate = max(rate, 2 * n ** 3 / _best_s(lambda: s.run(None, feeds), 2, repeats))
    n = 8 << 20
    s = session(_ort_model([helper.make_node("Add", ["a", "b"], ["c"])], [("a", [n]), ("b", [n])], [("c", [n])]),
                     threads)
    feeds = {"a": rng.standard_normal(n, np.float32), "b": rng.standard_normal(n, np.float32)}
    bw = 3 * 4 * n / _best_s(lambda: s.run(None, feeds), 2, max(5, repeats // 4))
    over, prof = _chain_overheads(threads, repeats)
    return rate, bw, over, prof


def _chain_overheads(threads: int, repeats: int) -> tuple[float, float]:
    """(per-kernel overhead, what the profiler adds to each kernel time it reports) in seconds, from chains of 1
    and 65 tiny Relu kernels: the slope of their run time, and of their summed profiled kernel times less it."""
    from onnx import helper

    rng = np.random.default_rng(0)
    per_chain, profiled = [], []
    for k in (1, 65):
        nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"]) for i in range(k)]
        model = _ort_model(nodes, [("v0", [16])], [(f"v{k}", [16])])
        s = session(model, threads)
        feeds = {"v0": rng.standard_normal(16, np.float32)}
        per_chain.append(_median_s(lambda: s.run(None, feeds), 20, 4 * repeats))
        profiled.append(_profiled_kernels_s(model, feeds, 20, 4 * repeats, threads))
    over = max(0.0, (per_chain[1] - per_chain[0]) / 64)
    return over, max(0.0, (profiled[1] - profiled[0]) / 64 - over)


def _profiled_kernels_s(model: bytes, feeds, warmup: int, repeats: int, threads: int) -> float:
    """The median over runs of the summed kernel times onnxruntime's profiler reports for ``model``."""
    import bisect

    from rlflow.cost.ort_session import profiled_runs

    events, starts, _ = profiled_runs(model, feeds, warmup, repeats, threads)
    per_run = [0.0] * len(starts)
    for e in events:
        per_run[bisect.bisect_right(starts, e["ts"]) - 1] += e["dur"] * 1e-6
    return statistics.median(per_run[warmup:] or per_run)


def _measure_torch(threads: int, repeats: int) -> tuple[float, float, float, None]:
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            g = torch.Generator().manual_seed(0)
            rate = 0.0
            for n in (512, 1024):
                a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
                rate = max(rate, 2 * n ** 3 / _best_s(lambda: torch.matmul(a, b), 2, repeats))
            n = 8 << 20
            a, b, c = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.empty(n)
            bw = 3 * 4 * n / _best_s(lambda: torch.add(a, b, out=c), 2, max(5, repeats // 4))
            x = torch.randn(16, generator=g)

            def chain(k):
                def run():
                    y = x
                    for _ in range(k):
                        y = torch.relu(y)
                    return y
                return run

            t1, t65 = (_median_s(chain(k), 20, 4 * repeats) for k in (1, 65))
    finally:
        torch.set_num_threads(old)
    return rate, bw, max(0.0, (t65 - t1) / 64), None


def measure(backend: str, device: str = "cpu", threads: int = 0, repeats: int = 20) -> Calibration:
    """Measure one backend's figures now (a few seconds)."""
    from rlflow.cost.model import describe_hardware

    if backend not in BACKENDS:
        raise RLFlowError(f"unknown calibration backend '{backend}' (choose from {', '.join(BACKENDS)})")
    if device != "cpu":
        raise RLFlowError(f"calibration measures CPU backends; device '{device}' is not one (a GPU target is "
                          "timed per op with CUDA events, or simulated)")
    rate, bw, over, prof = (_measure_ort if backend == "ort" else _measure_torch)(threads, repeats)
    return Calibration(backend, device, describe_hardware(device), rate, bw, over, threads, prof)


# ---------------------------------------------------------------------------------------------- the cache
def default_path(device: str = "cpu") -> Path:
    """``$RLFLOW_CACHE_DIR`` (else ``~/.cache/rlflow``) ``/calibration/<device>-<hardware>.json``."""
    from rlflow.cost.model import describe_hardware

    root = Path(os.environ.get("RLFLOW_CACHE_DIR") or Path.home() / ".cache" / "rlflow")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", describe_hardware(device)).strip("-").lower() or "unknown"
    return root / "calibration" / f"{device}-{slug}.json"


def read(path: str | Path) -> dict[str, Calibration]:
    """The calibrations in ``path``: a calibration file, or a cost cache with a ``calibration`` section.
    A missing file is an empty dict; a damaged one a one-line error."""
    p = Path(path)
    if not p.exists():
        return {}
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise RLFlowError(f"{p}: not a calibration or cost cache file ({e.__class__.__name__})") from None
    section = data.get("calibration", {}) if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise RLFlowError(f"{p}: 'calibration' must map backend names to measured figures")
    return {b: Calibration.from_dict(d, f"{p}: backend '{b}'") for b, d in section.items()}


def to_json(cals: Mapping[str, Calibration]) -> dict:
    return {b: asdict(c) for b, c in sorted(cals.items())}


def write(path: str | Path, cals: Mapping[str, Calibration]) -> None:
    from rlflow.atomic import write_text

    write_text(path, json.dumps({"format": CALIBRATION_FORMAT, "calibration": to_json(cals)}, indent=1) + "\n")


def load_or_measure(backend: str = "ort", device: str = "cpu", path: str | Path | None = None,
                    remeasure: bool = False, threads: int = 0) -> Calibration:
    """The backend's calibration from ``path`` (default :func:`default_path`), measured and saved there first
    when the file lacks it (or ``remeasure``). One measured on other hardware is measured again."""
    from rlflow.cost.model import describe_hardware

    p = Path(path) if path is not None else default_path(device)
    cals = read(p)
    c = cals.get(backend)
    stale = c is None or remeasure or c.hardware != describe_hardware(device) or c.threads != threads
    if stale or (backend == "ort" and c.profiler_overhead_s is None):
        print(f"rlflow: calibrating {backend} on {device} ({describe_hardware(device)}) -> {p}", file=sys.stderr)
        if stale:
            c = measure(backend, device, threads)
        else:  # a file from before the profiler's overhead was measured: add it, keep the rest
            c = replace(c, profiler_overhead_s=_chain_overheads(threads, 20)[1])
        cals[backend] = c
        if p.is_dir():
            raise RLFlowError(f"{p}: is a folder, expected a calibration file (.json)")
        if p.exists() and json.loads(p.read_text()).get("format") != CALIBRATION_FORMAT:
            raise RLFlowError(f"{p}: a cost cache without this calibration: re-run `rlflow measure-costs`")
        write(p, cals)
    return c
