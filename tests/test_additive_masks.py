"""The value-aware mask canonicalisation (:func:`rlflow.graph.fold.additive_masks`): GPT-2's multiplicative
causal mask ``s * B - 1e10 * (1 - B)`` becomes ``s + M`` with equal outputs on onnxruntime, the importer does it
from opset 23 (and only there), any variant whose values do not prove it (a B value other than 0 or 1, a small
C, a row left without a key, a D that is not 0 where B is 1, a reader other than Softmax) is left untouched, and
with the fused-kernel rules greedy search then fuses every GPT-2 attention block. Hugging Face's
``Where(IsNaN(p), 0, p)`` after the softmax (:func:`rlflow.graph.fold.drop_nan_guards`) is dropped where a
constant mask leaves every row a finite entry, and kept otherwise."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from rlflow.graph import Constant, GraphBuilder, load_onnx
from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff
from rlflow.graph.exec.check import check_equal
from rlflow.graph.fold import MASK_MIN, additive_masks, at_opset, drop_nan_guards
from rlflow.graph.ops.attention import ATTENTION_OPSET
from rlflow.graph.zoo import TINY_SIZES, export_model

LAYERS = TINY_SIZES["gpt2"]["layers"]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """Tiny gpt2 exported at opset 18 and imported as the file says (no canonicalisation below opset 23)."""
    path = tmp_path_factory.mktemp("gpt2") / "gpt2.onnx"
    export_model("gpt2", path, TINY_SIZES["gpt2"])
    return load_onnx(path)


def softmax_inputs(g):
    """The node producing each Softmax's input."""
    prod = g.producer()
    return [g.nodes[prod[n.inputs[0]]] for n in g.nodes if n.op == "Softmax"]


def test_gpt2_mask_made_additive_with_equal_outputs(gpt2):
    before = softmax_inputs(gpt2)
    assert [n.op for n in before] == ["Sub"] * LAYERS  # s * B - C * (1 - B), (1 - B) folded by the importer
    out = additive_masks(gpt2)
    after = softmax_inputs(out)
    assert [n.op for n in after] == ["Add"] * LAYERS
    assert gpt2.op_counts()["Mul"] - out.op_counts()["Mul"] == LAYERS
    seq = TINY_SIZES["gpt2"]["seq"]
    causal = np.tril(np.ones((seq, seq), bool))
    for n in after:  # M: 0 where the causal mask keeps a key, -1e10 (the original's masked value) elsewhere
        m = np.asarray(out.constants[n.inputs[1]].array).reshape(seq, seq)
        assert (m[causal] == 0).all() and (m[~causal] == np.float32(-1e10)).all()
    assert check_equal(gpt2, out, tol=1e-5) <= 1e-5
    assert additive_masks(out) is out  # nothing left to rewrite


def test_the_importer_canonicalises_from_opset_23_only(tmp_path, gpt2):
    path = tmp_path / "gpt2-23.onnx"
    export_model("gpt2", path, TINY_SIZES["gpt2"], opset=ATTENTION_OPSET)
    g23 = load_onnx(path)
    assert [n.op for n in softmax_inputs(g23)] == ["Add"] * LAYERS
    assert check_equal(gpt2, g23, tol=1e-5) <= 1e-5
    raised = at_opset(gpt2, ATTENTION_OPSET)
    assert raised.opset == ATTENTION_OPSET and gpt2.opset == 18
    assert [n.op for n in softmax_inputs(raised)] == ["Add"] * LAYERS
    assert at_opset(gpt2, 18).nodes == gpt2.nodes


def _masked(keep, drop, sub: bool = True, reader: str = "Softmax", order: str = "sB", shape=(1, 1, 4, 4)):
    """q k^T * keep - drop (or + drop with ``sub`` False) read by ``reader``; keep and drop are (4, 4), given the
    ``shape`` (a 2-D one broadcasts over the scores' batch and heads)."""
    g = GraphBuilder("masked")
    q, k = g.input("q", [1, 2, 4, 8]), g.input("k", [1, 2, 8, 4])
    s, b = g.op("MatMul", [q, k]), g.const("keep", np.asarray(keep, np.float32).reshape(shape))
    x = g.op("Mul", [s, b] if order == "sB" else [b, s])
    x = g.op("Sub" if sub else "Add", [x, g.const("drop", np.asarray(drop, np.float32).reshape(shape))])
    return g.build([g.op(reader, [x], axis=3) if reader == "Softmax" else g.op(reader, [x])])


TRIL = np.tril(np.ones((4, 4)))
BAD_KEEP = TRIL.copy()
BAD_KEEP[2, 1] = 0.5
NO_KEY = TRIL.copy()
NO_KEY[0, 0] = 0  # row 0 keeps no key: the original is uniform there, the additive form is not


@pytest.mark.parametrize("sub,order,shape", [(True, "sB", (1, 1, 4, 4)), (True, "Bs", (1, 1, 4, 4)),
                                             (False, "sB", (1, 1, 4, 4)), (True, "sB", (4, 4))])
def test_a_valid_mask_is_rewritten_with_equal_outputs(sub, order, shape):
    drop = 1e10 * (1 - TRIL) * (1 if sub else -1)
    g = _masked(TRIL, drop, sub=sub, order=order, shape=shape)
    out = additive_masks(g)
    assert [n.op for n in out.nodes] == ["MatMul", "Add", "Softmax"]
    feeds = make_inputs(g, 0)
    assert max_rel_diff(get_runner(g, "ort")(feeds), get_runner(out, "ort")(feeds)) <= 1e-6


@pytest.mark.parametrize("keep,drop,reader,sub", [
    (BAD_KEEP, 1e10 * (1 - TRIL), "Softmax", True),           # B not 0/1
    (TRIL, 1.0 * (1 - TRIL), "Softmax", True),                # C small: exp(-1) does not vanish
    (TRIL, 0.5 * MASK_MIN * (1 - TRIL), "Softmax", True),     # C below MASK_MIN
    (NO_KEY, 1e10 * (1 - NO_KEY), "Softmax", True),           # a row without a key
    (TRIL, 1e10 * (1 - TRIL) + TRIL, "Softmax", True),        # D not 0 where B is 1
    (TRIL, 1e10 * (1 - TRIL), "Softmax", False),              # Add of +C: not a mask
    (TRIL, 1e10 * (1 - TRIL), "Relu", True),                  # not read by a Softmax: -C and s - C differ
])
def test_a_mask_the_values_do_not_prove_is_untouched(keep, drop, reader, sub):
    g = _masked(keep, drop, sub=sub, reader=reader)
    assert additive_masks(g) is g


def test_the_guard_matters():
    """The rewrite the small-C guard refuses would change the outputs: the check above can fail."""
    drop = 1.0 * (1 - TRIL)
    g = _masked(TRIL, drop)
    s = GraphBuilder("forced")
    q, k = s.input("q", [1, 2, 4, 8]), s.input("k", [1, 2, 8, 4])
    x = s.op("Add", [s.op("MatMul", [q, k]), s.const("m", -drop.reshape(1, 1, 4, 4).astype(np.float32))])
    forced = s.build([s.op("Softmax", [x], axis=3)])
    feeds = make_inputs(g, 0)
    assert max_rel_diff(get_runner(g, "ort")(feeds), get_runner(forced, "ort")(feeds)) > 1e-2


def test_gpt2_attention_fuses_after_the_canonicalisation(gpt2):
    """At opset 23 greedy search with the fused-kernel rules fuses every block; the outputs match the
    original (opset 18, multiplicative mask) on onnxruntime."""
    from rlflow.cost.model import AnalyticCost
    from rlflow.rewrite.builtin import fused_kernel_rules
    from rlflow.search.common import finish
    from rlflow.search.greedy import greedy_search

    cost = AnalyticCost("cpu")
    out, _ = finish(greedy_search(at_opset(gpt2, ATTENTION_OPSET), [r for r, _ in fused_kernel_rules()],
                                  cost).graph, cost)
    ops = [n.op for n in out.nodes]
    assert ops.count("Attention") == LAYERS and "Softmax" not in ops
    assert check_equal(gpt2, out, tol=1e-5) <= 1e-5
    # and the broken variant (a B value of 0.5) keeps its Softmax: nothing fuses
    broken = gpt2.copy()
    b = next(v for n in gpt2.nodes if n.op == "Mul" for v in n.inputs
             if v in gpt2.constants and set(np.unique(gpt2.constants[v].array)) == {0, 1})
    arr = np.array(gpt2.constants[b].array)
    arr[..., -1, 0] = 0.5
    broken.constants = {**gpt2.constants, b: Constant(arr)}
    out, _ = finish(greedy_search(at_opset(broken, ATTENTION_OPSET), [r for r, _ in fused_kernel_rules()],
                                  cost).graph, cost)
    assert [n.op for n in out.nodes].count("Attention") < LAYERS


# ============================================================================================ Hugging Face's guard
def _guarded(mask, zero: float = 0.0, mask_input: bool = False):
    """ONNX bytes: Softmax(q k^T + mask) guarded by Where(IsNaN(p), zero, p), as Hugging Face's GPT-2 export
    writes it (IsNaN and Where are IR ops), then MatMul v; ``mask_input``: the mask a graph input."""
    from onnx import TensorProto, helper, numpy_helper

    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(n, f, s) for n, s in (("q", [1, 2, 4, 8]), ("k", [1, 2, 8, 4]),
                                                                     ("v", [1, 2, 4, 8]))]
    mask = np.asarray(mask, np.float32).reshape(1, 1, 4, 4)
    inits = [numpy_helper.from_array(np.float32(zero), "zero")]
    if mask_input:
        inputs.append(helper.make_tensor_value_info("mask", f, [1, 1, 4, 4]))
    else:
        inits.append(numpy_helper.from_array(mask, "mask"))
    nodes = [helper.make_node("MatMul", ["q", "k"], ["s"]), helper.make_node("Add", ["s", "mask"], ["x"]),
             helper.make_node("Softmax", ["x"], ["p"], axis=-1), helper.make_node("IsNaN", ["p"], ["nan"]),
             helper.make_node("Where", ["nan", "zero", "p"], ["g"]), helper.make_node("MatMul", ["g", "v"], ["y"])]
    graph = helper.make_graph(nodes, "guarded", inputs, [helper.make_tensor_value_info("y", f, [1, 2, 4, 8])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


CAUSAL = np.where(TRIL == 1, 0, np.finfo(np.float32).min)  # Hugging Face's GPT-2 causal mask


def test_an_idle_nan_guard_is_dropped_with_equal_outputs():
    g = load_onnx(_guarded(CAUSAL))
    assert [n.op_type_name() for n in g.nodes] == ["MatMul", "Add", "Softmax", "IsNaN", "Where", "MatMul"]
    out = drop_nan_guards(g)
    assert [n.op for n in out.nodes] == ["MatMul", "Add", "Softmax", "MatMul"]
    assert check_equal(g, out, tol=1e-6) <= 1e-6


def test_a_kept_guard_is_ir_ops_every_backend_runs():
    """The guard over a row masked throughout (so it is kept): IsNaN and Where import as IR ops, not opaque nodes,
    so the backends that refuse opaque nodes (tf-xla, jax) run it too, each giving onnxruntime's zeros there."""
    g = load_onnx(_guarded(np.where(NO_KEY == 1, 0, -np.inf)))
    assert not g.opaque_nodes() and [n.op for n in g.nodes][3:5] == ["IsNaN", "Where"]
    feeds = make_inputs(g, 0)
    (ref,) = get_runner(g, "ort")(feeds)
    assert np.isfinite(ref).all()
    backends = ["torch"] + [b for b, mod in (("tf", "tensorflow"), ("tf-xla", "tensorflow"), ("jax", "jax"))
                            if importlib.util.find_spec(mod)]
    for backend in backends:
        assert max_rel_diff([ref], get_runner(g, backend)(feeds)) <= 1e-6, backend


@pytest.mark.parametrize("mask,zero,mask_input", [
    (np.where(NO_KEY == 1, 0, -np.inf), 0.0, False),  # a row -inf throughout: the guard is not idle there
    (CAUSAL, 1.0, False),                              # Where(IsNaN(p), 1, p): not the guard
    (CAUSAL, 0.0, True),                               # the mask not a constant: nothing proves a finite entry
])
def test_a_guard_the_values_do_not_prove_idle_is_kept(mask, zero, mask_input):
    g = load_onnx(_guarded(mask, zero, mask_input))
    assert drop_nan_guards(g) is g
