"""What the ONNX export writes for an IR node: the ops that will actually run.

Most IR nodes export as one ONNX op. A Conv with a fused activation (``Conv[relu]``, which TASO's rules and the
fusion rules make) has no standard ONNX form: the export writes Conv followed by Relu (rlflow.graph.ops.conv). A
cost target must score the graph a user's file will run, so it scores such a node as these parts; a runtime that
fuses Conv + Relu itself (onnxruntime) does so for the original graph too.
"""

from __future__ import annotations

from dataclasses import replace

from rlflow.graph.ir import Node


def preactivation(node: Node) -> str:
    """The name the export gives a fused Conv's value before its activation."""
    return f"{node.outputs[0]}_preact"


def as_exported(node: Node) -> tuple[Node, ...]:
    """The nodes the ONNX export writes for ``node``, in order: ``(node,)`` when it is one op; for a Conv with a
    fused ReLU, the Conv without it (output :func:`preactivation`, same type as the node's) and the Relu."""
    if node.op == "Conv" and node.attrs.get("activation", "none") != "none":
        pre = preactivation(node)
        conv = replace(node, attrs={**node.attrs, "activation": "none"}, outputs=(pre,))
        act = Node(name=f"{node.name}_relu", op="Relu", inputs=(pre,), outputs=node.outputs[:1], attrs={})
        return conv, act
    return (node,)
