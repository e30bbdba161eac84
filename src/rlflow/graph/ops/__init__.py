"""The operator registry: one :class:`OpDef` per IR op, holding every facet of the op (shape inference, torch
reference semantics, flops and bytes, attribute names, ONNX import and export, the TensorFlow lowering, what rule
verification needs; see :mod:`rlflow.graph.ops.core`).

The ops live in family modules, each holding its ops' complete OpDefs in a ``DEFS`` list: :mod:`.elementwise`,
:mod:`.linear`, :mod:`.conv` (convolution and pooling), :mod:`.norm` (normalisation and reductions),
:mod:`.movement` (data movement) and :mod:`.attention` (fused attention). Adding an op touches one family module
plus its test; nothing outside this package keeps a per-op table.

Attributes are normalised at import (see :mod:`rlflow.graph.onnx_io`): shape-like ONNX inputs (Reshape's shape,
Slice's starts/ends, Pad's pads, Split's sizes, ReduceMean's axes) become attributes, negative axes are made
positive, defaults are filled in, and a Conv may carry a fused ``activation`` ("none" or "relu").
Anything outside this registry is an ``Opaque`` node: carried through unchanged, never rewritten.

Reference semantics are torch functions so the same code serves the ``torch`` backend (CPU or CUDA) and numeric
verification (float64).
"""

from __future__ import annotations

from typing import Sequence

from rlflow.errors import RLFlowError
from rlflow.graph.ops import attention, conv, elementwise, linear, movement, norm
from rlflow.graph.ops.core import OnnxNode, OpDef, ShapeError, Unsupported, broadcast
from rlflow.graph.types import TensorType

__all__ = ["COMMUTATIVE", "ELEMENTWISE", "ONNX_IMPORTS", "OPS", "OnnxNode", "OpDef", "ShapeError", "Unsupported",
           "broadcast", "graph_bytes", "graph_flops", "infer_types", "node_bytes", "node_flops"]

#: IR op name -> its OpDef
OPS: dict[str, OpDef] = {d.name: d for family in (elementwise, linear, conv, norm, movement, attention) for d in family.DEFS}

#: ONNX op type -> the OpDef whose ``from_onnx`` imports it
ONNX_IMPORTS: dict[str, OpDef] = {t: d for d in OPS.values() if d.from_onnx is not None for t in d.onnx_types}

#: element-wise ops (one output element per input element; used by the cost model and later by fusion rules)
ELEMENTWISE = frozenset(name for name, d in OPS.items() if d.elementwise)

#: binary ops whose two inputs can be swapped (``OpDef.commutative``: Add, Mul)
COMMUTATIVE = frozenset(name for name, d in OPS.items() if d.commutative)


def infer_types(node, in_types: Sequence[TensorType]) -> list[TensorType]:
    """Output types of ``node`` (an IR Node) given its input types; a ShapeError names the node."""
    op = OPS.get(node.op)
    if op is None:
        raise RLFlowError(f"node '{node.name}': op '{node.op}' is not in the op registry")
    try:
        return op.infer(in_types, node.attrs)
    except ShapeError as e:
        raise ShapeError(f"node '{node.name}' ({node.op}): {e}") from None
    except (IndexError, KeyError, ValueError, TypeError, ZeroDivisionError) as e:
        raise ShapeError(f"node '{node.name}' ({node.op}): cannot infer output shape ({e})") from None


def node_flops(node, in_types: Sequence[TensorType], out_types: Sequence[TensorType]) -> int:
    return 0 if node.op == "Opaque" else int(OPS[node.op].flops(in_types, out_types, node.attrs))


def node_bytes(node, in_types: Sequence[TensorType], out_types: Sequence[TensorType]) -> int:
    if node.op == "Opaque":
        return sum(t.nbytes for t in in_types) + sum(t.nbytes for t in out_types)
    return OPS[node.op].bytes_moved(in_types, out_types)


def graph_flops(graph) -> int:
    """Total floating-point operations of one forward pass (opaque nodes count 0)."""
    t = graph.types
    return sum(node_flops(n, [t[v] for v in n.inputs if v], [t[v] for v in n.outputs]) for n in graph.nodes)


def graph_bytes(graph) -> int:
    """Total bytes read and written by all ops (views move none)."""
    t = graph.types
    return sum(node_bytes(n, [t[v] for v in n.inputs if v], [t[v] for v in n.outputs]) for n in graph.nodes)
