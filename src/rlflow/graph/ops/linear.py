"""Linear algebra: MatMul (numpy broadcasting) and Gemm."""

from __future__ import annotations

from rlflow.graph.ops.core import OnnxNode, OpDef, ShapeError, broadcast, broadcasts_to, ranks, torch_
from rlflow.graph.types import TensorType


# ---------------------------------------------------------------------------------------------------- MatMul
def _matmul_infer(ins, a):
    x, y = ins[0].shape, ins[1].shape
    if not x or not y:
        raise ShapeError("MatMul inputs must have rank >= 1")
    if ins[0].dtype != ins[1].dtype:
        raise ShapeError(f"input types differ: {ins[0].dtype} and {ins[1].dtype}")
    xs, ys = (x if len(x) > 1 else (1,) + x), (y if len(y) > 1 else y + (1,))
    if xs[-1] != ys[-2]:
        raise ShapeError(f"inner dimensions differ: {x} @ {y}")
    batch = broadcast(xs[:-2], ys[:-2])
    out = batch + (xs[-2] if len(x) > 1 else None, ys[-1] if len(y) > 1 else None)
    return [TensorType(tuple(d for d in out if d is not None), ins[0].dtype)]


def _matmul_flops(ins, outs, a):
    k = ins[0].shape[-1]
    return 2 * outs[0].numel * k


def _matmul_tf(tf, xs, a, c):
    x, y = xs
    rx, ry = len(c.in_shapes[0]), len(c.in_shapes[1])
    if rx == 1:
        x = tf.expand_dims(x, 0)
    if ry == 1:
        y = tf.expand_dims(y, -1)
    z = tf.linalg.matmul(x, y)  # BatchMatMulV2 broadcasts the batch dimensions like numpy
    if ry == 1:
        z = tf.squeeze(z, -1)
    if rx == 1:
        z = tf.squeeze(z, -1 if ry == 1 else -2)
    return [z]


# ---------------------------------------------------------------------------------------------------- Gemm
def _gemm_infer(ins, a):
    A, B = ins[0].shape, ins[1].shape
    if len(A) != 2 or len(B) != 2:
        raise ShapeError("Gemm inputs must be 2-D")
    m, k = (A[1], A[0]) if a["transA"] else A
    k2, n = (B[1], B[0]) if a["transB"] else B
    if k != k2:
        raise ShapeError(f"inner dimensions differ: {A} x {B}")
    if len(ins) > 2:
        broadcasts_to(ins[2].shape, (m, n), "C")
    return [TensorType((m, n), ins[0].dtype)]


def _gemm(xs, a):
    """With a bias, one ``addmm`` (the bias added in the GEMM's epilogue, one kernel on a GPU, as a fused backend
    runs Gemm), else a plain product."""
    A = xs[0].T if a["transA"] else xs[0]
    B = xs[1].T if a["transB"] else xs[1]
    if len(xs) > 2 and xs[2].dtype == A.dtype:
        return [torch_().addmm(xs[2], A, B, beta=a["beta"], alpha=a["alpha"])]
    y = a["alpha"] * (A @ B) if a["alpha"] != 1.0 else A @ B
    if len(xs) > 2:
        y = y + (a["beta"] * xs[2] if a["beta"] != 1.0 else xs[2])
    return [y]


def _gemm_flops(ins, outs, a):
    return 2 * outs[0].numel * ins[0].shape[0 if a["transA"] else 1] + (outs[0].numel if len(ins) > 2 else 0)


def _import_gemm(n: OnnxNode):
    a = n.attrs
    return "Gemm", n.inputs, {"alpha": float(a.get("alpha", 1.0)), "beta": float(a.get("beta", 1.0)),
                              "transA": int(a.get("transA", 0)), "transB": int(a.get("transB", 0))}


def _export_gemm(e, n) -> None:
    a = n.attrs
    e.node("Gemm", n.inputs, n.outputs, n.name, alpha=a["alpha"], beta=a["beta"], transA=a["transA"],
           transB=a["transB"])


def _gemm_tf(tf, xs, a, c):
    y = tf.linalg.matmul(xs[0], xs[1], transpose_a=bool(a["transA"]), transpose_b=bool(a["transB"]))
    if a["alpha"] != 1.0:
        y = a["alpha"] * y
    if len(xs) > 2:
        y = y + (a["beta"] * xs[2] if a["beta"] != 1.0 else xs[2])
    return [y]


# ---------------------------------------------------------------------------------------------------- JAX
def _gemm_jax(J, xs, a, c):
    A = xs[0].T if a["transA"] else xs[0]
    B = xs[1].T if a["transB"] else xs[1]
    y = A @ B if a["alpha"] == 1.0 else a["alpha"] * (A @ B)
    if len(xs) > 2:
        y = y + (xs[2] if a["beta"] == 1.0 else a["beta"] * xs[2])
    return [y]


DEFS = [
    OpDef(name="MatMul", attrs=(), infer=_matmul_infer, compute=lambda xs, a: [torch_().matmul(xs[0], xs[1])],
          flops=_matmul_flops, tf=_matmul_tf, input_ranks=ranks(2, 2),
          jax=lambda J, xs, a, c: [J.jnp.matmul(xs[0], xs[1])]),
    OpDef(name="Gemm", attrs=("alpha", "beta", "transA", "transB"), infer=_gemm_infer, compute=_gemm,
          flops=_gemm_flops, from_onnx=_import_gemm, to_onnx=_export_gemm, tf=_gemm_tf, input_ranks=ranks(2, 2),
          jax=_gemm_jax),
]
