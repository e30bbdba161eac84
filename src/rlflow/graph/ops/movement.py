"""Data movement: Concat, Split, Transpose, Reshape (also ONNX's Squeeze and Unsqueeze), Flatten, Pad, Slice, Gather.

Shape-like ONNX inputs (Reshape's shape, Split's sizes, Pad's pads, Slice's starts/ends/axes/steps) must be constant
at import; they become attributes."""

from __future__ import annotations

import numpy as np

from rlflow.graph.ops.core import (TO_NHWC, OnnxNode, OpDef, ShapeError, Unsupported, axis, export_with_axis, F_,
                                   prod, tf_pad_or_crop, torch_)
from rlflow.graph.types import TensorType


# ---------------------------------------------------------------------------------------------------- Concat
def _concat_infer(ins, a):
    ax = a["axis"]
    first = ins[0].shape
    if not 0 <= ax < len(first):
        raise ShapeError(f"axis {ax} out of range for {first}")
    for t in ins[1:]:
        if len(t.shape) != len(first) or any(d != e for i, (d, e) in enumerate(zip(t.shape, first)) if i != ax):
            raise ShapeError(f"inputs {first} and {t.shape} differ outside axis {ax}")
        if t.dtype != ins[0].dtype:
            raise ShapeError(f"input types differ: {ins[0].dtype} and {t.dtype}")
    return [TensorType(first[:ax] + (sum(t.shape[ax] for t in ins),) + first[ax + 1:], ins[0].dtype)]


def _import_concat(n: OnnxNode):
    return "Concat", n.inputs, {"axis": axis(n.attrs["axis"], len(n.x))}


# ---------------------------------------------------------------------------------------------------- Split
def _split_infer(ins, a):
    x, ax, sizes = ins[0].shape, a["axis"], a["split"]
    if not 0 <= ax < len(x) or sum(sizes) != x[ax] or any(s < 0 for s in sizes):
        raise ShapeError(f"split sizes {sizes} on axis {ax} do not cover {x}")
    return [TensorType(x[:ax] + (s,) + x[ax + 1:], ins[0].dtype) for s in sizes]


def _import_split(n: OnnxNode):
    x = n.x
    ax = axis(n.attrs.get("axis", 0), len(x))
    sizes = n.const_input(1)
    if sizes is None:
        sizes = n.attrs.get("split")
    if sizes is None:
        k = n.n_outputs
        chunk = -(-x[ax] // k)
        sizes = [chunk] * (k - 1) + [x[ax] - chunk * (k - 1)]
    return "Split", n.inputs[:1], {"axis": ax, "split": tuple(int(s) for s in sizes)}


def _export_split(e, n) -> None:
    e.node("Split", [n.inputs[0], e.const(f"{n.name}_split", list(n.attrs["split"]))], n.outputs, n.name,
           axis=n.attrs["axis"])


def _split_tf(tf, xs, a, c):
    return tf.split(xs[0], list(a["split"]), axis=c.axis(a["axis"]))


# ---------------------------------------------------------------------------------------------------- Transpose
def _transpose_infer(ins, a):
    perm = a["perm"]
    if sorted(perm) != list(range(ins[0].rank)):
        raise ShapeError(f"perm {perm} is not a permutation of rank {ins[0].rank}")
    return [TensorType(tuple(ins[0].shape[p] for p in perm), ins[0].dtype)]


def _import_transpose(n: OnnxNode):
    return "Transpose", n.inputs, {"perm": tuple(int(p) for p in n.attrs.get("perm", reversed(range(len(n.x)))))}


def _export_transpose(e, n) -> None:
    e.node("Transpose", n.inputs, n.outputs, n.name, perm=list(n.attrs["perm"]))


def _transpose_ranks(a) -> tuple[int | None, ...]:
    return (len(a["perm"]),) if isinstance(a.get("perm"), (list, tuple)) else ()


# ---------------------------------------------------------------------------------------------------- Reshape, Flatten
def _reshape_infer(ins, a):
    shape = tuple(a["shape"])
    if prod(shape) != ins[0].numel or any(d < 0 for d in shape):
        raise ShapeError(f"cannot reshape {ins[0].shape} to {shape}")
    return [TensorType(shape, ins[0].dtype)]


def _import_reshape(n: OnnxNode):
    """Reshape, Squeeze and Unsqueeze: a Reshape to the output shape (static by now: ONNX shape inference ran with
    the folded shape inputs)."""
    return "Reshape", n.inputs[:1], {"shape": tuple(int(d) for d in n.out_types[0].shape)}


def _export_reshape(e, n) -> None:
    e.node("Reshape", [n.inputs[0], e.const(f"{n.name}_shape", list(n.attrs["shape"]))], n.outputs, n.name)


def _flatten_infer(ins, a):
    x, ax = ins[0].shape, a["axis"]
    if not 0 <= ax <= len(x):
        raise ShapeError(f"axis {ax} out of range for {x}")
    return [TensorType((prod(x[:ax]), prod(x[ax:])), ins[0].dtype)]


def _import_flatten(n: OnnxNode):
    return "Flatten", n.inputs[:1], {"axis": axis(n.attrs.get("axis", 1), len(n.x) + 1) if n.x else 1}


# ---------------------------------------------------------------------------------------------------- Pad
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
    return [F_().pad(x, tuple(torch_pads), value=a["value"])]


def _import_pad(n: OnnxNode):
    pads, value, axes = n.const_input(1), n.const_input(2), n.const_input(3)
    if n.attrs.get("mode", "constant") != "constant" or pads is None:
        raise Unsupported
    r = len(n.x)
    pads = [int(p) for p in pads]
    if axes is not None:
        full = [0] * (2 * r)
        axes = [axis(ax, r) for ax in axes]
        for k, ax in enumerate(axes):
            full[ax], full[ax + r] = pads[k], pads[k + len(axes)]
        pads = full
    return "Pad", n.inputs[:1], {"pads": tuple(pads), "mode": "constant",
                                 "value": float(value.reshape(())) if value is not None and value.size else 0.0}


def _export_pad(e, n) -> None:
    nm = n.name
    dtype = np.dtype(e.graph.types[n.inputs[0]].dtype)
    e.node("Pad", [n.inputs[0], e.const(f"{nm}_pads", list(n.attrs["pads"])),
                   e.const(f"{nm}_value", n.attrs["value"], dtype)], n.outputs, nm, mode="constant")


def _pad_tf(tf, xs, a, c):
    pads, r = a["pads"], len(c.in_shapes[0])
    pairs = [[pads[i], pads[i + r]] for i in range(r)]
    if c.nhwc:
        pairs = [pairs[i] for i in TO_NHWC]
    return [tf_pad_or_crop(tf, xs[0], pairs, a["value"])]


# ---------------------------------------------------------------------------------------------------- Slice
def _slice_infer(ins, a):
    x = ins[0].shape
    out = list(x)
    for ax, st, en, sp in zip(a["axes"], a["starts"], a["ends"], a["steps"]):
        out[ax] = max(0, -(-(en - st) // sp))
    return [TensorType(tuple(out), ins[0].dtype)]


def _slice_index(rank: int, a) -> tuple:
    idx = [slice(None)] * rank
    for ax, st, en, sp in zip(a["axes"], a["starts"], a["ends"], a["steps"]):
        idx[ax] = slice(st, en, sp)
    return tuple(idx)


def _import_slice(n: OnnxNode):
    x = n.x
    starts, ends = n.const_input(1), n.const_input(2)
    axes, steps = n.const_input(3), n.const_input(4)
    r = len(x)
    axes = [axis(ax, r) for ax in (axes if axes is not None else range(len(starts)))]
    steps = [int(s) for s in (steps if steps is not None else [1] * len(axes))]
    if any(s <= 0 for s in steps):
        raise Unsupported
    n_st, n_en = [], []
    for ax, st, en in zip(axes, starts, ends):
        dim = x[ax]
        st, en = int(st), int(en)
        st = min(max(st + dim if st < 0 else st, 0), dim)
        en = min(max(en + dim if en < 0 else en, 0), dim)
        n_st.append(st)
        n_en.append(max(en, st))
    return "Slice", n.inputs[:1], {"axes": tuple(axes), "starts": tuple(n_st), "ends": tuple(n_en),
                                   "steps": tuple(steps)}


def _export_slice(e, n) -> None:
    a, nm = n.attrs, n.name
    e.node("Slice", [n.inputs[0], e.const(f"{nm}_starts", list(a["starts"])), e.const(f"{nm}_ends", list(a["ends"])),
                     e.const(f"{nm}_axes", list(a["axes"])), e.const(f"{nm}_steps", list(a["steps"]))], n.outputs, nm)


# ---------------------------------------------------------------------------------------------------- Gather
def _gather_infer(ins, a):
    x, ax = ins[0].shape, a["axis"]
    if not 0 <= ax < len(x):
        raise ShapeError(f"axis {ax} out of range for {x}")
    if ins[1].dtype not in ("int64", "int32"):
        raise ShapeError(f"indices must be int32/int64, got {ins[1].dtype}")
    return [TensorType(x[:ax] + ins[1].shape + x[ax + 1:], ins[0].dtype)]


def _gather(xs, a):
    torch = torch_()
    data, idx, ax = xs[0], xs[1].long(), a["axis"]
    idx = torch.where(idx < 0, idx + data.shape[ax], idx)
    flat = torch.index_select(data, ax, idx.reshape(-1))
    return [flat.reshape(tuple(data.shape[:ax]) + tuple(idx.shape) + tuple(data.shape[ax + 1:]))]


def _import_gather(n: OnnxNode):
    return "Gather", n.inputs, {"axis": axis(n.attrs.get("axis", 0), len(n.x))}


def _gather_tf(tf, xs, a, c):
    data, idx, ax = xs[0], xs[1], a["axis"]
    idx = tf.where(idx < 0, idx + tf.cast(c.in_shapes[0][ax], idx.dtype), idx)
    return [tf.gather(data, idx, axis=ax)]


# ---------------------------------------------------------------------------------------------------- JAX
def _split_jax(J, xs, a, c):
    bounds, start = [], 0
    for n in list(a["split"])[:-1]:
        start += n
        bounds.append(start)
    return list(J.jnp.split(xs[0], bounds, axis=a["axis"]))


def _pad_jax(J, xs, a, c):
    pads, r = a["pads"], len(c.in_shapes[0])
    return [J.lax.pad(xs[0], J.jnp.asarray(a["value"], xs[0].dtype), [(pads[i], pads[i + r], 0) for i in range(r)])]


def _gather_jax(J, xs, a, c):
    data, idx, ax = xs[0], xs[1], a["axis"]
    idx = J.jnp.where(idx < 0, idx + c.in_shapes[0][ax], idx)
    return [J.jnp.take(data, idx, axis=ax)]


DEFS = [
    OpDef(name="Concat", attrs=("axis",), infer=_concat_infer,
          compute=lambda xs, a: [torch_().cat(list(xs), dim=a["axis"])], from_onnx=_import_concat,
          to_onnx=export_with_axis, tf=lambda tf, xs, a, c: [tf.concat(list(xs), axis=c.axis(a["axis"]))],
          tf_layout="any", jax=lambda J, xs, a, c: [J.jnp.concatenate(list(xs), axis=a["axis"])]),
    OpDef(name="Split", attrs=("axis", "split"), infer=_split_infer,
          compute=lambda xs, a: list(torch_().split(xs[0], list(a["split"]), dim=a["axis"])),
          from_onnx=_import_split, to_onnx=_export_split, tf=_split_tf, tf_layout="any", jax=_split_jax),
    OpDef(name="Transpose", attrs=("perm",), infer=_transpose_infer,
          compute=lambda xs, a: [xs[0].permute(tuple(a["perm"])).contiguous()], from_onnx=_import_transpose,
          to_onnx=_export_transpose, tf=lambda tf, xs, a, c: [tf.transpose(xs[0], list(a["perm"]))],
          input_ranks=_transpose_ranks, jax=lambda J, xs, a, c: [J.jnp.transpose(xs[0], tuple(a["perm"]))]),
    OpDef(name="Reshape", attrs=("shape",), infer=_reshape_infer, compute=lambda xs, a: [xs[0].reshape(a["shape"])],
          view=True, from_onnx=_import_reshape, onnx_types=("Reshape", "Unsqueeze", "Squeeze"),
          to_onnx=_export_reshape, tf=lambda tf, xs, a, c: [tf.reshape(xs[0], list(a["shape"]))],
          jax=lambda J, xs, a, c: [J.jnp.reshape(xs[0], tuple(a["shape"]))]),
    OpDef(name="Flatten", attrs=("axis",), infer=_flatten_infer,
          compute=lambda xs, a: [xs[0].reshape(prod(xs[0].shape[:a["axis"]]), -1)], view=True,
          from_onnx=_import_flatten, to_onnx=export_with_axis,
          tf=lambda tf, xs, a, c: [tf.reshape(xs[0], list(c.out_shapes[0]))],
          jax=lambda J, xs, a, c: [J.jnp.reshape(xs[0], tuple(c.out_shapes[0]))]),
    OpDef(name="Pad", attrs=("pads", "mode", "value"), infer=_pad_infer, compute=_pad, from_onnx=_import_pad,
          to_onnx=_export_pad, tf=_pad_tf, tf_layout="any", jax=_pad_jax),
    OpDef(name="Slice", attrs=("axes", "starts", "ends", "steps"), infer=_slice_infer,
          compute=lambda xs, a: [xs[0][_slice_index(xs[0].dim(), a)]], from_onnx=_import_slice,
          to_onnx=_export_slice, tf=lambda tf, xs, a, c: [xs[0][_slice_index(len(c.in_shapes[0]), a)]],
          jax=lambda J, xs, a, c: [xs[0][_slice_index(len(c.in_shapes[0]), a)]]),
    OpDef(name="Gather", attrs=("axis",), infer=_gather_infer, compute=_gather, from_onnx=_import_gather,
          to_onnx=export_with_axis, tf=_gather_tf, jax=_gather_jax),
]
