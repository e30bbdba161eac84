"""Convolution and pooling (2-D, NCHW): Conv (with a fused ``activation``), TASO's Enlarge, MaxPool, AveragePool,
GlobalAveragePool."""

from __future__ import annotations

import math

import numpy as np

from rlflow.graph.ops.core import (OnnxNode, OpDef, ShapeError, Unsupported, F_, export_plain, import_plain, ranks,
                                   tf_pad_or_crop, torch_)
from rlflow.graph.types import TensorType


def _conv_out(size: int, k: int, s: int, p0: int, p1: int, ceil: bool = False) -> int:
    span = size + p0 + p1 - k
    if span < 0:
        raise ShapeError(f"kernel {k} larger than padded input {size + p0 + p1}")
    out = (-(-span // s) if ceil else span // s) + 1
    if ceil and (out - 1) * s >= size + p0:  # the last window must start inside the input or its left padding
        out -= 1
    return out


def _pad_for_torch(x, pads, value=0.0):
    """ONNX pads (t, l, b, r) -> symmetric torch padding if possible, else an explicit F.pad."""
    pt, pl, pb, pr = pads
    if pt == pb and pl == pr:
        return x, (pt, pl)
    return F_().pad(x, (pl, pr, pt, pb), value=value), (0, 0)


# ---------------------------------------------------------------------------------------------------- Conv
def _conv_infer(ins, a):
    if len(ins) not in (2, 3):
        raise ShapeError(f"expects 2 or 3 inputs, got {len(ins)}")
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


def _conv(xs, a):
    x, padding = _pad_for_torch(xs[0], a["pads"])
    y = F_().conv2d(x, xs[1], xs[2] if len(xs) > 2 else None, a["strides"], padding, 1, a["group"])
    return [torch_().relu(y) if a["activation"] == "relu" else y]


def _conv_flops(ins, outs, a):
    w = ins[1].shape
    macs = outs[0].numel * w[1] * w[2] * w[3]
    return 2 * macs + (outs[0].numel if len(ins) > 2 else 0) + (outs[0].numel if a["activation"] == "relu" else 0)


def _import_conv(n: OnnxNode):
    a, x, w = n.attrs, n.x, n.in_shapes[1]
    if x is None or w is None or len(x) != 4 or any(d != 1 for d in a.get("dilations", (1, 1))):
        raise Unsupported
    kernel = tuple(a.get("kernel_shape", w[2:]))
    strides = tuple(int(s) for s in a.get("strides", (1, 1)))
    return "Conv", n.inputs, {"strides": strides, "pads": n.pads2d(kernel, strides), "group": int(a.get("group", 1)),
                              "activation": "none"}


def _export_conv(e, n) -> None:
    """Conv, followed by a Relu for a fused activation."""
    a, outs, nm = n.attrs, n.outputs, n.name
    w = e.graph.types[n.inputs[1]].shape
    conv_out = e.fresh(f"{outs[0]}_preact") if a["activation"] == "relu" else outs[0]
    e.node("Conv", n.inputs, [conv_out], nm, kernel_shape=list(w[2:]), strides=list(a["strides"]),
           pads=list(a["pads"]), group=a["group"], dilations=[1, 1])
    if a["activation"] == "relu":
        e.node("Relu", [conv_out], outs, f"{nm}_relu")


def _conv_tf(tf, xs, a, c):
    """xs: NHWC input, HWIO weight (in-channels per group), optional bias. The ONNX pads, asymmetric or not, are
    Conv2D's explicit padding (one op; XLA ran faster with it than with tf.pad + VALID). Groups (depthwise
    included) are TF's grouped Conv2D: in-channels = groups * the weight's in-channels."""
    pt, pl, pb, pr = a["pads"]
    padding = [[0, 0], [pt, pb], [pl, pr], [0, 0]] if any(a["pads"]) else "VALID"
    y = tf.nn.conv2d(xs[0], xs[1], (1, *a["strides"], 1), padding)
    if a["group"] > 1:
        # Grappler's remapper fuses Conv2D + BiasAdd (+ Relu), but on some CPUs its fused kernel refuses grouped
        # convolutions ("Fused conv implementation does not support grouped convolutions"): the same values
        # from ops it does not match
        y = y + xs[2] if len(xs) > 2 else y
        return [tf.maximum(y, tf.zeros((), y.dtype)) if a["activation"] == "relu" else y]
    if len(xs) > 2:
        y = tf.nn.bias_add(y, xs[2])  # Conv2D + BiasAdd (+ Relu) is what Grappler's remapper fuses
    return [tf.nn.relu(y) if a["activation"] == "relu" else y]


# ---------------------------------------------------------------------------------------------------- Enlarge
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
    return [F_().pad(w, (dw, dw, dh, dh))]


def _export_enlarge(e, n) -> None:
    w = e.graph.types[n.inputs[0]].shape
    kh, kw = n.attrs["kernel"]
    dh, dw = (kh - w[2]) // 2, (kw - w[3]) // 2
    e.node("Pad", [n.inputs[0], e.const(f"{n.name}_pads", [0, 0, dh, dw, 0, 0, dh, dw])], n.outputs, n.name,
           mode="constant")


def _enlarge_tf(tf, xs, a, c):
    kh, kw = a["kernel"]
    _, _, h, w = c.in_shapes[0]
    dh, dw = (kh - h) // 2, (kw - w) // 2
    return [tf.pad(xs[0], [[0, 0], [0, 0], [dh, dh], [dw, dw]])]


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
    y = F_().max_pool2d(x, a["kernel"], a["strides"], padding, 1, bool(a["ceil_mode"]))
    return [_crop_to_onnx(y, xs[0].shape, a)]


def _avgpool(xs, a):
    """Sum over the window divided by the number of counted elements (ONNX semantics for every padding mode)."""
    torch, F = torch_(), F_()
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


def _pool_flops(ins, outs, a):
    return outs[0].numel * a["kernel"][0] * a["kernel"][1]


def _import_pool(n: OnnxNode):
    a, x = n.attrs, n.x
    if x is None or len(x) != 4 or n.n_outputs > 1 or any(d != 1 for d in a.get("dilations", (1, 1))):
        raise Unsupported
    if n.op_type == "MaxPool" and a.get("storage_order", 0):
        raise Unsupported
    kernel = tuple(int(k) for k in a["kernel_shape"])
    strides = tuple(int(s) for s in a.get("strides", (1, 1)))
    attrs = {"kernel": kernel, "strides": strides, "pads": n.pads2d(kernel, strides),
             "ceil_mode": int(a.get("ceil_mode", 0))}
    if n.op_type == "AveragePool":
        attrs["count_include_pad"] = int(a.get("count_include_pad", 0))
    return n.op_type, n.inputs, attrs


def _export_pool(e, n) -> None:
    a = n.attrs
    extra = {"count_include_pad": a["count_include_pad"]} if n.op == "AveragePool" else {}
    e.node(n.op, n.inputs, n.outputs, n.name, kernel_shape=list(a["kernel"]), strides=list(a["strides"]),
           pads=list(a["pads"]), ceil_mode=a["ceil_mode"], **extra)


def _pool_pads(a, in_shape, out_shape) -> list[list[int]]:
    """NHWC paddings for a VALID pool: the ONNX pads plus, in ceil mode, the bottom/right rows and columns the last
    window reaches past them (a negative value means rows to crop, never needed by well-formed attributes)."""
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = a["kernel"], a["strides"], a["pads"]
    h, w, oh, ow = in_shape[2], in_shape[3], out_shape[2], out_shape[3]
    extra_h = (oh - 1) * sh + kh - (h + pt + pb)
    extra_w = (ow - 1) * sw + kw - (w + pl + pr)
    return [[0, 0], [pt, pb + extra_h], [pl, pr + extra_w], [0, 0]]


def _maxpool_tf(tf, xs, a, c):
    pads = _pool_pads(a, c.in_shapes[0], c.out_shapes[0])
    x = tf_pad_or_crop(tf, xs[0], pads, float("-inf"))
    return [tf.nn.max_pool2d(x, a["kernel"], a["strides"], "VALID")]


def _avgpool_tf(tf, xs, a, c):
    """ONNX semantics: window sum / number of counted elements (input elements, plus the ONNX pads when
    count_include_pad; never the extra ceil-mode rows). The divisor is a constant computed here in numpy."""
    pads = _pool_pads(a, c.in_shapes[0], c.out_shapes[0])
    x = tf_pad_or_crop(tf, xs[0], pads, 0.0)
    y = tf.nn.avg_pool2d(x, a["kernel"], a["strides"], "VALID")  # divides every window by kh * kw
    # The counted region is a rectangle, so the count per window is (counted rows) * (counted columns).
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = a["kernel"], a["strides"], a["pads"]
    _, _, h, w = c.in_shapes[0]
    _, _, oh, ow = c.out_shapes[0]
    include = bool(a["count_include_pad"])
    rows = _counted(h, pt, pb, pads[1][1] - pb, include)
    cols = _counted(w, pl, pr, pads[2][1] - pr, include)
    count = np.outer([rows[i * sh:i * sh + kh].sum() for i in range(oh)],
                     [cols[j * sw:j * sw + kw].sum() for j in range(ow)])
    if np.all(count == kh * kw):
        return [y]
    return [y * tf.constant((kh * kw / count)[None, :, :, None], dtype=y.dtype)]


def _counted(size: int, before: int, after: int, extra: int, include_pads: bool) -> np.ndarray:
    """1-D mask over one padded spatial axis: 1 where an element is counted by AveragePool."""
    mask = np.zeros(before + size + after + max(0, extra))
    mask[before:before + size] = 1.0
    if include_pads:
        mask[:before + size + after] = 1.0
    return mask


# ------------------------------------------------------------------------------------------------- GlobalAveragePool
def _gap_infer(ins, a):
    x = ins[0].shape
    if len(x) < 3:
        raise ShapeError(f"GlobalAveragePool needs rank >= 3, got {x}")
    return [TensorType(x[:2] + (1,) * (len(x) - 2), ins[0].dtype)]


def _import_gap(n: OnnxNode):
    if n.x is None or len(n.x) < 3:
        raise Unsupported
    return import_plain(n)


def _gap_tf(tf, xs, a, c):
    axes = (1, 2) if c.nhwc else tuple(range(2, len(c.in_shapes[0])))
    return [tf.reduce_mean(xs[0], axis=axes, keepdims=True)]


# ---------------------------------------------------------------------------------------------------- JAX
def _conv_jax(J, xs, a, c):
    pt, pl, pb, pr = a["pads"]
    y = J.lax.conv_general_dilated(xs[0], xs[1], tuple(a["strides"]), [(pt, pb), (pl, pr)],
                                   dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=a["group"])
    if len(xs) > 2:
        y = y + xs[2].reshape(1, -1, 1, 1)
    return [J.nn.relu(y) if a["activation"] == "relu" else y]


def _enlarge_jax(J, xs, a, c):
    w = xs[0]
    kh, kw = a["kernel"]
    dh, dw = (kh - w.shape[2]) // 2, (kw - w.shape[3]) // 2
    return [J.jnp.pad(w, ((0, 0), (0, 0), (dh, dh), (dw, dw)))]


def _pool_window(J, x, a, c, init, op, pad_value, explicit_value=None):
    """reduce_window over H, W with the ONNX pads (``explicit_value`` fills them, default ``pad_value``) and, in
    ceil mode, the extra bottom/right rows the last window reaches (filled with ``pad_value``)."""
    pads = _pool_pads(a, c.in_shapes[0], c.out_shapes[0])
    if explicit_value is not None and explicit_value != pad_value:
        pt, pl, pb, pr = a["pads"]
        x = J.lax.pad(x, J.jnp.asarray(explicit_value, x.dtype), [(0, 0, 0), (0, 0, 0), (pt, pb, 0), (pl, pr, 0)])
        pads = [[0, 0], [0, pads[1][1] - pb], [0, pads[2][1] - pr], [0, 0]]
    (kh, kw), (sh, sw) = a["kernel"], a["strides"]
    # a numpy init value stays concrete under tracing, so JAX sees a max/sum window (differentiable: jax.grad of
    # a pooling model works) instead of a generic reduction
    return J.lax.reduce_window(x, np.asarray(init, x.dtype), op, (1, 1, kh, kw), (1, 1, sh, sw),
                               [(0, 0), (0, 0), tuple(pads[1]), tuple(pads[2])])


def _maxpool_jax(J, xs, a, c):
    return [_pool_window(J, xs[0], a, c, -J.jnp.inf, J.lax.max, -J.jnp.inf)]


def _avgpool_jax(J, xs, a, c):
    x = xs[0]
    total = _pool_window(J, x, a, c, 0.0, J.lax.add, 0.0)
    ones = J.jnp.ones((1, 1) + tuple(x.shape[2:]), x.dtype)
    count = _pool_window(J, ones, a, c, 0.0, J.lax.add, 0.0, 1.0 if a["count_include_pad"] else 0.0)
    return [total / count]


DEFS = [
    OpDef(name="Conv", attrs=("strides", "pads", "group", "activation"), infer=_conv_infer, compute=_conv,
          flops=_conv_flops, from_onnx=_import_conv, to_onnx=_export_conv, tf=_conv_tf, tf_layout="nhwc",
          tf_forms=("nhwc", "hwio", "ir"), input_ranks=ranks(4, 4, 1),
          jax=_conv_jax),
    # TASO's helper: zero-pad a conv kernel to a larger (odd) size, centred, so it can be merged with a wider conv.
    OpDef(name="Enlarge", attrs=("kernel",), infer=_enlarge_infer, compute=_enlarge, onnx_type="Pad", from_onnx=None,
          to_onnx=_export_enlarge, tf=_enlarge_tf, input_ranks=ranks(4), jax=_enlarge_jax),
    OpDef(name="MaxPool", attrs=("kernel", "strides", "pads", "ceil_mode"), infer=_pool_infer, compute=_maxpool,
          flops=_pool_flops, from_onnx=_import_pool, to_onnx=_export_pool, tf=_maxpool_tf, tf_layout="nhwc",
          input_ranks=ranks(4), jax=_maxpool_jax),
    OpDef(name="AveragePool", attrs=("kernel", "strides", "pads", "ceil_mode", "count_include_pad"),
          infer=_pool_infer, compute=_avgpool, flops=_pool_flops, from_onnx=_import_pool, to_onnx=_export_pool,
          tf=_avgpool_tf, tf_layout="nhwc", input_ranks=ranks(4), jax=_avgpool_jax),
    OpDef(name="GlobalAveragePool", attrs=(), infer=_gap_infer,
          compute=lambda xs, a: [xs[0].mean(dim=tuple(range(2, xs[0].dim())), keepdim=True)],
          flops=lambda ins, outs, a: ins[0].numel, from_onnx=_import_gap, to_onnx=export_plain, tf=_gap_tf,
          tf_layout="any", input_ranks=ranks(4),
          jax=lambda J, xs, a, c: [J.jnp.mean(xs[0], axis=(2, 3), keepdims=True)]),
]
