"""What an op is (:class:`OpDef`) and the helpers the op families share.

An OpDef holds every facet of one IR op; the rest of the package reaches the op only through it:

- ``attrs``: the attribute names every node of the op carries (normalised at import; a rule's pattern node gives
  each of them: a value, a parameter or an expression);
- ``infer``: shape inference, ``(input types, attrs) -> output types``; raises :class:`ShapeError`;
- ``compute``: reference semantics in torch, ``(input tensors, attrs) -> output tensors`` (the ``torch`` backend,
  constant folding and numeric rule verification all run it);
- ``flops``: ``(input types, output types, attrs) -> floating-point operations``; ``view``: a pure re-indexing
  (Reshape, Flatten, Identity) that moves no bytes; ``elementwise``: one output element per input element;
  ``broadcasting``: a binary element-wise op whose inputs broadcast against each other (numpy/ONNX rules); a rule
  with the ``no_broadcast`` constraint binds such ops only where both inputs have one shape
  (:mod:`rlflow.rewrite.rule`); ``commutative``: a binary op whose two inputs can be swapped (Add, Mul): the
  rewrite matcher and eqsat's e-matcher match its pattern nodes in either operand order, rule pruning compares
  its operands as a multiset, and cost signatures list them in a canonical order;
- ``onnx_type``: the ONNX op type the op counts as in op counts (default: its own name);
- ``from_onnx``: ONNX import, ``(OnnxNode) -> (IR op, IR inputs, normalised attrs)``, raising :class:`Unsupported`
  to keep the node opaque (None: never imported, TASO's helpers); ``onnx_types``: the ONNX op types it reads
  (default: the op's own name);
- ``to_onnx``: ONNX export, ``(emitter, node)``, appending ONNX nodes through the emitter of
  :mod:`rlflow.graph.onnx_io` (``e.node``, ``e.const``, ``e.fresh``, ``e.graph``);
- ``tf``: the TensorFlow lowering, ``(tf, inputs, attrs, ctx) -> outputs`` (``tf`` is the module, passed in, so the
  registry never imports TensorFlow; ``ctx`` see :mod:`rlflow.graph.exec.tf_exec`); ``tf_layout``: ``"ir"`` (runs
  on IR-layout NCHW tensors), ``"nhwc"`` (always NHWC: TF's CPU kernels take nothing else) or ``"any"`` (NHWC when
  a rank-4 input already is); ``tf_forms``: the input forms in NHWC mode, where not the default;
- ``jax``: the JAX lowering (None until the XLA floor adds it);
- ``input_ranks``: ``attrs -> the usual rank of each input`` (None: any), and ``positive_inputs``: the inputs
  random data must keep positive (a variance, a divisor, a Sqrt's input); both for checking rules numerically
  (:mod:`rlflow.rewrite.verify`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rlflow.errors import RLFlowError
from rlflow.graph.types import TensorType

Attrs = Mapping[str, Any]
Infer = Callable[[Sequence[TensorType], Attrs], list[TensorType]]
Compute = Callable[[Sequence[Any], Attrs], list[Any]]  # torch tensors in, torch tensors out
Flops = Callable[[Sequence[TensorType], Sequence[TensorType], Attrs], int]
FromOnnx = Callable[["OnnxNode"], tuple[str, tuple[str, ...], dict[str, Any]]]
ToOnnx = Callable[[Any, Any], None]                   # (onnx_io's emitter, node)
TfLowering = Callable[[Any, Sequence[Any], Attrs, Any], list[Any]]


class ShapeError(RLFlowError):
    """Raised by shape inference; the caller adds the node's name."""


class Unsupported(Exception):
    """Raised by an ONNX import: this node (with these attributes) is not an IR op; keep it opaque."""


# ---------------------------------------------------------------------------------------------------- facets
def flops_zero(ins, outs, a) -> int:
    return 0


def flops_per_out(k: int) -> Flops:
    return lambda ins, outs, a: k * sum(t.numel for t in outs)


def no_ranks(a: Attrs) -> tuple[int | None, ...]:
    return ()


def ranks(*r: int | None) -> Callable[[Attrs], tuple[int | None, ...]]:
    return lambda a: r


def import_plain(n: "OnnxNode") -> tuple[str, tuple[str, ...], dict[str, Any]]:
    """An ONNX op that is the IR op of the same name without attributes."""
    if "" in n.inputs:
        raise Unsupported
    return n.op_type, n.inputs, {}


def export_plain(e, n) -> None:
    """The ONNX op of the same name, no attributes."""
    e.node(n.op, n.inputs, n.outputs, n.name)


def export_with_axis(e, n) -> None:
    """The ONNX op of the same name with the node's ``axis`` attribute."""
    e.node(n.op, n.inputs, n.outputs, n.name, axis=n.attrs["axis"])


@dataclass(frozen=True, kw_only=True)
class OpDef:
    """One IR op with all its facets (see the module docstring)."""

    name: str
    attrs: tuple[str, ...]
    infer: Infer
    compute: Compute
    flops: Flops = flops_zero
    view: bool = False
    elementwise: bool = False
    broadcasting: bool = False
    commutative: bool = False
    onnx_type: str = ""
    from_onnx: FromOnnx | None = import_plain
    onnx_types: tuple[str, ...] = ()
    to_onnx: ToOnnx = export_plain
    tf: TfLowering | None = None
    tf_layout: str = "ir"
    tf_forms: tuple[str, ...] = ()
    jax: Callable | None = None
    input_ranks: Callable[[Attrs], tuple[int | None, ...]] = no_ranks
    positive_inputs: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.onnx_type:
            object.__setattr__(self, "onnx_type", self.name)
        if self.from_onnx is not None and not self.onnx_types:
            object.__setattr__(self, "onnx_types", (self.name,))
        if self.tf_layout not in ("ir", "nhwc", "any"):
            raise ValueError(f"op {self.name}: tf_layout {self.tf_layout!r}")

    def bytes_moved(self, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> int:
        if self.view:
            return 0
        return sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs)


# ---------------------------------------------------------------------------------------------------- shapes
def broadcast(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """numpy/ONNX multidirectional broadcasting."""
    out = []
    for x, y in zip(reversed((1,) * (len(b) - len(a)) + tuple(a)), reversed((1,) * (len(a) - len(b)) + tuple(b))):
        if x != y and x != 1 and y != 1:
            raise ShapeError(f"shapes {tuple(a)} and {tuple(b)} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def broadcasts_to(a: Sequence[int], target: Sequence[int], what: str) -> None:
    """ONNX unidirectional broadcasting: ``a`` must broadcast to ``target`` without enlarging it."""
    try:
        fits = len(a) <= len(target) and broadcast(a, target) == tuple(target)
    except ShapeError:
        fits = False
    if not fits:
        raise ShapeError(f"{what} shape {tuple(a)} does not broadcast to {tuple(target)}")


def prod(xs) -> int:
    return math.prod(xs) if xs else 1


def same(ins, a):
    return [ins[0]]


# ---------------------------------------------------------------------------------------------------- torch
def torch_():
    import torch

    return torch


def F_():
    import torch.nn.functional as F

    return F


# ---------------------------------------------------------------------------------------------------- ONNX import
class OnnxNode:
    """What an op's ONNX import sees of one ONNX node: its ``op_type``, decoded ``attrs``, ``inputs`` (trailing
    empty ones dropped), ``n_outputs``, the input types (``in_types``, None where unknown, and their ``in_shapes``),
    the output types ONNX shape inference gave (``out_types``), the folded constants (``consts``: value name ->
    numpy array) and the model's ``opset``."""

    __slots__ = ("op_type", "attrs", "inputs", "n_outputs", "in_types", "in_shapes", "out_types", "consts",
                 "opset")

    def __init__(self, op_type: str, attrs: dict[str, Any], inputs: tuple[str, ...], n_outputs: int,
                 in_types: Sequence[TensorType | None], out_types: Sequence[TensorType],
                 consts: Mapping[str, np.ndarray], opset: int):
        self.op_type, self.attrs, self.inputs, self.n_outputs = op_type, attrs, inputs, n_outputs
        self.in_types, self.out_types, self.consts, self.opset = list(in_types), list(out_types), consts, opset
        self.in_shapes = [t.shape if t else None for t in in_types]

    @property
    def x(self) -> tuple[int, ...] | None:
        """The first input's shape."""
        return self.in_shapes[0] if self.in_shapes else None

    def const_input(self, k: int) -> np.ndarray | None:
        """Input ``k`` (a shape-like input) as a constant; None if absent, Unsupported if not constant."""
        if len(self.inputs) <= k or not self.inputs[k]:
            return None
        if self.inputs[k] not in self.consts:
            raise Unsupported  # a shape-like input that is not constant: a dynamic op
        return self.consts[self.inputs[k]]

    def pads2d(self, kernel, strides) -> tuple[int, int, int, int]:
        """The (top, left, bottom, right) pads of a 2-D conv or pool (``auto_pad`` resolved)."""
        a = self.attrs
        auto = a.get("auto_pad", "NOTSET")
        if auto in ("NOTSET", ""):
            p = tuple(int(x) for x in a.get("pads", (0, 0, 0, 0)))
            if len(p) != 4:
                raise Unsupported
            return p[0], p[1], p[2], p[3]
        if auto == "VALID":
            return (0, 0, 0, 0)
        pads = []
        for size, k, s in zip(self.x[2:], kernel, strides):
            out = -(-size // s)
            total = max(0, (out - 1) * s + k - size)
            pads.append((total // 2, total - total // 2) if auto == "SAME_UPPER" else (total - total // 2, total // 2))
        return pads[0][0], pads[1][0], pads[0][1], pads[1][1]


def axis(v: int, rank: int) -> int:
    """An ONNX axis (negative counts from the end) as an IR axis in 0..rank-1; Unsupported if out of range."""
    v = int(v)
    if not -rank <= v < rank:
        raise Unsupported
    return v + rank if v < 0 else v


def onnx_dtype_name(code: int) -> str | None:
    """The dtype name of an ONNX element type code (``TensorProto.FLOAT`` -> ``float32``)."""
    from onnx import helper

    try:
        return str(np.dtype(helper.tensor_dtype_to_np_dtype(code)))
    except (KeyError, TypeError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------------- TensorFlow
TO_NHWC = (0, 2, 3, 1)


def tf_pad_or_crop(tf, x, pads, value):
    """tf.pad with ``pads`` (per axis [before, after]); negative amounts crop instead."""
    if any(p < 0 for pair in pads for p in pair):
        x = x[tuple(slice(max(0, -b), e if e < 0 else None) for b, e in pads)]
        pads = [[max(0, b), max(0, e)] for b, e in pads]
    if any(p for pair in pads for p in pair):
        x = tf.pad(x, pads, constant_values=value)
    return x
