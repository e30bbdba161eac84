"""Build IR graphs in code (tests, builtin rules, TASO-style generators)::

    b = GraphBuilder("toy")
    x = b.input("x", (1, 3, 8, 8))
    w = b.const("w", np.ones((4, 3, 3, 3), np.float32))
    y = b.op("Conv", [x, w], strides=(1, 1), pads=(1, 1, 1, 1), group=1, activation="relu")
    g = b.build([y])
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from rlflow.graph.ir import Constant, Graph, Node, TensorType
from rlflow.graph.ops import infer_types


class GraphBuilder:
    def __init__(self, name: str = "graph", opset: int = 18):
        self.name, self.opset = name, opset
        self.inputs: list[str] = []
        self.nodes: list[Node] = []
        self.types: dict[str, TensorType] = {}
        self.constants: dict[str, Constant] = {}
        self._count = 0

    def _fresh(self, base: str) -> str:
        self._count += 1
        return f"{base}_{self._count}"

    def input(self, name: str, shape: Sequence[int], dtype: str = "float32") -> str:
        self.inputs.append(name)
        self.types[name] = TensorType(tuple(shape), dtype)
        return name

    def const(self, name: str, array: np.ndarray) -> str:
        c = Constant(np.asarray(array))
        self.constants[name] = c
        self.types[name] = c.type
        return name

    def op(self, op: str, inputs: Sequence[str], n_outputs: int = 1, name: str | None = None, **attrs: Any):
        """Add a node; returns its output name (or a list of names when ``n_outputs > 1``)."""
        name = name or self._fresh(op.lower())
        outs = tuple(f"{name}:{k}" if n_outputs > 1 else name for k in range(n_outputs))
        node = Node(name, op, tuple(inputs), outs, attrs)
        for v, t in zip(outs, infer_types(node, [self.types[v] for v in inputs])):
            self.types[v] = t
        self.nodes.append(node)
        return list(outs) if n_outputs > 1 else outs[0]

    def build(self, outputs: Sequence[str]) -> Graph:
        g = Graph(inputs=self.inputs, outputs=outputs, nodes=self.nodes, types=self.types,
                  constants=self.constants, name=self.name, opset=self.opset)
        g.validate()
        return g
