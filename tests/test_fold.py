"""Constant folding (rlflow.graph.fold): the numpy fast path computes exactly what the ops' torch compute does,
folding a search's usual leftovers (merged, transposed and scaled weights) does not import torch, and every
other static op still folds through torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.graph.builder import GraphBuilder
from rlflow.graph.fold import NUMPY_FOLD, _fold_node, fold_constants
from rlflow.graph.ops import OPS

DTYPES = ("float32", "float16", "float64")


def torch_compute(op: str, attrs: dict, ins: list[np.ndarray]) -> list[np.ndarray]:
    with torch.inference_mode():
        return [t.contiguous().numpy() for t in OPS[op].compute([torch.from_numpy(np.array(x)) for x in ins], attrs)]


@st.composite
def folding_cases(draw):
    """(op, attrs, inputs) for an op of NUMPY_FOLD, over random shapes, dtypes and values."""
    op = draw(st.sampled_from(sorted(NUMPY_FOLD)))
    rank = draw(st.integers(1 if op in ("Concat", "Split", "Transpose") else 0, 4))
    shape = draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank))
    movement = op in ("Concat", "Split", "Transpose", "Reshape", "Identity")
    dtype = draw(st.sampled_from(DTYPES + (("int64",) if movement else ())))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31)))

    def tensor(s):
        if dtype == "int64":
            return np.asarray(rng.integers(-100, 100, size=s), dtype=dtype)
        return np.asarray(rng.standard_normal(s) * 3, dtype=dtype)

    x = tensor(shape)
    if op == "Concat":
        axis = draw(st.integers(0, rank - 1))
        parts = []
        for _ in range(draw(st.integers(1, 3))):
            s = list(shape)
            s[axis] = draw(st.integers(1, 4))
            parts.append(tensor(s))
        return op, {"axis": axis}, parts
    if op == "Split":
        axis = draw(st.integers(0, rank - 1))
        cuts = sorted(draw(st.lists(st.integers(1, shape[axis]), max_size=2, unique=True)))
        edges = [0, *[c for c in cuts if c < shape[axis]], shape[axis]]
        return op, {"axis": axis, "split": [b - a for a, b in zip(edges, edges[1:])]}, [x]
    if op == "Transpose":
        return op, {"perm": tuple(draw(st.permutations(range(rank))))}, [x]
    if op == "Reshape":
        target = list(reversed(shape)) or [1]
        if target and draw(st.booleans()):
            target[draw(st.integers(0, len(target) - 1))] = -1
        return op, {"shape": tuple(target)}, [x]
    if op == "Identity":
        return op, {}, [x]
    if op == "ScalarMul":
        return op, {}, [x, tensor(())]
    other = [d if draw(st.booleans()) else 1 for d in shape][draw(st.integers(0, rank)):]  # broadcastable
    y = tensor(other)
    if op == "Div":
        y = np.where(np.abs(y) < 0.1, 1, y).astype(dtype)
    return (op, {}, [x, y]) if draw(st.booleans()) else (op, {}, [y, x])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(folding_cases())
def test_numpy_folding_is_the_torch_compute_bit_for_bit(case):
    op, attrs, ins = case
    for x in ins:
        x.flags.writeable = False  # as constants are
    got, want = _fold_node(op, attrs, ins), torch_compute(op, attrs, ins)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g = np.asarray(g)
        assert g.dtype == w.dtype and g.shape == w.shape, (op, g.dtype, w.dtype, g.shape, w.shape)
        assert np.array_equal(g, w), op


def test_integer_arithmetic_folds_through_torch():
    """The numpy path takes arithmetic on floats only (numpy's integer division is not torch's)."""
    a, b = np.array([7, -7], dtype=np.int64), np.array([2, 2], dtype=np.int64)
    got = _fold_node("Div", {}, [a, b])
    assert np.array_equal(np.asarray(got[0]), torch_compute("Div", {}, [a, b])[0])


def test_a_static_op_outside_the_fast_path_still_folds():
    b = GraphBuilder("g")
    x = b.input("x", (2, 3))
    w = b.op("Sqrt", [b.const("v", np.array([[1.0, 4.0, 9.0]], dtype=np.float32))])
    g = fold_constants(b.build([b.op("Mul", [x, w])]))
    assert g.op_counts() == {"Mul": 1}
    (name,) = g.constants
    assert np.array_equal(g.constants[name].array, np.array([[1.0, 2.0, 3.0]], dtype=np.float32))


def test_folding_merged_transposed_and_scaled_weights_does_not_import_torch():
    """A search stage folds these after every search; importing torch for them cost seconds per job."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from rlflow.graph.builder import GraphBuilder
        from rlflow.graph.fold import fold_constants
        b = GraphBuilder("g")
        x = b.input("x", (4, 8))
        w1 = b.const("w1", np.ones((8, 3), dtype=np.float32))
        w2 = b.const("w2", np.full((3, 8), 2, dtype=np.float32))
        s = b.const("s", np.array(0.5, dtype=np.float32))
        w = b.op("Concat", [w1, b.op("Transpose", [w2], perm=(1, 0))], axis=1)
        w = b.op("ScalarMul", [w, s])
        g = fold_constants(b.build([b.op("MatMul", [x, w])]))
        assert g.op_counts() == {"MatMul": 1}, g.op_counts()
        (c,) = g.constants.values()
        assert c.array.shape == (8, 6) and c.array[0, 0] == 0.5 and c.array[0, 5] == 1.0
        print("torch" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
