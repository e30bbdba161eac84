"""The operator registry: for each IR op, shape inference, reference semantics (torch), flops and bytes moved.

Attributes are normalised at import (see :mod:`rlflow.graph.onnx_io`): shape-like ONNX inputs (Reshape's shape,
Slice's starts/ends, Pad's pads, Split's sizes, ReduceMean's axes) become attributes, negative axes are made
positive, defaults are filled in, and a Conv may carry a fused ``activation`` ("none" or "relu").
Anything outside this registry is an ``Opaque`` node: carried through unchanged, never rewritten.

Reference semantics are torch functions so the same code serves the ``torch`` backend (CPU or CUDA) and numeric
verification (float64). Each entry is small and independent; add an op by adding one ``OpDef``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from rlflow.errors import RLFlowError
from rlflow.graph.ir import Node, TensorType

Attrs = Mapping[str, Any]
Infer = Callable[[Sequence[TensorType], Attrs], list[TensorType]]
Compute = Callable[[Sequence[Any], Attrs], list[Any]]  # torch tensors in, torch tensors out
Flops = Callable[[Sequence[TensorType], Sequence[TensorType], Attrs], int]


class ShapeError(RLFlowError):
    """Raised by shape inference; the caller adds the node's name."""


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: Infer
    compute: Compute
    flops: Flops
    onnx_type: str = ""            # the ONNX op type it counts as (default: its own name)
    view: bool = False             # a pure re-indexing (Reshape/Flatten/Identity): moves no bytes

    def bytes_moved(self, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> int:
        if self.view:
            return 0
        return sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs)


OPS: dict[str, OpDef] = {}


def _register(name: str, infer: Infer, compute: Compute, flops: Flops | None = None, **kw: Any) -> None:
    OPS[name] = OpDef(name, infer, compute, flops or _flops_zero, kw.pop("onnx_type", name), **kw)


def infer_types(node: Node, in_types: Sequence[TensorType]) -> list[TensorType]:
    """Output types of ``node`` given its input types; a ShapeError names the node."""
    op = OPS.get(node.op)
    if op is None:
        raise RLFlowError(f"node '{node.name}': op '{node.op}' is not in the op registry")
    try:
        return op.infer(in_types, node.attrs)
    except ShapeError as e:
        raise ShapeError(f"node '{node.name}' ({node.op}): {e}") from None
    except (IndexError, KeyError, ValueError, TypeError, ZeroDivisionError) as e:
        raise ShapeError(f"node '{node.name}' ({node.op}): cannot infer output shape ({e})") from None


def node_flops(node: Node, in_types: Sequence[TensorType], out_types: Sequence[TensorType]) -> int:
    return 0 if node.op == "Opaque" else int(OPS[node.op].flops(in_types, out_types, node.attrs))


def node_bytes(node: Node, in_types: Sequence[TensorType], out_types: Sequence[TensorType]) -> int:
    if node.op == "Opaque":
        return sum(t.nbytes for t in in_types) + sum(t.nbytes for t in out_types)
    return OPS[node.op].bytes_moved(in_types, out_types)


# ---------------------------------------------------------------------------------------------------- helpers
def _torch():
    import torch

    return torch


def _F():
    import torch.nn.functional as F

    return F


def broadcast(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """numpy/ONNX multidirectional broadcasting."""
    out = []
    for x, y in zip(reversed((1,) * (len(b) - len(a)) + tuple(a)), reversed((1,) * (len(a) - len(b)) + tuple(b))):
        if x != y and x != 1 and y != 1:
            raise ShapeError(f"shapes {tuple(a)} and {tuple(b)} do not broadcast")
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def _flops_zero(ins, outs, a) -> int:
    return 0


def _flops_per_out(k: int) -> Flops:
    return lambda ins, outs, a: k * sum(t.numel for t in outs)


def _same(ins, a):
    return [ins[0]]


def _prod(xs) -> int:
    return math.prod(xs) if xs else 1


# ---------------------------------------------------------------------------------------------------- element-wise
def _binary_infer(ins, a):
    if len(ins) != 2:
        raise ShapeError(f"expects 2 inputs, got {len(ins)}")
    if ins[0].dtype != ins[1].dtype:
        raise ShapeError(f"input types differ: {ins[0].dtype} and {ins[1].dtype}")
    return [TensorType(broadcast(ins[0].shape, ins[1].shape), ins[0].dtype)]


for _name, _fn in {
    "Add": lambda x, y: x + y,
    "Sub": lambda x, y: x - y,
    "Mul": lambda x, y: x * y,
    "Div": lambda x, y: x / y,
    "Pow": lambda x, y: _torch().pow(x, y),
}.items():
    _register(_name, _binary_infer, (lambda f: lambda xs, a: [f(xs[0], xs[1])])(_fn), _flops_per_out(1))

for _name, _fn, _cost in [
    ("Relu", lambda x: _torch().relu(x), 1),
    ("Sigmoid", lambda x: _torch().sigmoid(x), 4),
    ("Tanh", lambda x: _torch().tanh(x), 4),
    ("Erf", lambda x: _torch().erf(x), 4),
    ("Sqrt", lambda x: _torch().sqrt(x), 1),
]:
    _register(_name, _same, (lambda f: lambda xs, a: [f(xs[0])])(_fn), _flops_per_out(_cost))

_register("Identity", _same, lambda xs, a: [xs[0]], view=True)


def _gelu(xs, a):
    return [_F().gelu(xs[0], approximate=a.get("approximate", "none"))]


_register("Gelu", _same, _gelu, _flops_per_out(8))


def _scalar_mul_infer(ins, a):
    if ins[1].rank != 0:
        raise ShapeError(f"the scalar input must be 0-D, got {ins[1].shape}")
    return [ins[0]]


# TASO's helper: multiply a tensor by a 0-D scalar tensor.
_register("ScalarMul", _scalar_mul_infer, lambda xs, a: [xs[0] * xs[1]], _flops_per_out(1), onnx_type="Mul")


# ---------------------------------------------------------------------------------------------------- linear algebra
def _matmul_infer(ins, a):
    x, y = ins[0].shape, ins[1].shape
    if not x or not y:
        raise ShapeError("MatMul inputs must have rank >= 1")
    xs, ys = (x if len(x) > 1 else (1,) + x), (y if len(y) > 1 else y + (1,))
    if xs[-1] != ys[-2]:
        raise ShapeError(f"inner dimensions differ: {x} @ {y}")
    batch = broadcast(xs[:-2], ys[:-2])
    out = batch + (xs[-2] if len(x) > 1 else None, ys[-1] if len(y) > 1 else None)
    return [TensorType(tuple(d for d in out if d is not None), ins[0].dtype)]


def _matmul_flops(ins, outs, a):
    k = ins[0].shape[-1]
    return 2 * outs[0].numel * k


_register("MatMul", _matmul_infer, lambda xs, a: [_torch().matmul(xs[0], xs[1])], _matmul_flops)


def _gemm_infer(ins, a):
    A, B = ins[0].shape, ins[1].shape
    if len(A) != 2 or len(B) != 2:
        raise ShapeError("Gemm inputs must be 2-D")
    m, k = (A[1], A[0]) if a["transA"] else A
    k2, n = (B[1], B[0]) if a["transB"] else B
    if k != k2:
        raise ShapeError(f"inner dimensions differ: {A} x {B}")
    if len(ins) > 2:
        broadcast(ins[2].shape, (m, n))
    return [TensorType((m, n), ins[0].dtype)]


def _gemm(xs, a):
    A = xs[0].T if a["transA"] else xs[0]
    B = xs[1].T if a["transB"] else xs[1]
    y = a["alpha"] * (A @ B) if a["alpha"] != 1.0 else A @ B
    if len(xs) > 2:
        y = y + (a["beta"] * xs[2] if a["beta"] != 1.0 else xs[2])
    return [y]


_register("Gemm", _gemm_infer, _gemm, lambda ins, outs, a: 2 * outs[0].numel * ins[0].shape[0 if a["transA"] else 1]
          + (outs[0].numel if len(ins) > 2 else 0))


# ---------------------------------------------------------------------------------------------------- convolution
def _conv_out(size: int, k: int, s: int, p0: int, p1: int, ceil: bool = False) -> int:
    span = size + p0 + p1 - k
    if span < 0:
        raise ShapeError(f"kernel {k} larger than padded input {size + p0 + p1}")
    out = (-(-span // s) if ceil else span // s) + 1
    if ceil and (out - 1) * s >= size + p0:  # the last window must start inside the input or its left padding
        out -= 1
    return out


def _conv_infer(ins, a):
    x, w = ins[0].shape, ins[1].shape
    if len(x) != 4 or len(w) != 4:
        raise ShapeError(f"Conv2D needs 4-D input and weight, got {x} and {w}")
    g = a["group"]
    if x[1] != w[1] * g or w[0] % g:
        raise ShapeError(f"channels do not match: input {x}, weight {w}, group {g}")
    if len(ins) > 2 and ins[2].shape != (w[0],):
        raise ShapeError(f"bias shape {ins[2].shape} != ({w[0]},)")
    (sh, sw), (pt, pl, pb, pr) = a["strides"], a["pads"]
    return [TensorType((x[0], w[0], _conv_out(x[2], w[2], sh, pt, pb), _conv_out(x[3], w[3], sw, pl, pr)), ins[0].dtype)]


def _pad_for_torch(x, pads, value=0.0):
    """ONNX pads (t, l, b, r) -> symmetric torch padding if possible, else an explicit F.pad."""
    pt, pl, pb, pr = pads
    if pt == pb and pl == pr:
        return x, (pt, pl)
    return _F().pad(x, (pl, pr, pt, pb), value=value), (0, 0)


def _conv(xs, a):
    x, padding = _pad_for_torch(xs[0], a["pads"])
    y = _F().conv2d(x, xs[1], xs[2] if len(xs) > 2 else None, a["strides"], padding, 1, a["group"])
    return [_torch().relu(y) if a["activation"] == "relu" else y]


def _conv_flops(ins, outs, a):
    w = ins[1].shape
    macs = outs[0].numel * w[1] * w[2] * w[3]
    return 2 * macs + (outs[0].numel if len(ins) > 2 else 0) + (outs[0].numel if a["activation"] == "relu" else 0)


_register("Conv", _conv_infer, _conv, _conv_flops)


def _enlarge_infer(ins, a):
    w = ins[0].shape
    kh, kw = a["kernel"]
    if len(w) != 4 or w[2] > kh or w[3] > kw or (kh - w[2]) % 2 or (kw - w[3]) % 2:
        raise ShapeError(f"cannot enlarge a {w} kernel to {kh}x{kw}")
    return [TensorType(w[:2] + (kh, kw), ins[0].dtype)]


def _enlarge(xs, a):
    w = xs[0]
    kh, kw = a["kernel"]
    dh, dw = (kh - w.shape[2]) // 2, (kw - w.shape[3]) // 2
    return [_F().pad(w, (dw, dw, dh, dh))]


# TASO's helper: zero-pad a conv kernel to a larger (odd) size, centred, so it can be merged with a wider conv.
_register("Enlarge", _enlarge_infer, _enlarge, onnx_type="Pad")


# ---------------------------------------------------------------------------------------------------- pooling
def _pool_infer(ins, a):
    x = ins[0].shape
    if len(x) != 4:
        raise ShapeError(f"2-D pooling needs a 4-D input, got {x}")
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = a["kernel"], a["strides"], a["pads"]
    c = bool(a["ceil_mode"])
    return [TensorType((x[0], x[1], _conv_out(x[2], kh, sh, pt, pb, c), _conv_out(x[3], kw, sw, pl, pr, c)), ins[0].dtype)]


def _crop_to_onnx(y, x_shape, a):
    """After explicit padding, torch's ceil mode may add a trailing window that starts in the right/bottom padding;
    ONNX drops it. Keep the first windows, as many as ONNX's output size."""
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = a["kernel"], a["strides"], a["pads"]
    oh = _conv_out(x_shape[2], kh, sh, pt, pb, bool(a["ceil_mode"]))
    ow = _conv_out(x_shape[3], kw, sw, pl, pr, bool(a["ceil_mode"]))
    return y[:, :, :oh, :ow] if y.shape[2:] != (oh, ow) else y


def _maxpool(xs, a):
    x, padding = _pad_for_torch(xs[0], a["pads"], value=-math.inf)
    y = _F().max_pool2d(x, a["kernel"], a["strides"], padding, 1, bool(a["ceil_mode"]))
    return [_crop_to_onnx(y, xs[0].shape, a)]


def _avgpool(xs, a):
    """Sum over the window divided by the number of counted elements (ONNX semantics for every padding mode)."""
    torch, F = _torch(), _F()
    x = xs[0]
    pt, pl, pb, pr = a["pads"]
    k, s, c = a["kernel"], a["strides"], bool(a["ceil_mode"])
    if (pt, pl, pb, pr) == (0, 0, 0, 0) and not c:
        return [F.avg_pool2d(x, k, s)]
    xp = F.pad(x, (pl, pr, pt, pb))
    ones = torch.ones((1, 1) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
    counted = F.pad(ones, (pl, pr, pt, pb), value=1.0 if a["count_include_pad"] else 0.0)
    total = F.avg_pool2d(xp, k, s, 0, c, True, 1)
    count = F.avg_pool2d(counted, k, s, 0, c, True, 1)
    return [_crop_to_onnx(total / count, x.shape, a)]


_pool_flops = lambda ins, outs, a: outs[0].numel * a["kernel"][0] * a["kernel"][1]  # noqa: E731
_register("MaxPool", _pool_infer, _maxpool, _pool_flops)
_register("AveragePool", _pool_infer, _avgpool, _pool_flops)


def _gap_infer(ins, a):
    x = ins[0].shape
    if len(x) < 3:
        raise ShapeError(f"GlobalAveragePool needs rank >= 3, got {x}")
    return [TensorType(x[:2] + (1,) * (len(x) - 2), ins[0].dtype)]


_register("GlobalAveragePool", _gap_infer,
          lambda xs, a: [xs[0].mean(dim=tuple(range(2, xs[0].dim())), keepdim=True)],
          lambda ins, outs, a: ins[0].numel)


# ---------------------------------------------------------------------------------------------------- normalisation
def _bn_infer(ins, a):
    x = ins[0].shape
    if len(x) < 2 or any(t.shape != (x[1],) for t in ins[1:5]):
        raise ShapeError(f"BatchNormalization parameters must have shape ({x[1] if len(x) > 1 else '?'},)")
    return [ins[0]]


def _bn(xs, a):
    x, scale, bias, mean, var = xs
    shape = (1, -1) + (1,) * (x.dim() - 2)
    inv = scale / _torch().sqrt(var + a["epsilon"])
    return [x * inv.reshape(shape) + (bias - mean * inv).reshape(shape)]


_register("BatchNormalization", _bn_infer, _bn, _flops_per_out(2))


def _ln_infer(ins, a):
    x = ins[0].shape
    axis = a["axis"]
    if not 0 <= axis < len(x):
        raise ShapeError(f"axis {axis} out of range for {x}")
    for t in ins[1:]:
        broadcast(t.shape, x[axis:])
    return [ins[0]]


def _ln(xs, a):
    x = xs[0]
    dims = tuple(range(a["axis"], x.dim()))
    mean = x.mean(dim=dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)
    y = (x - mean) / _torch().sqrt(var + a["epsilon"]) * xs[1]
    return [y + xs[2] if len(xs) > 2 else y]


_register("LayerNormalization", _ln_infer, _ln, _flops_per_out(8))


def _softmax_infer(ins, a):
    if not 0 <= a["axis"] < ins[0].rank:
        raise ShapeError(f"axis {a['axis']} out of range for {ins[0].shape}")
    return [ins[0]]


_register("Softmax", _softmax_infer, lambda xs, a: [_torch().softmax(xs[0], dim=a["axis"])], _flops_per_out(5))


def _reduce_mean_infer(ins, a):
    x = ins[0].shape
    axes = a["axes"] or tuple(range(len(x)))
    if any(not 0 <= ax < len(x) for ax in axes):
        raise ShapeError(f"axes {axes} out of range for {x}")
    if a["keepdims"]:
        return [TensorType(tuple(1 if i in axes else d for i, d in enumerate(x)), ins[0].dtype)]
    return [TensorType(tuple(d for i, d in enumerate(x) if i not in axes), ins[0].dtype)]


def _reduce_mean(xs, a):
    axes = a["axes"] or tuple(range(xs[0].dim()))
    return [xs[0].mean(dim=axes, keepdim=bool(a["keepdims"]))]


_register("ReduceMean", _reduce_mean_infer, _reduce_mean, lambda ins, outs, a: ins[0].numel)


# ---------------------------------------------------------------------------------------------------- data movement
def _concat_infer(ins, a):
    ax = a["axis"]
    first = ins[0].shape
    if not 0 <= ax < len(first):
        raise ShapeError(f"axis {ax} out of range for {first}")
    for t in ins[1:]:
        if len(t.shape) != len(first) or any(d != e for i, (d, e) in enumerate(zip(t.shape, first)) if i != ax):
            raise ShapeError(f"inputs {first} and {t.shape} differ outside axis {ax}")
    return [TensorType(first[:ax] + (sum(t.shape[ax] for t in ins),) + first[ax + 1:], ins[0].dtype)]


_register("Concat", _concat_infer, lambda xs, a: [_torch().cat(list(xs), dim=a["axis"])])


def _split_infer(ins, a):
    x, ax, sizes = ins[0].shape, a["axis"], a["split"]
    if not 0 <= ax < len(x) or sum(sizes) != x[ax]:
        raise ShapeError(f"split sizes {sizes} on axis {ax} do not cover {x}")
    return [TensorType(x[:ax] + (s,) + x[ax + 1:], ins[0].dtype) for s in sizes]


_register("Split", _split_infer, lambda xs, a: list(_torch().split(xs[0], list(a["split"]), dim=a["axis"])))


def _transpose_infer(ins, a):
    perm = a["perm"]
    if sorted(perm) != list(range(ins[0].rank)):
        raise ShapeError(f"perm {perm} is not a permutation of rank {ins[0].rank}")
    return [TensorType(tuple(ins[0].shape[p] for p in perm), ins[0].dtype)]


_register("Transpose", _transpose_infer, lambda xs, a: [xs[0].permute(tuple(a["perm"])).contiguous()])


def _reshape_infer(ins, a):
    shape = tuple(a["shape"])
    if _prod(shape) != ins[0].numel or any(d < 0 for d in shape):
        raise ShapeError(f"cannot reshape {ins[0].shape} to {shape}")
    return [TensorType(shape, ins[0].dtype)]


_register("Reshape", _reshape_infer, lambda xs, a: [xs[0].reshape(a["shape"])], view=True)


def _flatten_infer(ins, a):
    x, ax = ins[0].shape, a["axis"]
    return [TensorType((_prod(x[:ax]), _prod(x[ax:])), ins[0].dtype)]


_register("Flatten", _flatten_infer, lambda xs, a: [xs[0].reshape(_prod(xs[0].shape[:a["axis"]]), -1)], view=True)


def _pad_infer(ins, a):
    x, pads = ins[0].shape, a["pads"]
    r = len(x)
    if len(pads) != 2 * r:
        raise ShapeError(f"pads {pads} need {2 * r} values for rank {r}")
    out = tuple(d + pads[i] + pads[i + r] for i, d in enumerate(x))
    if any(d < 0 for d in out):
        raise ShapeError(f"pads {pads} make a negative dimension")
    return [TensorType(out, ins[0].dtype)]


def _pad(xs, a):
    x, pads = xs[0], a["pads"]
    r = x.dim()
    torch_pads = []
    for i in reversed(range(r)):
        torch_pads += [pads[i], pads[i + r]]
    return [_F().pad(x, tuple(torch_pads), value=a["value"])]


_register("Pad", _pad_infer, _pad)


def _slice_infer(ins, a):
    x = ins[0].shape
    out = list(x)
    for ax, st, en, sp in zip(a["axes"], a["starts"], a["ends"], a["steps"]):
        out[ax] = max(0, -(-(en - st) // sp))
    return [TensorType(tuple(out), ins[0].dtype)]


def _slice(xs, a):
    idx = [slice(None)] * xs[0].dim()
    for ax, st, en, sp in zip(a["axes"], a["starts"], a["ends"], a["steps"]):
        idx[ax] = slice(st, en, sp)
    return [xs[0][tuple(idx)]]


_register("Slice", _slice_infer, _slice)


def _gather_infer(ins, a):
    x, ax = ins[0].shape, a["axis"]
    if not 0 <= ax < len(x):
        raise ShapeError(f"axis {ax} out of range for {x}")
    if ins[1].dtype not in ("int64", "int32"):
        raise ShapeError(f"indices must be int32/int64, got {ins[1].dtype}")
    return [TensorType(x[:ax] + ins[1].shape + x[ax + 1:], ins[0].dtype)]


def _gather(xs, a):
    torch = _torch()
    data, idx, ax = xs[0], xs[1].long(), a["axis"]
    idx = torch.where(idx < 0, idx + data.shape[ax], idx)
    flat = torch.index_select(data, ax, idx.reshape(-1))
    return [flat.reshape(tuple(data.shape[:ax]) + tuple(idx.shape) + tuple(data.shape[ax + 1:]))]


_register("Gather", _gather_infer, _gather)

#: element-wise ops (one output element per input element; used by the cost model and later by fusion rules)
ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Relu", "Sigmoid", "Tanh", "Erf", "Sqrt", "Gelu",
                         "ScalarMul", "Identity"})


def graph_flops(graph) -> int:
    """Total floating-point operations of one forward pass (opaque nodes count 0)."""
    t = graph.types
    return sum(node_flops(n, [t[v] for v in n.inputs if v], [t[v] for v in n.outputs]) for n in graph.nodes)


def graph_bytes(graph) -> int:
    """Total bytes read and written by all ops (views move none)."""
    t = graph.types
    return sum(node_bytes(n, [t[v] for v in n.inputs if v], [t[v] for v in n.outputs]) for n in graph.nodes)


#: every IR op's attribute names (a rule's pattern node must give each of them: a value, a parameter or an
#: expression), so rules files are checked against the op registry
OP_ATTRS: dict[str, tuple[str, ...]] = {
    **{op: () for op in ("Add", "Sub", "Mul", "Div", "Pow", "Relu", "Sigmoid", "Tanh", "Erf", "Sqrt", "Identity",
                         "ScalarMul", "MatMul", "GlobalAveragePool")},
    "Gelu": ("approximate",),
    "Gemm": ("alpha", "beta", "transA", "transB"),
    "Conv": ("strides", "pads", "group", "activation"),
    "Enlarge": ("kernel",),
    "MaxPool": ("kernel", "strides", "pads", "ceil_mode"),
    "AveragePool": ("kernel", "strides", "pads", "ceil_mode", "count_include_pad"),
    "BatchNormalization": ("epsilon",),
    "LayerNormalization": ("axis", "epsilon"),
    "Softmax": ("axis",),
    "Concat": ("axis",),
    "Split": ("axis", "split"),
    "Transpose": ("perm",),
    "Reshape": ("shape",),
    "Flatten": ("axis",),
    "Pad": ("pads", "mode", "value"),
    "Slice": ("axes", "starts", "ends", "steps"),
    "Gather": ("axis",),
    "ReduceMean": ("axes", "keepdims"),
}
assert set(OP_ATTRS) == set(OPS), set(OP_ATTRS) ^ set(OPS)

