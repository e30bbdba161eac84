"""The tf and tf-xla backends against the torch reference: every op in the registry, on a few small graphs."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("tensorflow") is None:  # imported quietly by the backend itself, not here
    pytest.skip("tensorflow is not installed", allow_module_level=True)

from rlflow.errors import RLFlowError  # noqa: E402
from rlflow.graph.builder import GraphBuilder  # noqa: E402
from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff  # noqa: E402
from rlflow.graph.ir import Graph, Node, TensorType  # noqa: E402
from rlflow.graph.ops import OPS  # noqa: E402

TOL = 1e-4


def _weights(seed: int):
    rng = np.random.default_rng(seed)
    return lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32)


def conv_graph() -> Graph:
    """Convolutions and pools (asymmetric pads, groups, depthwise, ceil mode, count_include_pad) and the
    layout-agnostic ops that run in NHWC between them, ending in IR-layout ops."""
    b, _w = GraphBuilder("convs"), _weights(0)
    x = b.input("x", (2, 4, 11, 10))
    k = b.input("k", ())  # a 0-D scalar (a 0-D constant would become 1-D: Constant uses np.ascontiguousarray)
    c1 = b.op("Conv", [x, b.const("w1", _w(8, 2, 3, 3)), b.const("b1", _w(8))], strides=(2, 2),
              pads=(0, 1, 1, 0), group=2, activation="relu")                                    # 8 x 6 x 5
    c2 = b.op("Conv", [c1, b.const("w2", _w(16, 1, 3, 3))], strides=(1, 1), pads=(1, 1, 1, 1), group=8,
              activation="none")                                                                # depthwise, x2
    bn = b.op("BatchNormalization", [c2, b.const("s", _w(16) + 1), b.const("bb", _w(16)), b.const("m", _w(16)),
                                     b.const("v", np.abs(_w(16)) + 0.5)], epsilon=1e-5)
    big = b.op("Enlarge", [b.const("w3", _w(16, 16, 3, 3))], kernel=(5, 5))
    c3 = b.op("Conv", [b.op("Relu", [bn]), big], strides=(1, 1), pads=(2, 2, 2, 2), group=1, activation="none")
    y = b.op("Add", [c3, bn])                                                   # both NHWC
    y = b.op("Mul", [y, b.const("chan", _w(16, 1, 1) + 1)])                     # rank-3 broadcast operand
    y = b.op("ScalarMul", [b.op("Tanh", [y]), k])
    y = b.op("Sub", [y, b.op("Sigmoid", [c2])])
    mp = b.op("MaxPool", [y], kernel=(3, 3), strides=(2, 2), pads=(1, 0, 0, 1), ceil_mode=1)
    ap0 = b.op("AveragePool", [y], kernel=(3, 3), strides=(2, 2), pads=(1, 0, 0, 1), ceil_mode=1,
               count_include_pad=0)
    ap1 = b.op("AveragePool", [y], kernel=(3, 3), strides=(2, 2), pads=(1, 0, 0, 1), ceil_mode=1,
               count_include_pad=1)
    ap2 = b.op("AveragePool", [y], kernel=(2, 2), strides=(2, 2), pads=(0, 0, 0, 0), ceil_mode=0,
               count_include_pad=0)
    mp2 = b.op("MaxPool", [y], kernel=(2, 2), strides=(1, 1), pads=(0, 0, 0, 0), ceil_mode=0)
    cat = b.op("Concat", [mp, ap0, ap1], axis=1)                                 # 48 channels
    s1, s2, s3 = b.op("Split", [cat], n_outputs=3, axis=1, split=(10, 30, 8))
    p = b.op("Pad", [s2], pads=(0, 0, 1, 0, 0, 2, 0, 1), value=0.5)
    gap = b.op("GlobalAveragePool", [p])
    fc = b.op("Gemm", [b.op("Flatten", [gap], axis=1), b.const("fw", _w(32, 32)), b.const("fb", _w(32))],
              alpha=1.0, beta=1.0, transA=0, transB=1)
    # from IR layout back into convolutions
    r = b.op("Reshape", [fc], shape=(2, 2, 4, 4))
    c4 = b.op("Conv", [r, b.const("w4", _w(3, 2, 2, 2))], strides=(1, 1), pads=(0, 1, 0, 0), group=1,
              activation="relu")
    return b.build([c4, s1, s3, mp, ap0, ap1, ap2, mp2, b.op("Identity", [y])])


def dense_graph() -> Graph:
    """MatMul/Gemm variants, normalisations, reductions and data movement on rank 1..4 values."""
    b, _w = GraphBuilder("dense"), _weights(1)
    x = b.input("x", (2, 5, 8))
    ids = b.input("ids", (3, 2), dtype="int64")
    h = b.op("MatMul", [x, b.const("wq", _w(8, 6))])                                        # (2, 5, 6)
    a4 = b.op("Reshape", [x], shape=(2, 1, 5, 8))
    bm = b.op("MatMul", [a4, b.const("wb", _w(3, 8, 4))])                                   # (2, 3, 5, 4)
    v1 = b.op("MatMul", [b.const("v", _w(8)), b.const("m83", _w(8, 3))])                    # (3,)
    v2 = b.op("MatMul", [b.op("Slice", [x], axes=(0, 1), starts=(1, 0), ends=(2, 1), steps=(1, 1)),
                         b.const("v8", _w(8))])                                              # (1, 1)
    dot = b.op("MatMul", [b.const("u8", _w(8)), b.const("w8", _w(8))])                     # ()
    g1 = b.op("Gemm", [b.const("ga", _w(4, 3)), b.const("gb", _w(5, 4)), b.const("gc", _w(5))],
              alpha=0.5, beta=2.0, transA=1, transB=1)                                      # (3, 5)
    g2 = b.op("Gemm", [b.op("Flatten", [h], axis=2), b.const("gw", _w(6, 7)), b.const("gcb", _w(1, 7))],
              alpha=1.0, beta=1.0, transA=0, transB=0)                                      # (10, 7)
    ln = b.op("LayerNormalization", [x, b.const("lns", _w(8) + 1), b.const("lnb", _w(8))], axis=2, epsilon=1e-5)
    ln2 = b.op("LayerNormalization", [x, b.const("lns2", _w(5, 8) + 1)], axis=1, epsilon=1e-3)
    sm = b.op("Softmax", [b.op("Gelu", [ln], approximate="none")], axis=2)
    ge = b.op("Gelu", [ln2], approximate="tanh")
    pos = b.op("Sigmoid", [x])
    e = b.op("Pow", [pos, b.const("ex", np.array([1.7], np.float32))])
    e = b.op("Div", [b.op("Sqrt", [e]), b.op("Add", [pos, b.const("half", np.array(0.5, np.float32))])])
    e = b.op("Erf", [b.op("Sub", [e, sm])])
    rm = b.op("ReduceMean", [e], axes=(1,), keepdims=0)
    rm_all = b.op("ReduceMean", [ge], axes=(), keepdims=1)
    t = b.op("Transpose", [bm], perm=(3, 1, 0, 2))
    sl = b.op("Slice", [t], axes=(0, 3), starts=(1, 0), ends=(4, 5), steps=(2, 2))
    pd = b.op("Pad", [h], pads=(0, 1, 0, 0, 0, 2), value=-1.0)
    ga = b.op("Gather", [x, ids], axis=2)                                                   # (2, 5, 3, 2)
    gc = b.op("Gather", [b.const("emb", _w(10, 4)), b.const("neg", np.array([[-1, 3], [0, -10]], np.int64))],
              axis=0)
    cat = b.op("Concat", [b.op("Relu", [h]), b.op("Tanh", [h])], axis=0)
    parts = b.op("Split", [cat], n_outputs=2, axis=2, split=(2, 4))
    # fused attention: 4-D with grouped KV heads, a mask and the causal mask; 3-D with a V head size of its own
    att4 = b.op("Attention", [b.op("Reshape", [x], shape=(2, 2, 5, 4)), b.const("ak", _w(2, 1, 7, 4)),
                              b.const("av", _w(2, 1, 7, 4)), b.const("am", _w(1, 1, 5, 7))],
                scale=0.5, is_causal=1, q_num_heads=0, kv_num_heads=0)                          # (2, 2, 5, 4)
    att3 = b.op("Attention", [x, x, h], scale=0.3, is_causal=0, q_num_heads=2, kv_num_heads=2)   # (2, 5, 6)
    sq = b.op("Sqrt", [x])  # NaN where x < 0, and Hugging Face's guard against it (Where broadcasts the 0-D zero)
    guarded = b.op("Where", [b.op("IsNaN", [sq]), b.const("zero", np.array(0.0, np.float32)), sq])
    return b.build([h, v1, v2, dot, g1, g2, rm, rm_all, sl, pd, ga, gc, *parts, b.op("Identity", [t]), att4, att3,
                    guarded])


def _dense_feeds(g: Graph) -> dict:
    feeds = make_inputs(g, seed=1)
    feeds["ids"] = np.array([[0, -1], [7, -8], [3, 5]], np.int64)  # negative indices count from the end
    return feeds


GRAPHS = {"convs": (conv_graph, lambda g: make_inputs(g, seed=1)), "dense": (dense_graph, _dense_feeds)}


@pytest.fixture(scope="module", params=sorted(GRAPHS))
def case(request):
    build, feeds = GRAPHS[request.param]
    g = build()
    f = feeds(g)
    return g, f, get_runner(g, "torch")(f)


@pytest.mark.parametrize("backend", ["tf", "tf-xla", "jax"])
def test_matches_torch(case, backend):
    g, feeds, want = case
    run = get_runner(g, backend)
    got = run(feeds)
    assert [o.shape for o in got] == [g.types[v].shape for v in g.outputs]
    assert max_rel_diff(want, got) < TOL
    assert max_rel_diff(want, run(feeds)) < TOL  # a second call reuses the traced function
    assert run.peak_memory_bytes() is None  # CPU


def test_every_op_is_lowered_and_tested():
    assert all(d.tf for d in OPS.values()), f"no TF lowering for {sorted(k for k, d in OPS.items() if not d.tf)}"
    assert all(d.jax for d in OPS.values()), f"no JAX lowering for {sorted(k for k, d in OPS.items() if not d.jax)}"
    used = {n.op for g in (conv_graph(), dense_graph()) for n in g.nodes}
    assert set(OPS) <= used, f"not covered by the tests: {sorted(set(OPS) - used)}"


def test_conv_chain_keeps_nhwc():
    """conv -> bn -> relu -> pool -> conv has no transposes between the ops (weights are transposed in numpy)."""
    b, _w = GraphBuilder("chain"), _weights(2)
    x = b.input("x", (1, 3, 8, 8))
    y = b.op("Conv", [x, b.const("w", _w(4, 3, 3, 3))], strides=(1, 1), pads=(1, 1, 1, 1), group=1,
             activation="none")
    y = b.op("BatchNormalization", [y] + [b.const(k, np.abs(_w(4)) + 0.5) for k in "sbmv"], epsilon=1e-5)
    y = b.op("MaxPool", [b.op("Relu", [y])], kernel=(2, 2), strides=(2, 2), pads=(0, 0, 0, 0), ceil_mode=0)
    y = b.op("Conv", [y, b.const("w2", _w(2, 4, 1, 1))], strides=(1, 1), pads=(0, 0, 0, 0), group=1,
             activation="relu")
    g = b.build([y])
    run = get_runner(g, "tf")
    ops = [op.type for op in run._fn.graph.get_operations()]
    assert ops.count("Transpose") == 2, ops  # the input to NHWC and the output back
    feeds = make_inputs(g)
    assert max_rel_diff(get_runner(g, "torch")(feeds), run(feeds)) < TOL



@pytest.mark.parametrize("backend", ["tf", "tf-xla"])
def test_large_weights_are_captured_small_constants_embedded(backend):
    """A weight (>= CAPTURE_MIN_ELEMENTS elements) reaches the function as a captured input, never a Const node
    (Grappler would copy and scan it on the first call); a small constant stays a Const that TF can fold."""
    from rlflow.graph.exec.tf_exec import CAPTURE_MIN_ELEMENTS

    b, _w = GraphBuilder("capture"), _weights(3)
    n = CAPTURE_MIN_ELEMENTS // 16
    x = b.input("x", (2, 16))
    y = b.op("MatMul", [x, b.const("big", _w(16, n))])  # 16 * n = CAPTURE_MIN_ELEMENTS elements: captured
    y = b.op("Add", [y, b.const("small", _w(n))])        # n elements: embedded
    g = b.build([y])
    run = get_runner(g, backend)
    consts = [op for op in run._fn.graph.get_operations() if op.type == "Const"]
    sizes = [int(np.prod(op.get_attr("value").tensor_shape.dim and
                         [d.size for d in op.get_attr("value").tensor_shape.dim] or [1])) for op in consts]
    assert max(sizes) < CAPTURE_MIN_ELEMENTS and n in sizes, sizes
    assert len(run._fn.captured_inputs) == 1 and tuple(run._fn.captured_inputs[0].shape) == (16, n)
    feeds = make_inputs(g)
    assert max_rel_diff(get_runner(g, "torch")(feeds), run(feeds)) < TOL


def _opaque_graph() -> Graph:
    types = {"x": TensorType((2, 3)), "e": TensorType((2, 3)), "y": TensorType((2, 3))}
    nodes = [Node("elu", "Opaque", ("x",), ("e",), {"op_type": "Elu", "domain": "", "attributes": ()}),
             Node("relu", "Relu", ("e",), ("y",), {})]
    return Graph(inputs=["x"], outputs=["y"], nodes=nodes, types=types)


def test_opaque_node_runs_in_tf_mode():
    g = _opaque_graph()
    x = np.array([[-2.0, -0.5, 0.0], [0.5, 1.0, 3.0]], np.float32)
    (got,) = get_runner(g, "tf")({"x": x})
    np.testing.assert_allclose(got, np.maximum(np.where(x > 0, x, np.expm1(x)), 0.0), rtol=1e-6)
    (got,) = get_runner(g, "tf")({"x": -x})
    np.testing.assert_allclose(got, np.maximum(np.where(-x > 0, -x, np.expm1(-x)), 0.0), rtol=1e-6)


def test_an_opaque_node_reading_a_0d_tensor_runs_in_tf_mode():
    """tf.numpy_function hands a 0-D tensor over as a numpy scalar, which onnxruntime's session refuses."""
    from rlflow.graph.ir import Constant

    types = {"x": TensorType((2, 3)), "c": TensorType(()), "y": TensorType((2, 3))}
    nodes = [Node("max", "Opaque", ("x", "c"), ("y",), {"op_type": "Max", "domain": "", "attributes": ()})]
    g = Graph(inputs=["x"], outputs=["y"], nodes=nodes, types=types,
              constants={"c": Constant(np.array(0.25, np.float32))})
    x = np.array([[-2.0, -0.5, 0.0], [0.5, 1.0, 3.0]], np.float32)
    (got,) = get_runner(g, "tf")({"x": x})
    np.testing.assert_allclose(got, np.maximum(x, 0.25))


def test_opaque_node_refused_by_xla():
    with pytest.raises(RLFlowError) as err:
        get_runner(_opaque_graph(), "tf-xla")
    msg = str(err.value)
    assert "\n" not in msg and "'elu'" in msg and "Elu" in msg


def test_missing_feed_is_one_line_error():
    with pytest.raises(RLFlowError, match="no value fed for input"):
        get_runner(_opaque_graph(), "tf")({})
