"""torch backend: interpret the IR node by node with each op's torch reference semantics.

Weights are moved to the device once; intermediate tensors are released after their last use. Opaque nodes
(ops outside the registry) are run by onnxruntime, one single-node session each, on the CPU.
"""

from __future__ import annotations

import numpy as np

from rlflow.graph.ir import Graph, Node
from rlflow.graph.ops import OPS


class _OpaqueNode:
    """One opaque node as a single-node onnxruntime session."""

    def __init__(self, graph: Graph, node: Node):
        import onnxruntime as ort

        from rlflow.graph.onnx_io import single_node_model

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(single_node_model(graph, node).SerializeToString(), opts,
                                            providers=["CPUExecutionProvider"])
        self.inputs, self.outputs = [v for v in node.inputs if v], list(node.outputs)

    def __call__(self, xs):
        import torch

        feeds = {k: x.detach().cpu().numpy() for k, x in zip(self.inputs, xs)}
        device = xs[0].device if xs else torch.device("cpu")
        return [torch.from_numpy(np.asarray(o)).to(device) for o in self.session.run(self.outputs, feeds)]


class TorchRunner:
    def __init__(self, graph: Graph, device: str = "cpu"):
        import torch

        self.graph = graph
        self.device = torch.device(device)
        self.ran_on, self.device_note = self.device.type, ""  # torch runs where it is asked, or raises
        self.consts = {k: torch.from_numpy(np.array(c.array)).to(self.device) for k, c in graph.constants.items()}
        last_use: dict[str, int] = {}
        for i, n in enumerate(graph.nodes):
            for v in n.inputs:
                last_use[v] = i
        keep = set(graph.outputs)
        self.release = [[v for v in n.inputs if last_use.get(v) == i and v not in keep and v not in self.consts]
                        for i, n in enumerate(graph.nodes)]
        self.fns = [(_OpaqueNode(graph, n) if n.op == "Opaque" else _bind(OPS[n.op].compute, n.attrs))
                    for n in graph.nodes]

    def run_tensors(self, feeds: dict, around=None):
        """feeds: name -> torch tensor on the device; returns output tensors. ``around(i, call)``, if given, runs
        node ``i`` as ``call()`` and returns its outputs (a profiler wraps each node so)."""
        import torch

        env = dict(self.consts)
        env.update(feeds)
        with torch.inference_mode():
            for i, (n, fn, rel) in enumerate(zip(self.graph.nodes, self.fns, self.release)):
                try:
                    xs = [env[v] for v in n.inputs if v]
                    outs = fn(xs) if around is None else around(i, lambda: fn(xs))
                except Exception as e:  # noqa: BLE001 -- torch's and onnxruntime's errors, named by node
                    from rlflow.graph.exec.errors import NodeRunError, error_message

                    raise NodeRunError(n, "torch", error_message(e)) from e
                for v, o in zip(n.outputs, outs):
                    env[v] = o
                for v in rel:
                    env.pop(v, None)
        return [env[v] for v in self.graph.outputs]

    def __call__(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        import torch

        tens = {k: torch.from_numpy(np.asarray(v)).to(self.device) for k, v in feeds.items()}
        outs = self.run_tensors(tens)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return [o.detach().cpu().numpy() for o in outs]

    def peak_memory_bytes(self) -> int | None:
        import torch

        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return None


def _bind(fn, attrs):
    return lambda xs: fn(xs, attrs)
