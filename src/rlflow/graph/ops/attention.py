"""Fused attention: ONNX's ``Attention`` (opset 23), ``softmax(Q K^T * scale + mask) V`` as one op.

Inputs ``Q, K, V[, mask]``, in one of ONNX's two forms:

- 4-D (``q_num_heads = kv_num_heads = 0``): Q ``(B, Hq, Sq, D)``, K ``(B, Hkv, Skv, D)``, V ``(B, Hkv, Skv, Dv)``,
  output ``(B, Hq, Sq, Dv)``;
- 3-D (``q_num_heads``, ``kv_num_heads`` > 0): Q ``(B, Sq, Hq*D)``, K ``(B, Skv, Hkv*D)``, V ``(B, Skv, Hkv*Dv)``,
  output ``(B, Sq, Hq*Dv)``.

``Hq`` a multiple of ``Hkv`` (grouped-query attention: each K/V head serves ``Hq / Hkv`` query heads). The mask
is additive, of Q's float type, broadcasting to the scores ``(B, Hq, Sq, Skv)``. Attributes: ``scale`` (always
set: the import fills in ONNX's default ``1 / sqrt(D)``), ``is_causal`` (query ``i`` attends keys ``j <= i``, the
top-left aligned mask of ONNX without a KV cache, torch and jax), ``q_num_heads``, ``kv_num_heads``. A query
row the mask leaves no key (all -inf) is a row of zeros, as ONNX says (torch's SDPA and onnxruntime do so; the jax
and TensorFlow lowerings see to it).

What the import keeps opaque: a boolean mask, a KV cache (``past_key``/``past_value``, the ``present_*`` and
``qk_matmul_output`` outputs), ``softcap``, a ``softmax_precision`` other than Q's type, opset 24's
``nonpad_kv_seqlen`` and opset 25's sliding window. Export: ``Attention`` from opset 23, below that the primitive
ops it stands for (Reshape/Transpose for the 3-D form, Concat for grouped heads, MatMul, Mul, Add, Softmax),
all of them IR ops again when read back.

Costs: the FLOPs of the two products, the scaling, the mask and the softmax over the full score matrix; the bytes
are what a flash-style kernel moves (Q, K, V, the mask and the output; the score matrix never leaves the chip).
Backends: torch's ``scaled_dot_product_attention``, onnxruntime's own ``Attention`` kernel, ``jax.nn.
dot_product_attention`` (when ``Dv == D``; composed otherwise); TensorFlow has no fused attention op, so its
lowering composes matmul and softmax.
"""

from __future__ import annotations

import math

import numpy as np

from rlflow.graph.ops.core import OnnxNode, OpDef, ShapeError, Unsupported, broadcasts_to, onnx_dtype_name, F_, torch_
from rlflow.graph.types import FLOAT_DTYPES, TensorType

#: the opset that defines ONNX's fused ``Attention``
ATTENTION_OPSET = 23
#: what each backend runs for one ``Attention`` node (the lowerings below; the report's rule section lists it)
KERNELS = {
    "torch": "torch.nn.functional.scaled_dot_product_attention (one fused kernel: flash, memory-efficient or "
             "math, as torch picks for the device)",
    "ort": "onnxruntime's own Attention kernel (opset 23)",
    "jax": "jax.nn.dot_product_attention when V's head size equals Q's, else composed (matmul, softmax, matmul)",
    "tf": "composed: tf.linalg.matmul, tf.nn.softmax, tf.linalg.matmul (TensorFlow has no fused attention op; "
          "Grappler or XLA may fuse the pieces)",
    "below opset 23": "the ONNX export writes the primitive ops (MatMul, Mul, Add, Softmax, MatMul)",
}


# ---------------------------------------------------------------------------------------------------- shapes
def dims(ins, a) -> tuple[int, int, int, int, int, int, int]:
    """(B, Hq, Hkv, Sq, Skv, D, Dv) of an Attention node's inputs; ShapeError if they do not fit together."""
    q, k, v = (t.shape for t in ins[:3])
    hq, hkv = a["q_num_heads"], a["kv_num_heads"]
    if (hq > 0) != (hkv > 0) or hq < 0 or hkv < 0:
        raise ShapeError(f"q_num_heads {hq} and kv_num_heads {hkv}: both 0 (4-D inputs) or both positive (3-D)")
    if hq:
        if not len(q) == len(k) == len(v) == 3:
            raise ShapeError(f"the 3-D form needs 3-D Q, K, V, got {q}, {k}, {v}")
        if q[2] % hq or k[2] % hkv or v[2] % hkv:
            raise ShapeError(f"hidden sizes {q[2]}, {k[2]}, {v[2]} do not split into {hq}, {hkv}, {hkv} heads")
        (b, sq, d), (bk, skv, dk), (bv, sv, dv) = (q[0], q[1], q[2] // hq), (k[0], k[1], k[2] // hkv), \
            (v[0], v[1], v[2] // hkv)
        hv = hkv
    else:
        if not len(q) == len(k) == len(v) == 4:
            raise ShapeError(f"needs 4-D Q, K, V (or q_num_heads/kv_num_heads with 3-D ones), got {q}, {k}, {v}")
        (b, hq, sq, d), (bk, hkv, skv, dk), (bv, hv, sv, dv) = q, k, v
    if not b == bk == bv or d != dk or sv != skv or hv != hkv or hkv == 0 or hq % hkv:
        raise ShapeError(f"Q {q}, K {k}, V {v} do not fit together (batch, head size, KV length, "
                         "query heads a multiple of KV heads)")
    return b, hq, hkv, sq, skv, d, dv


def _infer(ins, a):
    if len(ins) not in (3, 4):
        raise ShapeError(f"expects 3 or 4 inputs (Q, K, V, mask), got {len(ins)}")
    dtype = ins[0].dtype
    if dtype not in FLOAT_DTYPES or any(t.dtype != dtype for t in ins):
        raise ShapeError(f"Q, K, V and the mask must have one float type, got {', '.join(t.dtype for t in ins)}")
    if a["is_causal"] not in (0, 1):
        raise ShapeError(f"is_causal must be 0 or 1, got {a['is_causal']}")
    b, hq, hkv, sq, skv, d, dv = dims(ins, a)
    if len(ins) > 3:
        broadcasts_to(ins[3].shape, (b, hq, sq, skv), "mask")
    shape = (b, sq, hq * dv) if a["q_num_heads"] else (b, hq, sq, dv)
    return [TensorType(shape, dtype)]


def _flops(ins, outs, a):
    b, hq, _, sq, skv, d, dv = dims(ins, a)
    scores = b * hq * sq * skv
    # Q K^T and P V, the scaling, the mask, the softmax (5 per element, as the Softmax op counts)
    return scores * (2 * d + 2 * dv + 1 + (len(ins) > 3) + 5)


def causal_bias(sq: int, skv: int, dtype) -> np.ndarray:
    """The additive causal mask ``(Sq, Skv)``: 0 where key ``j <= i``, -inf above the diagonal."""
    return np.triu(np.full((sq, skv), -np.inf, dtype=dtype), 1)


# ---------------------------------------------------------------------------------------------------- torch
def _attention(xs, a):
    torch = torch_()
    q, k, v = xs[:3]
    mask = xs[3] if len(xs) > 3 else None
    if mask is not None and mask.dim() < 2:  # SDPA takes a mask of rank >= 2 only (it broadcasts the rest)
        mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))
    hq, hkv = a["q_num_heads"], a["kv_num_heads"]
    if hq:  # (B, S, H*D) -> (B, H, S, D)
        q, k, v = (x.reshape(x.shape[0], x.shape[1], h, -1).transpose(1, 2) for x, h in ((q, hq), (k, hkv), (v, hkv)))
    causal = bool(a["is_causal"])
    if causal and mask is not None:  # torch takes a mask or is_causal, not both
        mask = mask + torch.from_numpy(causal_bias(q.shape[2], k.shape[2], np.float64)).to(mask.dtype)
        causal = False
    y = F_().scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=a["scale"],
                                          enable_gqa=q.shape[1] != k.shape[1])
    if hq:
        y = y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1)
    return [y]


# ---------------------------------------------------------------------------------------------------- ONNX
def _import(n: OnnxNode):
    a = n.attrs
    if n.n_outputs > 1 or len(n.inputs) > 4 or "" in n.inputs or any(t is None for t in n.in_types):
        raise Unsupported  # a KV cache, opset 24's nonpad_kv_seqlen, the present/qk outputs
    if a.get("softcap", 0.0) != 0.0 or a.get("qk_matmul_output_mode", 0) != 0 or \
            a.get("left_window_size", -1) != -1 or a.get("right_window_size", -1) != -1:
        raise Unsupported
    dtype = n.in_types[0].dtype
    if "softmax_precision" in a and onnx_dtype_name(a["softmax_precision"]) != dtype:
        raise Unsupported
    if len(n.inputs) > 3 and n.in_types[3].dtype != dtype:
        raise Unsupported  # a boolean mask
    hq, hkv = (int(a.get("q_num_heads", 0)), int(a.get("kv_num_heads", 0))) if len(n.x) == 3 else (0, 0)
    if len(n.x) == 3 and (hq <= 0 or hkv <= 0 or n.x[2] % hq):
        raise Unsupported
    head = n.x[2] // hq if hq else n.x[-1]
    scale = float(a["scale"]) if "scale" in a else 1.0 / math.sqrt(head)
    return "Attention", n.inputs, {"scale": scale, "is_causal": int(a.get("is_causal", 0)), "q_num_heads": hq,
                                   "kv_num_heads": hkv}


def _export(e, n) -> None:
    """``Attention`` from opset 23. onnxruntime (1.31) broadcasts only the mask's leading dimensions: its last two
    must be (Sq, Skv) exactly, so a mask like Hugging Face's ``(B, 1, 1, Skv)`` is first broadcast by adding zeros
    of shape (Sq, Skv): an ``Add``, which the import reads back as the IR's Add (or folds, for a constant mask),
    so the file stays runnable on every backend (an ``Expand`` would come back as an opaque node)."""
    a, ins = n.attrs, list(n.inputs)
    if e.graph.opset < ATTENTION_OPSET:
        _export_composed(e, n)
        return
    if len(ins) > 3:
        types = [e.graph.types[v] for v in ins]
        _, _, _, sq, skv, _, _ = dims(types, a)
        if types[3].shape[-2:] != (sq, skv):
            full = e.fresh(f"{n.name}_mask")
            zeros = e.const(f"{n.name}_mask_zeros", np.zeros((sq, skv)), np.dtype(types[3].dtype))
            e.node("Add", [ins[3], zeros], [full], full)
            ins[3] = full
    heads = {"q_num_heads": a["q_num_heads"], "kv_num_heads": a["kv_num_heads"]} if a["q_num_heads"] else {}
    e.node("Attention", ins, n.outputs, n.name, scale=float(a["scale"]), is_causal=a["is_causal"], **heads)


def _export_composed(e, n) -> None:
    """Below opset 23: the primitive ops (what torch's exporter writes for scaled_dot_product_attention there)."""
    g, a, nm = e.graph, n.attrs, n.name
    types = [g.types[v] for v in n.inputs]
    b, hq, hkv, sq, skv, d, dv = dims(types, a)
    dt = np.dtype(types[0].dtype)
    fresh = iter(e.fresh(f"{nm}_{k}") for k in range(32))

    def op(kind, ins, **attrs):
        out = next(fresh)
        e.node(kind, ins, [out], out, **attrs)
        return out

    def heads_first(x, h, size):  # (B, S, H*size) -> (B, H, S, size)
        x = op("Reshape", [x, e.const(f"{nm}_shape", [b, -1, h, size])])
        return op("Transpose", [x], perm=[0, 2, 1, 3])

    def repeat(x, s, size):  # (B, Hkv, S, size) -> (B, Hq, S, size), each KV head hq / hkv times in a row
        x = op("Reshape", [x, e.const(f"{nm}_shape", [b, hkv, 1, s, size])])
        x = op("Concat", [x] * (hq // hkv), axis=2)
        return op("Reshape", [x, e.const(f"{nm}_shape", [b, hq, s, size])])

    q, k, v = n.inputs[:3]
    if a["q_num_heads"]:
        q, k, v = heads_first(q, hq, d), heads_first(k, hkv, d), heads_first(v, hkv, dv)
    if hq != hkv:
        k, v = repeat(k, skv, d), repeat(v, skv, dv)
    s = op("MatMul", [q, op("Transpose", [k], perm=[0, 1, 3, 2])])
    s = op("Mul", [s, e.const(f"{nm}_scale", a["scale"], dt)])
    if len(n.inputs) > 3:
        s = op("Add", [s, n.inputs[3]])
    if a["is_causal"]:
        s = op("Add", [s, e.const(f"{nm}_causal", causal_bias(sq, skv, dt), dt)])
    p = op("Softmax", [s], axis=-1)
    if not a["q_num_heads"]:
        e.node("MatMul", [p, v], n.outputs, nm)
        return
    y = op("Transpose", [op("MatMul", [p, v])], perm=[0, 2, 1, 3])
    e.node("Reshape", [y, e.const(f"{nm}_shape", [b, sq, hq * dv])], n.outputs, nm)


# ---------------------------------------------------------------------------------------------------- TensorFlow
def _attention_tf(tf, xs, a, c):
    """TensorFlow has no fused attention op: this composes it, ``softmax(Q K^T * scale + mask) V`` with
    ``tf.linalg.matmul`` and ``tf.nn.softmax`` (Grappler or XLA may fuse the pieces)."""
    b, hq, hkv, sq, skv, d, dv = dims([_Shape(s) for s in c.in_shapes], a)
    q, k, v = xs[:3]
    if a["q_num_heads"]:
        q, k, v = (tf.transpose(tf.reshape(x, (b, -1, h, size)), (0, 2, 1, 3))
                   for x, h, size in ((q, hq, d), (k, hkv, d), (v, hkv, dv)))
    if hq != hkv:
        k, v = tf.repeat(k, hq // hkv, axis=1), tf.repeat(v, hq // hkv, axis=1)
    s = tf.linalg.matmul(q, k, transpose_b=True) * tf.constant(a["scale"], q.dtype)
    if len(xs) > 3:
        s = s + xs[3]
    if a["is_causal"]:
        s = s + tf.constant(causal_bias(sq, skv, q.dtype.as_numpy_dtype))
    p = tf.nn.softmax(s, axis=-1)
    if len(xs) > 3:  # a row without any key: zeros, not softmax's NaN
        p = tf.where(tf.reduce_all(tf.math.equal(s, -np.inf), axis=-1, keepdims=True), tf.zeros_like(p), p)
    y = tf.linalg.matmul(p, v)
    if a["q_num_heads"]:
        y = tf.reshape(tf.transpose(y, (0, 2, 1, 3)), (b, sq, hq * dv))
    return [y]


class _Shape:
    """A shape standing in for a TensorType where only ``.shape`` is read (:func:`dims`)."""

    def __init__(self, shape):
        self.shape = tuple(shape)


# ---------------------------------------------------------------------------------------------------- JAX
def _attention_jax(J, xs, a, c):
    """``jax.nn.dot_product_attention`` (inputs ``(B, S, H, D)``) when V's head size equals Q's, as jax requires;
    otherwise the same composition as TensorFlow's."""
    jnp = J.jnp
    b, hq, hkv, sq, skv, d, dv = dims([_Shape(s) for s in c.in_shapes], a)
    q, k, v = xs[:3]
    if a["q_num_heads"]:  # (B, S, H*D) -> (B, S, H, D)
        q, k, v = q.reshape(b, sq, hq, d), k.reshape(b, skv, hkv, d), v.reshape(b, skv, hkv, dv)
    else:
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    mask = xs[3] if len(xs) > 3 else None
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if d == dv:
        y = J.nn.dot_product_attention(q, k, v, bias=mask, scale=a["scale"], is_causal=bool(a["is_causal"]))
        if mask is not None:  # a row without any key: zeros, not NaN (dead: (B|1, H|1, Sq) -> (B|1, Sq, H|1, 1))
            bias = mask + causal_bias(sq, skv, mask.dtype) if a["is_causal"] else mask
            dead = jnp.all(bias == -jnp.inf, axis=-1)
            y = jnp.where(jnp.swapaxes(dead, 1, 2)[..., None], 0, y)
    else:  # (B, S, H, D) -> (B, H, S, D)
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
        k, v = jnp.repeat(k, hq // hkv, axis=1), jnp.repeat(v, hq // hkv, axis=1)
        s = jnp.matmul(q, jnp.swapaxes(k, -1, -2)) * a["scale"]
        if mask is not None:
            s = s + mask
        if a["is_causal"]:
            s = s + causal_bias(sq, skv, s.dtype)
        p = J.nn.softmax(s, axis=-1)
        if mask is not None:  # a row without any key: zeros, not NaN
            p = jnp.where(jnp.all(s == -jnp.inf, axis=-1, keepdims=True), 0, p)
        y = jnp.swapaxes(jnp.matmul(p, v), 1, 2)
    return [y.reshape(b, sq, hq * dv) if a["q_num_heads"] else jnp.swapaxes(y, 1, 2)]


def _ranks(a):
    r = 3 if a["q_num_heads"] else 4
    return (r, r, r, 4)


DEFS = [
    OpDef(name="Attention", attrs=("scale", "is_causal", "q_num_heads", "kv_num_heads"), infer=_infer,
          compute=_attention, flops=_flops, from_onnx=_import, to_onnx=_export, tf=_attention_tf,
          jax=_attention_jax, input_ranks=_ranks),
]
