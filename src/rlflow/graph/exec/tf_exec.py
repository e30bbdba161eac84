"""TensorFlow backends ``tf`` and ``tf-xla``: the IR lowered op by op into ONE ``tf.function``.

The function has an input signature built from the graph's input types and is traced once, at construction. Grappler
runs as TF's default; ``xla=True`` compiles the function with ``jit_compile=True``. Weights are embedded as graph
constants when the function is traced (once, never per call), so Grappler and XLA fold anything computed from them
alone (weight transposes, Enlarge, BatchNormalization's scale and shift).

Layout. The IR is NCHW, but TF's CPU convolution and pooling kernels only take NHWC. Every rank-4 value therefore
carries a layout: ``ir`` (the IR's NCHW order) or ``nhwc``. Conv, MaxPool and AveragePool read and write NHWC;
layout-agnostic ops (element-wise ops, BatchNormalization, GlobalAveragePool, Concat, Split, Pad) run in NHWC when
one of their rank-4 inputs already is NHWC (their axes and pads are remapped), so a chain conv -> bn -> relu ->
pool -> conv has no transposes in between. Any other op reads its inputs in IR layout; a value is transposed at most
once per layout (the converted tensor is cached) and graph outputs are returned in IR layout. Constants are converted
in numpy at trace time (conv weights OIHW -> HWIO too).

Opaque nodes (ops outside the registry) run through onnxruntime in a ``tf.numpy_function`` in ``tf`` mode; XLA cannot
compile them, so ``tf-xla`` refuses such graphs with a one-line error.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from typing import Any, Callable

import numpy as np

from rlflow.errors import RLFlowError
from rlflow.graph.ir import Graph, Node
from rlflow.graph.ops import ELEMENTWISE, OPS

_TO_NHWC, _TO_NCHW = (0, 2, 3, 1), (0, 3, 1, 2)
_NHWC_AXIS = (0, 3, 1, 2)  # _NHWC_AXIS[nchw_axis] = the same axis's position in NHWC order

#: ops that always run in NHWC (TF's CPU kernels for them accept nothing else)
NHWC_ONLY = frozenset({"Conv", "MaxPool", "AveragePool"})
#: ops that run in NHWC when a rank-4 input already is NHWC (and every output has rank 4)
NHWC_OK = ELEMENTWISE | {"BatchNormalization", "GlobalAveragePool", "Concat", "Split", "Pad"}


#: lines TF writes to stderr at import that TF_CPP_MIN_LOG_LEVEL cannot silence (absl logs before it is initialised)
_IMPORT_NOISE = re.compile(rb"^(I\d{4} |WARNING: All log messages before absl::InitializeLog\(\) is called)")


def _tf():
    """Import TensorFlow quietly: TF_CPP_MIN_LOG_LEVEL=2 (unless set) hides its C++ info and warning logs; the
    info lines it writes while loading are dropped too. Everything else it writes (errors) still reaches stderr."""
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if os.environ["TF_CPP_MIN_LOG_LEVEL"] in ("", "0"):
        import tensorflow as tf

        return tf
    with tempfile.TemporaryFile() as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            import tensorflow as tf
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            kept = b"".join(line for line in log if not _IMPORT_NOISE.match(line))
            if kept:
                sys.stderr.write(kept.decode(errors="replace"))
                sys.stderr.flush()
    return tf


# ====================================================================================== the per-op lowerings
# Each lowering is ``fn(tf, xs, a, ctx) -> list of tensors``: ``xs`` are the node's inputs (in NHWC when
# ``ctx.nhwc``, see the module docstring), ``a`` the node's attributes. ``ctx`` also gives the output shapes
# (``ctx.out_shapes``, IR order) and the input shapes (``ctx.in_shapes``, IR order).

class _Ctx:
    __slots__ = ("nhwc", "in_shapes", "out_shapes")

    def __init__(self, nhwc: bool, in_shapes: list[tuple[int, ...]], out_shapes: list[tuple[int, ...]]):
        self.nhwc, self.in_shapes, self.out_shapes = nhwc, in_shapes, out_shapes

    def axis(self, ax: int) -> int:
        """An IR axis of a rank-4 value as the axis of the tensor actually held."""
        return _NHWC_AXIS[ax] if self.nhwc else ax


def _binary(f):
    return lambda tf, xs, a, c: [f(tf, xs[0], xs[1])]


def _unary(f):
    return lambda tf, xs, a, c: [f(tf, xs[0])]


def _matmul(tf, xs, a, c):
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


def _gemm(tf, xs, a, c):
    y = tf.linalg.matmul(xs[0], xs[1], transpose_a=bool(a["transA"]), transpose_b=bool(a["transB"]))
    if a["alpha"] != 1.0:
        y = a["alpha"] * y
    if len(xs) > 2:
        y = y + (a["beta"] * xs[2] if a["beta"] != 1.0 else xs[2])
    return [y]


def _conv(tf, xs, a, c):
    """xs: NHWC input, HWIO weight (in-channels per group), optional bias. The ONNX pads, asymmetric or not, are
    Conv2D's explicit padding (one op; XLA ran faster with it than with tf.pad + VALID). Groups (depthwise
    included) are TF's grouped Conv2D: in-channels = groups * the weight's in-channels."""
    pt, pl, pb, pr = a["pads"]
    padding = [[0, 0], [pt, pb], [pl, pr], [0, 0]] if any(a["pads"]) else "VALID"
    y = tf.nn.conv2d(xs[0], xs[1], (1, *a["strides"], 1), padding)
    if len(xs) > 2:
        y = tf.nn.bias_add(y, xs[2])  # Conv2D + BiasAdd (+ Relu) is what Grappler's remapper fuses
    return [tf.nn.relu(y) if a["activation"] == "relu" else y]


def _enlarge(tf, xs, a, c):
    kh, kw = a["kernel"]
    _, _, h, w = c.in_shapes[0]
    dh, dw = (kh - h) // 2, (kw - w) // 2
    return [tf.pad(xs[0], [[0, 0], [0, 0], [dh, dh], [dw, dw]])]


def _pool_pads(a, in_shape, out_shape) -> list[list[int]]:
    """NHWC paddings for a VALID pool: the ONNX pads plus, in ceil mode, the bottom/right rows and columns the last
    window reaches past them (a negative value means rows to crop, never needed by well-formed attributes)."""
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = a["kernel"], a["strides"], a["pads"]
    h, w, oh, ow = in_shape[2], in_shape[3], out_shape[2], out_shape[3]
    extra_h = (oh - 1) * sh + kh - (h + pt + pb)
    extra_w = (ow - 1) * sw + kw - (w + pl + pr)
    return [[0, 0], [pt, pb + extra_h], [pl, pr + extra_w], [0, 0]]


def _pad_or_crop(tf, x, pads, value):
    """tf.pad with ``pads`` (per axis [before, after]); negative amounts crop instead."""
    if any(p < 0 for pair in pads for p in pair):
        x = x[tuple(slice(max(0, -b), e if e < 0 else None) for b, e in pads)]
        pads = [[max(0, b), max(0, e)] for b, e in pads]
    if any(p for pair in pads for p in pair):
        x = tf.pad(x, pads, constant_values=value)
    return x


def _maxpool(tf, xs, a, c):
    pads = _pool_pads(a, c.in_shapes[0], c.out_shapes[0])
    x = _pad_or_crop(tf, xs[0], pads, float("-inf"))
    return [tf.nn.max_pool2d(x, a["kernel"], a["strides"], "VALID")]


def _avgpool(tf, xs, a, c):
    """ONNX semantics: window sum / number of counted elements (input elements, plus the ONNX pads when
    count_include_pad; never the extra ceil-mode rows). The divisor is a constant computed here in numpy."""
    pads = _pool_pads(a, c.in_shapes[0], c.out_shapes[0])
    x = _pad_or_crop(tf, xs[0], pads, 0.0)
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


def _gap(tf, xs, a, c):
    axes = (1, 2) if c.nhwc else tuple(range(2, len(c.in_shapes[0])))
    return [tf.reduce_mean(xs[0], axis=axes, keepdims=True)]


def _bn(tf, xs, a, c):
    x, scale, bias, mean, var = xs
    inv = scale / tf.sqrt(var + a["epsilon"])
    shift = bias - mean * inv
    if not c.nhwc:  # channels on axis 1: (C,) -> (C, 1, ..., 1); in NHWC they are last and broadcast as they are
        shape = (-1,) + (1,) * (len(c.in_shapes[0]) - 2)
        inv, shift = tf.reshape(inv, shape), tf.reshape(shift, shape)
    return [x * inv + shift]


def _ln(tf, xs, a, c):
    x = xs[0]
    axes = tuple(range(a["axis"], len(c.in_shapes[0])))
    mean = tf.reduce_mean(x, axis=axes, keepdims=True)
    var = tf.reduce_mean(tf.square(x - mean), axis=axes, keepdims=True)
    y = (x - mean) / tf.sqrt(var + a["epsilon"]) * xs[1]
    return [y + xs[2] if len(xs) > 2 else y]


def _reduce_mean(tf, xs, a, c):
    axes = a["axes"] or tuple(range(len(c.in_shapes[0])))
    return [tf.reduce_mean(xs[0], axis=list(axes), keepdims=bool(a["keepdims"]))]


def _split(tf, xs, a, c):
    return tf.split(xs[0], list(a["split"]), axis=c.axis(a["axis"]))


def _pad(tf, xs, a, c):
    pads, r = a["pads"], len(c.in_shapes[0])
    pairs = [[pads[i], pads[i + r]] for i in range(r)]
    if c.nhwc:
        pairs = [pairs[i] for i in _TO_NHWC]
    return [_pad_or_crop(tf, xs[0], pairs, a["value"])]


def _slice(tf, xs, a, c):
    idx = [slice(None)] * len(c.in_shapes[0])
    for ax, st, en, sp in zip(a["axes"], a["starts"], a["ends"], a["steps"]):
        idx[ax] = slice(st, en, sp)
    return [xs[0][tuple(idx)]]


def _gather(tf, xs, a, c):
    data, idx, ax = xs[0], xs[1], a["axis"]
    idx = tf.where(idx < 0, idx + tf.cast(c.in_shapes[0][ax], idx.dtype), idx)
    return [tf.gather(data, idx, axis=ax)]


LOWERINGS: dict[str, Callable[..., list[Any]]] = {
    "Add": _binary(lambda tf, x, y: x + y),
    "Sub": _binary(lambda tf, x, y: x - y),
    "Mul": _binary(lambda tf, x, y: x * y),
    "Div": _binary(lambda tf, x, y: x / y),
    "Pow": _binary(lambda tf, x, y: tf.pow(x, y)),
    "Relu": _unary(lambda tf, x: tf.nn.relu(x)),
    "Sigmoid": _unary(lambda tf, x: tf.sigmoid(x)),
    "Tanh": _unary(lambda tf, x: tf.tanh(x)),
    "Erf": _unary(lambda tf, x: tf.math.erf(x)),
    "Sqrt": _unary(lambda tf, x: tf.sqrt(x)),
    "Identity": _unary(lambda tf, x: tf.identity(x)),
    "Gelu": lambda tf, xs, a, c: [tf.nn.gelu(xs[0], approximate=a.get("approximate", "none") == "tanh")],
    "ScalarMul": _binary(lambda tf, x, s: x * s),
    "MatMul": _matmul,
    "Gemm": _gemm,
    "Conv": _conv,
    "Enlarge": _enlarge,
    "MaxPool": _maxpool,
    "AveragePool": _avgpool,
    "GlobalAveragePool": _gap,
    "BatchNormalization": _bn,
    "LayerNormalization": _ln,
    "Softmax": lambda tf, xs, a, c: [tf.nn.softmax(xs[0], axis=a["axis"])],
    "ReduceMean": _reduce_mean,
    "Concat": lambda tf, xs, a, c: [tf.concat(list(xs), axis=c.axis(a["axis"]))],
    "Split": _split,
    "Transpose": lambda tf, xs, a, c: [tf.transpose(xs[0], list(a["perm"]))],
    "Reshape": lambda tf, xs, a, c: [tf.reshape(xs[0], list(a["shape"]))],
    "Flatten": lambda tf, xs, a, c: [tf.reshape(xs[0], list(c.out_shapes[0]))],
    "Pad": _pad,
    "Slice": _slice,
    "Gather": _gather,
}


# ====================================================================================== values and their layouts
def _convert(lib, x, form: str):
    """``x`` (IR layout; numpy or TF, ``lib`` is the matching module) in another form."""
    if form == "nhwc":  # a rank-4 activation
        return lib.transpose(x, _TO_NHWC)
    if form == "nhwc_bcast":  # a rank-1..3 operand of an element-wise op whose rank-4 operand is NHWC
        rank = len(x.shape)
        return lib.transpose(lib.reshape(x, (1,) * (4 - rank) + tuple(x.shape)), _TO_NHWC)
    if form == "hwio":  # a conv weight: OIHW -> HWIO (TF's filter layout; I is the in-channels per group)
        return lib.transpose(x, (2, 3, 1, 0))
    raise AssertionError(form)


class _Values:
    """The tensors computed so far, each held in one or more forms: ``ir`` (IR layout), ``nhwc`` (rank-4 values),
    and the derived ``nhwc_bcast``/``hwio``. A conversion is made once and cached; a constant is embedded on first
    use, converted in numpy."""

    def __init__(self, tf, graph: Graph, feeds: dict[str, Any]):
        self.tf, self.graph = tf, graph
        self.held: dict[str, dict[str, Any]] = {v: {"ir": t} for v, t in feeds.items()}

    def has_nhwc(self, v: str) -> bool:
        return "nhwc" in self.held.get(v, ())

    def put(self, v: str, t, form: str) -> None:
        self.held[v] = {form: t}

    def get(self, v: str, form: str = "ir"):
        held = self.held.setdefault(v, {})
        if form not in held:
            const = self.graph.constants.get(v)
            if const is not None:
                arr = const.array if form == "ir" else _convert(np, const.array, form)
                held[form] = self.tf.constant(arr)
            else:
                if "ir" not in held:
                    held["ir"] = self.tf.transpose(held["nhwc"], _TO_NCHW)
                if form != "ir":
                    held[form] = _convert(self.tf, held["ir"], form)
        return held[form]


# ====================================================================================== the runner
class TFRunner:
    """``feeds -> outputs`` through one ``tf.function`` (``xla``: compiled with ``jit_compile=True``)."""

    def __init__(self, graph: Graph, device: str = "cpu", xla: bool = False):
        tf = self.tf = _tf()
        missing = sorted({n.op for n in graph.nodes if n.op != "Opaque" and n.op not in LOWERINGS})
        if missing:
            raise RLFlowError(f"the tf backend has no lowering for op(s) {', '.join(missing)}")
        opaque = graph.opaque_nodes()
        if xla and opaque:
            n = opaque[0]
            raise RLFlowError(f"tf-xla cannot compile node '{n.name}' (opaque op {n.op_type_name()}, outside the op "
                              "registry); use the 'tf' backend")
        self.graph, self.xla = graph, xla
        gpu = str(device).startswith("cuda") and bool(tf.config.list_physical_devices("GPU"))
        self.device = "/GPU:0" if gpu else "/CPU:0"
        self._opaque = {}
        if opaque:
            from rlflow.graph.exec.torch_exec import _OpaqueNode

            self._opaque = {n.name: _OpaqueNode(graph, n) for n in opaque}
        self._dtypes = [graph.types[v].dtype for v in graph.inputs]
        signature = [tf.TensorSpec(graph.types[v].shape, graph.types[v].dtype) for v in graph.inputs]
        fn = tf.function(self._body, input_signature=signature, jit_compile=xla)
        self._fn = fn.get_concrete_function()  # traced here, once; XLA compiles on the first call

    # ---------------------------------------------------------------------------------------------- tracing
    def _body(self, *args):
        tf, g = self.tf, self.graph
        vals = _Values(tf, g, dict(zip(g.inputs, args)))
        with tf.device(self.device):
            for n in g.nodes:
                if n.op == "Opaque":
                    outs, form = self._opaque_op(n, [vals.get(v) for v in n.inputs if v]), "ir"
                else:
                    outs, form = self._lower(n, vals)
                for v, t in zip(n.outputs, outs):
                    vals.put(v, t, form)
            return [vals.get(v) for v in g.outputs]

    def _lower(self, n: Node, vals: _Values):
        g = self.graph
        ins = [v for v in n.inputs if v]
        in_shapes = [g.types[v].shape for v in ins]
        out_shapes = [g.types[v].shape for v in n.outputs]
        nhwc = n.op in NHWC_ONLY or (
            n.op in NHWC_OK and all(len(s) == 4 for s in out_shapes)
            and any(len(s) == 4 and vals.has_nhwc(v) for v, s in zip(ins, in_shapes)))
        if not nhwc:
            forms = ["ir"] * len(ins)
        elif n.op == "Conv":
            forms = ["nhwc", "hwio", "ir"][:len(ins)]
        else:
            forms = ["nhwc" if len(s) == 4 else "nhwc_bcast" if n.op in ELEMENTWISE and len(s) > 0 else "ir"
                     for s in in_shapes]
        xs = [vals.get(v, f) for v, f in zip(ins, forms)]
        outs = LOWERINGS[n.op](self.tf, xs, n.attrs, _Ctx(nhwc, in_shapes, out_shapes))
        return outs, "nhwc" if nhwc else "ir"

    def _opaque_op(self, n: Node, xs):
        tf, op = self.tf, self._opaque[n.name]
        out_types = [self.graph.types[v] for v in n.outputs]

        def run(*arrays):
            res = op.session.run(op.outputs, dict(zip(op.inputs, arrays)))
            return [np.asarray(r, dtype=t.dtype) for r, t in zip(res, out_types)]

        ys = tf.numpy_function(run, xs, [tf.as_dtype(t.dtype) for t in out_types], stateful=False,
                               name=f"opaque_{n.op_type_name()}")
        for y, t in zip(ys, out_types):
            y.set_shape(t.shape)
        return ys

    # ---------------------------------------------------------------------------------------------- running
    def __call__(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        missing = [v for v in self.graph.inputs if v not in feeds]
        if missing:
            raise RLFlowError(f"graph '{self.graph.name}': no value fed for input(s) {', '.join(missing)}")
        args = [self.tf.convert_to_tensor(np.asarray(feeds[v], dtype=dt))
                for v, dt in zip(self.graph.inputs, self._dtypes)]
        return [o.numpy() for o in self._fn(*args)]

    def peak_memory_bytes(self) -> int | None:
        if self.device == "/GPU:0":
            return int(self.tf.config.experimental.get_memory_info("GPU:0")["peak"])
        return None
