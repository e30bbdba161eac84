"""Whole-model runs of a graph on the GPU, taken apart per node: what a calibrated GPU target learns from.

The torch backend runs the IR op by op (:class:`rlflow.graph.exec.torch_exec.TorchRunner`): at batch 1 on a GPU
its end-to-end time is set as much by the host (each op's Python and dispatch work, the kernel launches) as by
the kernels. Timing each op alone with CUDA events (the ``cuda`` target, TASO's way) sees only the kernels; this
module measures both inside whole-model runs:

- ``e2e_ms``: wall time of whole runs (synchronised at the end of each), after warm-ups;
- ``host_us`` per node: the host time of the node's call inside a whole run (no synchronisation per node, so the
  GPU runs behind as it does in a real run); the median over runs;
- ``device_us`` and ``kernels`` per node: the summed durations and the number of the GPU kernels the node
  launched, from torch's profiler (each node wrapped in a ``record_function`` range); the median over runs;
- ``gpu_busy_ms`` / ``gpu_span_ms`` per profiled run: the union of the kernel intervals and the time from the
  first kernel's start to the last one's end (their difference is the GPU idling between kernels).

On a CPU device the same runs give host times and no kernels (the tests run it so).

    from rlflow.cost.gpu_profile import profile_graph
    rec = profile_graph(graph, "cuda")            # {"e2e_ms": [...], "nodes": [{"op", "sig", "host_us", ...}]}
"""

from __future__ import annotations

import gc
import statistics
import time

from rlflow.cost.model import signature
from rlflow.graph.ir import Graph
from rlflow.graph.ops import node_bytes, node_flops

PROFILE_FORMAT = "rlflow.gpu-profile/1"
RANGE = "rlflow.node."


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_us(event) -> tuple[float, int]:
    """(summed kernel microseconds, kernel count) launched under a profiler event, its children included."""
    total, count = 0.0, 0
    stack = [event]
    while stack:
        e = stack.pop()
        for k in getattr(e, "kernels", None) or ():
            total += float(k.duration)
            count += 1
        stack.extend(getattr(e, "cpu_children", None) or ())
    return total, count


def is_device_event(e) -> bool:
    """A profiler event that ran on the GPU (a kernel or a copy), not on the host."""
    return "CUDA" in str(getattr(e, "device_type", "")).upper()


def _busy(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(busy, span) in the intervals' unit: the length of their union and from the first start to the last end."""
    if not intervals:
        return 0.0, 0.0
    intervals.sort()
    busy, (start, end) = 0.0, intervals[0]
    first = start
    last = end
    for s, e in intervals[1:]:
        last = max(last, e)
        if s > end:
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return busy + end - start, last - first


def profile_graph(graph: Graph, device: str = "cuda", runs: int = 20, profiled: int = 3, warmup: int = 5,
                  seed: int = 0) -> dict:
    """Whole-model runs of ``graph`` with the torch backend on ``device``, taken apart per node (module
    docstring). ``graph`` should have its weight-only nodes folded, as every method writes its graph. The
    garbage collector is off during the runs."""
    gc.collect()
    gc.disable()  # no collection pauses inside the timed runs (the profiler's events are cyclic garbage)
    try:
        return _profile(graph, device, runs, profiled, warmup, seed)
    finally:
        gc.enable()
        gc.collect()


def _profile(graph: Graph, device: str, runs: int, profiled: int, warmup: int, seed: int) -> dict:
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from rlflow.graph.exec import make_inputs
    from rlflow.graph.exec.torch_exec import TorchRunner

    runner = TorchRunner(graph, device)
    dev = runner.device
    feeds = {k: torch.from_numpy(np.asarray(v)).to(dev) for k, v in make_inputs(graph, seed).items()}
    for _ in range(warmup):
        runner.run_tensors(feeds)
    _sync(dev)

    e2e = []
    for _ in range(runs):
        t0 = time.perf_counter()
        runner.run_tensors(feeds)
        _sync(dev)
        e2e.append((time.perf_counter() - t0) * 1e3)

    n = len(graph.nodes)
    host = [[0.0] * runs for _ in range(n)]

    def timed(r):
        def around(i, call):
            t0 = time.perf_counter()
            out = call()
            host[i][r] = (time.perf_counter() - t0) * 1e6
            return out
        return around

    for r in range(runs):
        runner.run_tensors(feeds, around=timed(r))
        _sync(dev)

    def ranged(i, call):
        with record_function(f"{RANGE}{i}"):
            return call()

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    dev_us = [[] for _ in range(n)]
    kernels = [[] for _ in range(n)]
    busy, span = [], []
    for _ in range(profiled):
        with profile(activities=activities) as prof:
            runner.run_tensors(feeds, around=ranged)
            _sync(dev)
        events = prof.events()
        spans = []
        for e in events:
            if is_device_event(e):
                if not e.name.startswith(RANGE):  # the GPU-side copy of a user range is no kernel
                    spans.append((float(e.time_range.start), float(e.time_range.end)))
                continue
            if e.name.startswith(RANGE):
                us, k = _device_us(e)
                i = int(e.name[len(RANGE):])
                dev_us[i].append(us)
                kernels[i].append(k)
        b, s = _busy(spans)
        busy.append(b / 1e3)
        span.append(s / 1e3)

    types = graph.types
    nodes = []
    for i, node in enumerate(graph.nodes):
        ins = [types[v] for v in node.inputs if v]
        outs = [types[v] for v in node.outputs]
        nodes.append({"op": node.op, "sig": signature(node, ins), "flops": float(node_flops(node, ins, outs)),
                      "bytes": float(node_bytes(node, ins, outs)),
                      "host_us": statistics.median(host[i]),
                      "device_us": statistics.median(dev_us[i]) if dev_us[i] else 0.0,
                      "kernels": int(statistics.median(kernels[i])) if kernels[i] else 0})
    return {"device": str(dev), "e2e_ms": e2e, "gpu_busy_ms": busy, "gpu_span_ms": span, "nodes": nodes}


def combine(records: list[dict]) -> dict:
    """One record from several :func:`profile_graph` records of the same graph (taken at different times): the
    end-to-end and GPU-busy runs pooled, each node's figures the median over the records."""
    first = records[0]
    nodes = []
    for i, node in enumerate(first["nodes"]):
        each = [r["nodes"][i] for r in records]
        nodes.append({**node, "host_us": statistics.median(n["host_us"] for n in each),
                      "device_us": statistics.median(n["device_us"] for n in each),
                      "kernels": int(statistics.median(n["kernels"] for n in each))})
    pooled = {k: [x for r in records for x in r[k]] for k in ("e2e_ms", "gpu_busy_ms", "gpu_span_ms")}
    return {"device": first["device"], **pooled, "nodes": nodes, "rounds": len(records)}
