"""Executors: run a graph end to end on a backend and time it.

Backends: ``ort`` (onnxruntime on the exported ONNX; CUDA provider when device is cuda), ``torch`` (the IR
interpreted with the ops' torch reference semantics), ``tf`` (a ``tf.function`` built op by op, Grappler on)
and ``tf-xla`` (the same with ``jit_compile=True``). Every runner is a callable ``feeds -> list of outputs``
(numpy arrays, in the graph's output order).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from rlflow.errors import RLFlowError
from rlflow.graph.ir import Graph

BACKENDS = ("ort", "torch", "tf", "tf-xla")

Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


def make_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for ``graph``: floats ~ N(0, 1); integer inputs in the valid index range of the Gather
    that reads them (e.g. token ids below the vocabulary size), else in [0, 2); booleans uniform."""
    rng = np.random.default_rng(seed)
    feeds = {}
    cons = graph.consumers()
    for name in graph.inputs:
        t = graph.types[name]
        if t.dtype.startswith("float"):
            feeds[name] = rng.standard_normal(t.shape).astype(t.dtype)
        elif t.dtype == "bool":
            feeds[name] = rng.integers(0, 2, t.shape).astype(bool)
        else:
            bound = 2
            limits = [graph.types[graph.nodes[i].inputs[0]].shape[graph.nodes[i].attrs["axis"]]
                      for i in cons.get(name, []) if graph.nodes[i].op == "Gather" and graph.nodes[i].inputs[1] == name]
            if limits:
                bound = min(limits)
            feeds[name] = rng.integers(0, bound, t.shape).astype(t.dtype)
    return feeds


def get_runner(graph: Graph, backend: str, device: str = "cpu") -> Runner:
    if backend == "ort":
        from rlflow.graph.exec.ort_exec import OrtRunner

        return OrtRunner(graph, device)
    if backend == "torch":
        from rlflow.graph.exec.torch_exec import TorchRunner

        return TorchRunner(graph, device)
    if backend in ("tf", "tf-xla"):
        from rlflow.graph.exec.tf_exec import TFRunner

        return TFRunner(graph, device, xla=backend == "tf-xla")
    raise RLFlowError(f"unknown backend '{backend}' (choose from {', '.join(BACKENDS)})")


def time_runner(runner: Runner, feeds: dict[str, np.ndarray], warmup: int = 5, repeats: int = 20) -> dict:
    """Latency of ``runner(feeds)``: ``warmup`` untimed calls, then ``repeats`` timed ones.
    Returns median and interquartile range in milliseconds, and the runner's peak memory where it can tell."""
    if repeats < 1:
        raise RLFlowError("repeats must be >= 1")
    for _ in range(warmup):
        runner(feeds)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner(feeds)
        times.append((time.perf_counter() - t0) * 1e3)
    q1, med, q3 = np.percentile(times, [25, 50, 75])
    peak = getattr(runner, "peak_memory_bytes", lambda: None)()
    return {"median_ms": float(med), "iqr_ms": float(q3 - q1), "min_ms": float(min(times)), "repeats": repeats,
            "warmup": warmup, "peak_memory_bytes": peak}


def max_rel_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """max |a - b| / max(1, max |a|) over all outputs (the project's output-equality measure)."""
    worst = 0.0
    for x, y in zip(a, b):
        x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x64.shape != y64.shape:
            return float("inf")
        if x64.size == 0:
            continue
        scale = max(1.0, float(np.max(np.abs(x64))))
        worst = max(worst, float(np.max(np.abs(x64 - y64))) / scale)
    return worst
