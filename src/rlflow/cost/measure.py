"""Time one op on a device: random inputs of its input types, ``warmup`` untimed runs, then the median of
``repeats`` timed runs (CUDA events on a GPU, ``perf_counter`` on the CPU), as TASO measures each operator."""

from __future__ import annotations

import statistics
import time

import numpy as np

from rlflow.graph.ir import Graph, Node
from rlflow.graph.ops import OPS


def _input(graph: Graph, name: str, device, rng: np.random.Generator):
    import torch

    if name in graph.constants:  # real weights where the graph has them (shape-carrying ints stay valid)
        return torch.from_numpy(np.array(graph.constants[name].array)).to(device)
    t = graph.types[name]
    if t.dtype.startswith("float"):
        return torch.from_numpy(rng.standard_normal(t.shape).astype(t.dtype)).to(device)
    return torch.zeros(t.shape, dtype=getattr(torch, "bool" if t.dtype == "bool" else t.dtype), device=device)


def time_node(graph: Graph, node: Node, device: str = "cpu", warmup: int = 8, repeats: int = 32) -> float:
    """Median runtime of ``node`` (ms). Opaque nodes run through a single-node onnxruntime session.
    An error of torch or onnxruntime is a one-line error naming the node (:class:`NodeRunError`)."""
    from rlflow.graph.exec import NodeRunError, error_message

    try:
        return _time_node(graph, node, device, warmup, repeats)
    except NodeRunError:
        raise
    except Exception as e:  # noqa: BLE001 -- torch's and onnxruntime's own error types
        raise NodeRunError(node, "ort" if node.op == "Opaque" else "torch", error_message(e)) from None


def _time_node(graph: Graph, node: Node, device: str, warmup: int, repeats: int) -> float:
    import torch

    dev = torch.device(device)
    rng = np.random.default_rng(0)
    xs = [_input(graph, v, dev, rng) for v in node.inputs if v]
    if node.op == "Opaque":
        from rlflow.graph.exec.torch_exec import _OpaqueNode

        fn = _OpaqueNode(graph, node)
    else:
        compute = OPS[node.op].compute
        fn = lambda xs: compute(xs, node.attrs)  # noqa: E731
    cuda = dev.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True  # cuDNN picks its fastest algorithm during the warm-up, as TASO
    times = []
    with torch.inference_mode():
        for _ in range(warmup):
            fn(xs)
        for _ in range(repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(xs)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn(xs)
                times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))
