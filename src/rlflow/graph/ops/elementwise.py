"""Element-wise ops: Add, Sub, Mul, Div, Pow, Relu, Sigmoid, Tanh, Erf, Sqrt, Identity, Gelu, TASO's ScalarMul, and
IsNaN and Where (Hugging Face's exports guard a softmax with ``Where(IsNaN(p), 0, p)``)."""

from __future__ import annotations

import numpy as np

from rlflow.graph.ops.core import (OnnxNode, OpDef, ShapeError, Unsupported, broadcast, flops_per_out, import_plain,
                                   onnx_dtype_name, ranks, same, torch_, F_)
from rlflow.graph.types import FLOAT_DTYPES, TensorType


def _binary_infer(ins, a):
    if len(ins) != 2:
        raise ShapeError(f"expects 2 inputs, got {len(ins)}")
    if ins[0].dtype != ins[1].dtype:
        raise ShapeError(f"input types differ: {ins[0].dtype} and {ins[1].dtype}")
    return [TensorType(broadcast(ins[0].shape, ins[1].shape), ins[0].dtype)]


def _import_same_types(n: OnnxNode):
    """A binary op the IR models only with both inputs of one type (ONNX's Pow may raise to an integer power)."""
    if len(n.in_types) == 2 and n.in_types[0] and n.in_types[1] and n.in_types[0].dtype != n.in_types[1].dtype:
        raise Unsupported
    return import_plain(n)


def _binary(name, torch_fn, tf_fn, jax_fn, positive=(), commutative=False):
    return OpDef(name=name, attrs=(), infer=_binary_infer, compute=lambda xs, a: [torch_fn(xs[0], xs[1])],
                 flops=flops_per_out(1), elementwise=True, broadcasting=True, commutative=commutative,
                 from_onnx=_import_same_types,
                 tf=lambda tf, xs, a, c: [tf_fn(tf, xs[0], xs[1])], tf_layout="any", positive_inputs=positive,
                 jax=lambda J, xs, a, c: [jax_fn(J, xs[0], xs[1])])


def _unary(name, torch_fn, tf_fn, jax_fn, cost, positive=(), **kw):
    return OpDef(name=name, attrs=(), infer=same, compute=lambda xs, a: [torch_fn(xs[0])], flops=flops_per_out(cost),
                 elementwise=True, tf=lambda tf, xs, a, c: [tf_fn(tf, xs[0])], tf_layout="any",
                 jax=lambda J, xs, a, c: [jax_fn(J, xs[0])], positive_inputs=positive, **kw)


def _import_identity(n: OnnxNode):
    if n.op_type == "Cast":  # a cast to the type the tensor already has
        if n.in_types[0] is None or onnx_dtype_name(n.attrs["to"]) != n.in_types[0].dtype:
            raise Unsupported
        return "Identity", n.inputs[:1], {}
    return import_plain(n)


# ---------------------------------------------------------------------------------------------------- Gelu
def _import_gelu(n: OnnxNode):
    return "Gelu", n.inputs, {"approximate": n.attrs.get("approximate", "none")}


def _export_gelu(e, n) -> None:
    """Gelu itself from opset 20, below that as Erf (or Tanh) arithmetic."""
    approximate = n.attrs.get("approximate", "none")
    if e.graph.opset >= 20:
        e.node("Gelu", n.inputs, n.outputs, n.name, approximate=approximate)
        return
    x, y, nm = n.inputs[0], n.outputs[0], n.name
    dt = np.dtype(e.graph.types[x].dtype)
    t = [e.fresh(f"{nm}_t{k}") for k in range(6)]
    if approximate == "tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        e.node("Mul", [x, x], [t[0]], f"{nm}_sq")
        e.node("Mul", [t[0], x], [t[1]], f"{nm}_cube")
        e.node("Mul", [t[1], e.const(f"{nm}_c", 0.044715, dt)], [t[2]], f"{nm}_scale3")
        e.node("Add", [x, t[2]], [t[3]], f"{nm}_inner")
        e.node("Mul", [t[3], e.const(f"{nm}_k", np.sqrt(2 / np.pi), dt)], [t[4]], f"{nm}_scale")
        e.node("Tanh", [t[4]], [t[5]], f"{nm}_tanh")
    else:  # 0.5 x (1 + erf(x / sqrt 2))
        e.node("Div", [x, e.const(f"{nm}_sqrt2", np.sqrt(2.0), dt)], [t[4]], f"{nm}_div")
        e.node("Erf", [t[4]], [t[5]], f"{nm}_erf")
    one_plus = e.fresh(f"{nm}_onep")
    half_x = e.fresh(f"{nm}_halfx")
    e.node("Add", [t[5], e.const(f"{nm}_one", 1.0, dt)], [one_plus], f"{nm}_add1")
    e.node("Mul", [x, e.const(f"{nm}_half", 0.5, dt)], [half_x], f"{nm}_half")
    e.node("Mul", [half_x, one_plus], [y], nm)


# ---------------------------------------------------------------------------------------------------- ScalarMul
def _scalar_mul_infer(ins, a):
    if ins[1].rank != 0:
        raise ShapeError(f"the scalar input must be 0-D, got {ins[1].shape}")
    return [ins[0]]


def _export_scalar_mul(e, n) -> None:
    e.node("Mul", n.inputs, n.outputs, n.name)


# ---------------------------------------------------------------------------------------------------- IsNaN, Where
def _isnan_infer(ins, a):
    if ins[0].dtype not in FLOAT_DTYPES:
        raise ShapeError(f"IsNaN reads a floating-point tensor, got {ins[0].dtype}")
    return [TensorType(ins[0].shape, "bool")]


def _where_infer(ins, a):
    if len(ins) != 3:
        raise ShapeError(f"expects 3 inputs, got {len(ins)}")
    cond, x, y = ins
    if cond.dtype != "bool":
        raise ShapeError(f"the condition must be bool, got {cond.dtype}")
    if x.dtype != y.dtype:
        raise ShapeError(f"input types differ: {x.dtype} and {y.dtype}")
    return [TensorType(broadcast(cond.shape, broadcast(x.shape, y.shape)), x.dtype)]


# ---------------------------------------------------------------------------------------------------- JAX
# A JAX lowering is ``(J, inputs, attrs, ctx) -> outputs``: ``J`` holds ``jnp``, ``lax`` and ``nn`` (jax.nn),
# passed in so the registry never imports JAX; ``ctx`` has ``in_shapes``/``out_shapes``
# (:mod:`rlflow.graph.exec.jax_exec`).
def _jax_gelu(J, xs, a, c):
    return [J.nn.gelu(xs[0], approximate=a.get("approximate", "none") == "tanh")]


DEFS = [
    _binary("Add", lambda x, y: x + y, lambda tf, x, y: x + y, lambda J, x, y: x + y, commutative=True),
    _binary("Sub", lambda x, y: x - y, lambda tf, x, y: x - y, lambda J, x, y: x - y),
    _binary("Mul", lambda x, y: x * y, lambda tf, x, y: x * y, lambda J, x, y: x * y, commutative=True),
    _binary("Div", lambda x, y: x / y, lambda tf, x, y: x / y, lambda J, x, y: x / y, positive=(1,)),
    _binary("Pow", lambda x, y: torch_().pow(x, y), lambda tf, x, y: tf.pow(x, y), lambda J, x, y: J.jnp.power(x, y),
            positive=(0,)),
    _unary("Relu", lambda x: torch_().relu(x), lambda tf, x: tf.nn.relu(x), lambda J, x: J.nn.relu(x), 1),
    _unary("Sigmoid", lambda x: torch_().sigmoid(x), lambda tf, x: tf.sigmoid(x), lambda J, x: J.nn.sigmoid(x), 4),
    _unary("Tanh", lambda x: torch_().tanh(x), lambda tf, x: tf.tanh(x), lambda J, x: J.jnp.tanh(x), 4),
    _unary("Erf", lambda x: torch_().erf(x), lambda tf, x: tf.math.erf(x), lambda J, x: J.lax.erf(x), 4),
    _unary("Sqrt", lambda x: torch_().sqrt(x), lambda tf, x: tf.sqrt(x), lambda J, x: J.jnp.sqrt(x), 1,
           positive=(0,)),
    OpDef(name="Identity", attrs=(), infer=same, compute=lambda xs, a: [xs[0]], view=True, elementwise=True,
          from_onnx=_import_identity, onnx_types=("Identity", "Cast"),
          tf=lambda tf, xs, a, c: [tf.identity(xs[0])], tf_layout="any", jax=lambda J, xs, a, c: [xs[0]]),
    OpDef(name="Gelu", attrs=("approximate",), infer=same,
          compute=lambda xs, a: [F_().gelu(xs[0], approximate=a.get("approximate", "none"))],
          flops=flops_per_out(8), elementwise=True, from_onnx=_import_gelu, to_onnx=_export_gelu,
          tf=lambda tf, xs, a, c: [tf.nn.gelu(xs[0], approximate=a.get("approximate", "none") == "tanh")],
          tf_layout="any", jax=_jax_gelu),
    # TASO's helper: multiply a tensor by a 0-D scalar tensor.
    OpDef(name="ScalarMul", attrs=(), infer=_scalar_mul_infer, compute=lambda xs, a: [xs[0] * xs[1]],
          flops=flops_per_out(1), elementwise=True, onnx_type="Mul", from_onnx=None, to_onnx=_export_scalar_mul,
          tf=lambda tf, xs, a, c: [xs[0] * xs[1]], tf_layout="any", input_ranks=ranks(None, 0),
          jax=lambda J, xs, a, c: [xs[0] * xs[1]]),
    OpDef(name="IsNaN", attrs=(), infer=_isnan_infer, compute=lambda xs, a: [torch_().isnan(xs[0])],
          flops=flops_per_out(1), elementwise=True, tf=lambda tf, xs, a, c: [tf.math.is_nan(xs[0])], tf_layout="any",
          jax=lambda J, xs, a, c: [J.jnp.isnan(xs[0])]),
    OpDef(name="Where", attrs=(), infer=_where_infer, compute=lambda xs, a: [torch_().where(xs[0], xs[1], xs[2])],
          flops=flops_per_out(1), elementwise=True, broadcasting=True,
          tf=lambda tf, xs, a, c: [tf.where(xs[0], xs[1], xs[2])], tf_layout="any",
          jax=lambda J, xs, a, c: [J.jnp.where(xs[0], xs[1], xs[2])]),
]
