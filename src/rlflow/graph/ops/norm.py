"""Normalisation and reductions: BatchNormalization (inference), LayerNormalization, Softmax, ReduceMean."""

from __future__ import annotations

import numpy as np

from rlflow.graph.ops.core import (OnnxNode, OpDef, ShapeError, Unsupported, axis, broadcasts_to, export_with_axis,
                                   flops_per_out, ranks, torch_)
from rlflow.graph.types import TensorType


# ------------------------------------------------------------------------------------------------ BatchNormalization
def _bn_infer(ins, a):
    x = ins[0].shape
    if len(ins) != 5:
        raise ShapeError(f"expects 5 inputs (x, scale, bias, mean, var), got {len(ins)}")
    if len(x) < 2 or any(t.shape != (x[1],) for t in ins[1:5]):
        raise ShapeError(f"BatchNormalization parameters must have shape ({x[1] if len(x) > 1 else '?'},), got "
                         f"{', '.join(str(t.shape) for t in ins[1:5])}")
    return [ins[0]]


def _bn(xs, a):
    x, scale, bias, mean, var = xs
    shape = (1, -1) + (1,) * (x.dim() - 2)
    inv = scale / torch_().sqrt(var + a["epsilon"])
    return [x * inv.reshape(shape) + (bias - mean * inv).reshape(shape)]


def _import_bn(n: OnnxNode):
    if n.n_outputs > 1 or n.attrs.get("training_mode", 0) or n.x is None or len(n.x) < 2:
        raise Unsupported
    return "BatchNormalization", n.inputs, {"epsilon": float(n.attrs.get("epsilon", 1e-5))}


def _export_bn(e, n) -> None:
    e.node("BatchNormalization", n.inputs, n.outputs, n.name, epsilon=n.attrs["epsilon"])


def _bn_tf(tf, xs, a, c):
    x, scale, bias, mean, var = xs
    inv = scale / tf.sqrt(var + a["epsilon"])
    shift = bias - mean * inv
    if not c.nhwc:  # channels on axis 1: (C,) -> (C, 1, ..., 1); in NHWC they are last and broadcast as they are
        shape = (-1,) + (1,) * (len(c.in_shapes[0]) - 2)
        inv, shift = tf.reshape(inv, shape), tf.reshape(shift, shape)
    return [x * inv + shift]


# ------------------------------------------------------------------------------------------------ LayerNormalization
def _ln_infer(ins, a):
    x = ins[0].shape
    ax = a["axis"]
    if len(ins) not in (2, 3):
        raise ShapeError(f"expects 2 or 3 inputs (x, scale, bias), got {len(ins)}")
    if not 0 <= ax < len(x):
        raise ShapeError(f"axis {ax} out of range for {x}")
    for what, t in zip(("scale", "bias"), ins[1:]):
        broadcasts_to(t.shape, x, what)  # ONNX: unidirectional broadcasting to X (onnxruntime agrees)
    return [ins[0]]


def _ln(xs, a):
    x = xs[0]
    dims = tuple(range(a["axis"], x.dim()))
    mean = x.mean(dim=dims, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=dims, keepdim=True)
    y = (x - mean) / torch_().sqrt(var + a["epsilon"]) * xs[1]
    return [y + xs[2] if len(xs) > 2 else y]


def _import_ln(n: OnnxNode):
    if n.n_outputs > 1 or n.attrs.get("stash_type", 1) != 1:
        raise Unsupported
    return "LayerNormalization", n.inputs, {"axis": axis(n.attrs.get("axis", -1), len(n.x)),
                                            "epsilon": float(n.attrs.get("epsilon", 1e-5))}


def _export_ln(e, n) -> None:
    """LayerNormalization from opset 17; below that as ReduceMean/Sub/Mul/Add/Sqrt/Div."""
    g, a, nm = e.graph, n.attrs, n.name
    if g.opset >= 17:
        e.node("LayerNormalization", n.inputs, n.outputs, nm, epsilon=a["epsilon"], axis=a["axis"])
        return
    x = n.inputs[0]
    rank = g.types[x].rank
    axes = list(range(a["axis"], rank))
    dt = np.dtype(g.types[x].dtype)
    mean, d, sq, var, ve, std, norm = (e.fresh(f"{nm}_{s}") for s in ("mean", "d", "sq", "var", "ve", "std", "n"))
    e.node("ReduceMean", [x], [mean], f"{nm}_mean", axes=axes, keepdims=1)
    e.node("Sub", [x, mean], [d], f"{nm}_sub")
    e.node("Mul", [d, d], [sq], f"{nm}_sq")
    e.node("ReduceMean", [sq], [var], f"{nm}_var", axes=axes, keepdims=1)
    e.node("Add", [var, e.const(f"{nm}_eps", a["epsilon"], dt)], [ve], f"{nm}_eps")
    e.node("Sqrt", [ve], [std], f"{nm}_sqrt")
    e.node("Div", [d, std], [norm], f"{nm}_div")
    if len(n.inputs) > 2:
        scaled = e.fresh(f"{nm}_scaled")
        e.node("Mul", [norm, n.inputs[1]], [scaled], f"{nm}_scale")
        e.node("Add", [scaled, n.inputs[2]], [n.outputs[0]], nm)
    else:
        e.node("Mul", [norm, n.inputs[1]], [n.outputs[0]], nm)


def _ln_tf(tf, xs, a, c):
    x = xs[0]
    axes = tuple(range(a["axis"], len(c.in_shapes[0])))
    mean = tf.reduce_mean(x, axis=axes, keepdims=True)
    var = tf.reduce_mean(tf.square(x - mean), axis=axes, keepdims=True)
    y = (x - mean) / tf.sqrt(var + a["epsilon"]) * xs[1]
    return [y + xs[2] if len(xs) > 2 else y]


# ---------------------------------------------------------------------------------------------------- Softmax
def _softmax_infer(ins, a):
    if not 0 <= a["axis"] < ins[0].rank:
        raise ShapeError(f"axis {a['axis']} out of range for {ins[0].shape}")
    return [ins[0]]


def _import_softmax(n: OnnxNode):
    return "Softmax", n.inputs, {"axis": axis(n.attrs.get("axis", -1), len(n.x))}


# ---------------------------------------------------------------------------------------------------- ReduceMean
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


def _import_reduce_mean(n: OnnxNode):
    a, ins = n.attrs, n.inputs
    if n.opset >= 18:
        axes = n.const_input(1)
        if len(ins) > 1 and axes is None:
            raise Unsupported
    else:
        axes = a.get("axes")
    if a.get("noop_with_empty_axes", 0) and (axes is None or len(axes) == 0):
        return "Identity", ins[:1], {}
    axes = tuple(sorted(axis(v, len(n.x)) for v in axes)) if axes is not None else ()
    return "ReduceMean", ins[:1], {"axes": axes, "keepdims": int(a.get("keepdims", 1))}


def _export_reduce_mean(e, n) -> None:
    a, ins, nm = n.attrs, n.inputs, n.name
    if not a["axes"]:
        e.node("ReduceMean", ins, n.outputs, nm, keepdims=a["keepdims"])
    elif e.graph.opset >= 18:
        e.node("ReduceMean", [ins[0], e.const(f"{nm}_axes", list(a["axes"]))], n.outputs, nm, keepdims=a["keepdims"])
    else:
        e.node("ReduceMean", ins, n.outputs, nm, axes=list(a["axes"]), keepdims=a["keepdims"])


def _reduce_mean_tf(tf, xs, a, c):
    axes = a["axes"] or tuple(range(len(c.in_shapes[0])))
    return [tf.reduce_mean(xs[0], axis=list(axes), keepdims=bool(a["keepdims"]))]


# ---------------------------------------------------------------------------------------------------- JAX
def _bn_jax(J, xs, a, c):
    x, scale, bias, mean, var = xs
    shape = (1, -1) + (1,) * (x.ndim - 2)
    inv = scale / J.jnp.sqrt(var + a["epsilon"])
    return [x * inv.reshape(shape) + (bias - mean * inv).reshape(shape)]


def _ln_jax(J, xs, a, c):
    x = xs[0]
    dims = tuple(range(a["axis"], x.ndim))
    mean = J.jnp.mean(x, axis=dims, keepdims=True)
    var = J.jnp.mean((x - mean) ** 2, axis=dims, keepdims=True)
    y = (x - mean) / J.jnp.sqrt(var + a["epsilon"]) * xs[1]
    return [y + xs[2] if len(xs) > 2 else y]


def _reduce_mean_jax(J, xs, a, c):
    axes = tuple(a["axes"]) or tuple(range(xs[0].ndim))
    return [J.jnp.mean(xs[0], axis=axes, keepdims=bool(a["keepdims"]))]


DEFS = [
    OpDef(name="BatchNormalization", attrs=("epsilon",), infer=_bn_infer, compute=_bn, flops=flops_per_out(2),
          from_onnx=_import_bn, to_onnx=_export_bn, tf=_bn_tf, tf_layout="any", input_ranks=ranks(4, 1, 1, 1, 1),
          positive_inputs=(4,), jax=_bn_jax),
    OpDef(name="LayerNormalization", attrs=("axis", "epsilon"), infer=_ln_infer, compute=_ln, flops=flops_per_out(8),
          from_onnx=_import_ln, to_onnx=_export_ln, tf=_ln_tf, jax=_ln_jax),
    OpDef(name="Softmax", attrs=("axis",), infer=_softmax_infer,
          compute=lambda xs, a: [torch_().softmax(xs[0], dim=a["axis"])], flops=flops_per_out(5),
          from_onnx=_import_softmax, to_onnx=export_with_axis,
          tf=lambda tf, xs, a, c: [tf.nn.softmax(xs[0], axis=a["axis"])],
          jax=lambda J, xs, a, c: [J.nn.softmax(xs[0], axis=a["axis"])]),
    OpDef(name="ReduceMean", attrs=("axes", "keepdims"), infer=_reduce_mean_infer, compute=_reduce_mean,
          flops=lambda ins, outs, a: ins[0].numel, from_onnx=_import_reduce_mean, to_onnx=_export_reduce_mean,
          tf=_reduce_mean_tf, jax=_reduce_mean_jax),
]
