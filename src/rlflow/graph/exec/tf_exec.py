"""TensorFlow backends ``tf`` and ``tf-xla``: the IR lowered op by op into ONE ``tf.function``.

The function has an input signature built from the graph's input types and is traced once, at construction. Grappler
runs as TF's default; ``xla=True`` compiles the function with ``jit_compile=True``.

Weights. A constant of at least :data:`CAPTURE_MIN_ELEMENTS` elements (a weight) is made once, eagerly, and captured
by the function, as a Keras model's variables are: it reaches the graph as an input, not as a ``Const`` node, so
Grappler does not copy and scan hundreds of MB of weights on the first call (paper-size BERT: 0.4 s first call
instead of 12-16 s, single runs; steady-state latency not compared under the protocol). Layout conversions of
weights (conv OIHW -> HWIO, broadcast operands to NHWC) are done in numpy before capture. Smaller constants
(shapes, scalars, axes) are embedded as ``Const`` nodes, so Grappler and XLA still see and fold them.

Each op's lowering is its OpDef's ``tf`` facet (:mod:`rlflow.graph.ops`); this module holds the machinery.

Layout. The IR is NCHW, but TF's CPU convolution and pooling kernels only take NHWC. Every rank-4 value therefore
carries a layout: ``ir`` (the IR's NCHW order) or ``nhwc``. Ops with ``tf_layout="nhwc"`` (Conv, MaxPool,
AveragePool) read and write NHWC; layout-agnostic ops (``tf_layout="any"``: element-wise ops, BatchNormalization,
GlobalAveragePool, Concat, Split, Pad) run in NHWC when one of their rank-4 inputs already is NHWC (their axes and
pads are remapped), so a chain conv -> bn -> relu -> pool -> conv has no transposes in between. Any other op reads
its inputs in IR layout; a value is transposed at most once per layout (the converted tensor is cached) and graph
outputs are returned in IR layout. Constants are converted in numpy at trace time (conv weights OIHW -> HWIO too).

Opaque nodes (ops outside the registry) run through onnxruntime in a ``tf.numpy_function`` in ``tf`` mode; XLA cannot
compile them, so ``tf-xla`` refuses such graphs with a one-line error.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from contextlib import contextmanager
from typing import Any

import numpy as np

from rlflow.errors import RLFlowError
from rlflow.graph.ir import Graph, Node
from rlflow.graph.ops import OPS

_TO_NHWC, _TO_NCHW = (0, 2, 3, 1), (0, 3, 1, 2)
#: constants with at least this many elements are captured by the function instead of embedded (module doc)
CAPTURE_MIN_ELEMENTS = 1024
_NHWC_AXIS = (0, 3, 1, 2)  # _NHWC_AXIS[nchw_axis] = the same axis's position in NHWC order


#: lines TF writes to stderr at import that TF_CPP_MIN_LOG_LEVEL cannot silence (absl logs before it is initialised)
_IMPORT_NOISE = re.compile(rb"^(I\d{4} |WARNING: All log messages before absl::InitializeLog\(\) is called)")


def _tf():
    """Import TensorFlow quietly: TF_CPP_MIN_LOG_LEVEL=2 (unless set) hides its C++ info and warning logs; the
    info lines it writes while loading are dropped too. Everything else it writes (errors) still reaches stderr."""
    if "tensorflow" in sys.modules:
        return _grow_memory(sys.modules["tensorflow"])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if os.environ["TF_CPP_MIN_LOG_LEVEL"] in ("", "0"):
        import tensorflow as tf

        return _grow_memory(tf)
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
    return _grow_memory(tf)


_GROWING = False


def _grow_memory(tf):
    """Memory growth on each GPU TensorFlow sees (once): TF then takes GPU memory as it needs it, not all of it
    at its first run, so the torch and onnxruntime runs of the same process still find memory there. It can only
    be set before TF has used a GPU; after that TF keeps what it has (and says so in a RuntimeError, ignored)."""
    global _GROWING
    if not _GROWING:
        _GROWING = True
        for gpu in tf.config.list_physical_devices("GPU"):
            try:
                tf.config.experimental.set_memory_growth(gpu, True)
            except RuntimeError:
                pass
    return tf


@contextmanager
def exact_float32():
    """Inside this block TensorFlow's float32 matmuls and convolutions on a GPU are exact float32, not TF32 (its
    default on Ampere and later GPUs): what the output checks compare. Timings keep TF's default."""
    tf = _tf()
    if not tf.config.list_physical_devices("GPU"):
        yield
        return
    before = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    try:
        yield
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(before)


# ====================================================================================== the lowering context
# Each lowering (an OpDef's ``tf``) is ``fn(tf, xs, a, ctx) -> list of tensors``: ``xs`` are the node's inputs (in
# NHWC when ``ctx.nhwc``, see the module docstring), ``a`` the node's attributes. ``ctx`` also gives the output
# shapes (``ctx.out_shapes``, IR order) and the input shapes (``ctx.in_shapes``, IR order).

class _Ctx:
    __slots__ = ("nhwc", "in_shapes", "out_shapes")

    def __init__(self, nhwc: bool, in_shapes: list[tuple[int, ...]], out_shapes: list[tuple[int, ...]]):
        self.nhwc, self.in_shapes, self.out_shapes = nhwc, in_shapes, out_shapes

    def axis(self, ax: int) -> int:
        """An IR axis of a rank-4 value as the axis of the tensor actually held."""
        return _NHWC_AXIS[ax] if self.nhwc else ax


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
    and the derived ``nhwc_bcast``/``hwio``. A conversion is made once and cached; a constant is made on first use
    (embedded, or captured when large: see the module doc), converted in numpy."""

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
                if arr.size >= CAPTURE_MIN_ELEMENTS:  # a weight: made eagerly, captured (see the module doc)
                    with self.tf.init_scope():
                        held[form] = self.tf.constant(arr)
                else:
                    held[form] = self.tf.constant(arr)
            else:
                if "ir" not in held:
                    held["ir"] = self.tf.transpose(held["nhwc"], _TO_NCHW)
                if form != "ir":
                    held[form] = _convert(self.tf, held["ir"], form)
        return held[form]


# ====================================================================================== the runner
def unsupported_reason(graph: Graph, xla: bool = False) -> str | None:
    """Why the tf (``xla``: tf-xla) backend cannot run ``graph``, decided from the graph alone, before anything
    runs: an op without a TF lowering, or (tf-xla) an opaque node, which XLA cannot compile. None if it can."""
    missing = sorted({n.op for n in graph.nodes if n.op != "Opaque" and OPS[n.op].tf is None})
    if missing:
        return f"the tf backend has no lowering for op(s) {', '.join(missing)}"
    opaque = graph.opaque_nodes()
    if xla and opaque:
        n = opaque[0]
        return (f"tf-xla cannot compile node '{n.name}' (opaque op {n.op_type_name()}, outside the op registry); "
                "use the 'tf' backend")
    return None


class TFRunner:
    """``feeds -> outputs`` through one ``tf.function`` (``xla``: compiled with ``jit_compile=True``)."""

    def __init__(self, graph: Graph, device: str = "cpu", xla: bool = False):
        reason = unsupported_reason(graph, xla)
        if reason:
            raise RLFlowError(reason)
        tf = self.tf = _tf()
        opaque = graph.opaque_nodes()
        self.graph, self.xla = graph, xla
        sees_gpu = bool(tf.config.list_physical_devices("GPU"))
        gpu = str(device).startswith("cuda") and sees_gpu
        self.device = "/GPU:0" if gpu else "/CPU:0"
        self.ran_on = "cuda" if gpu else "cpu"
        """Where the function runs: ``cuda`` | ``cpu``."""
        self.device_note = (f"TensorFlow {tf.__version__} sees no GPU (a CPU build, or no CUDA libraries)"
                            if str(device).startswith("cuda") and not gpu else "")
        """Why the function runs elsewhere than ``device`` asked; empty when it runs there."""
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
        op = OPS[n.op]
        nhwc = op.tf_layout == "nhwc" or (
            op.tf_layout == "any" and all(len(s) == 4 for s in out_shapes)
            and any(len(s) == 4 and vals.has_nhwc(v) for v, s in zip(ins, in_shapes)))
        if not nhwc:
            forms = ["ir"] * len(ins)
        elif op.tf_forms:
            forms = list(op.tf_forms[:len(ins)])
        else:
            forms = ["nhwc" if len(s) == 4 else "nhwc_bcast" if op.elementwise and len(s) > 0 else "ir"
                     for s in in_shapes]
        xs = [vals.get(v, f) for v, f in zip(ins, forms)]
        outs = op.tf(self.tf, xs, n.attrs, _Ctx(nhwc, in_shapes, out_shapes))
        return outs, "nhwc" if nhwc else "ir"

    def _opaque_op(self, n: Node, xs):
        tf, op = self.tf, self._opaque[n.name]
        out_types = [self.graph.types[v] for v in n.outputs]

        def run(*arrays):
            res = op.session.run(op.outputs, dict(zip(op.inputs, map(np.asarray, arrays))))  # (0-D: a numpy scalar)
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
