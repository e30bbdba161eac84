"""float16 (and bfloat16) models: import, optimise and verify with tolerances that follow each output's type
(rlflow.graph.exec.DTYPE_TOLERANCE): float16's rounding alone moves a rewritten graph's outputs by ~1e-3, well
past float32's 1e-4, while a wrong graph still fails."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import rlflow
from rlflow.errors import RLFlowError
from rlflow.graph import load_onnx as _load_path
from rlflow.graph.exec import DTYPE_TOLERANCE, output_tolerance
from rlflow.graph.exec.check import check_equal


def load_onnx(model):
    """A model (ModelProto) or file as the IR graph."""
    return _load_path(model.SerializeToString() if isinstance(model, onnx.ModelProto) else model)


def chain_model(dtype=np.float16, elem=TensorProto.FLOAT16, scale: float = 1.0) -> onnx.ModelProto:
    """y = (x @ w0) @ w1 with weights (w1 times ``scale``): the rules fold w0 @ w1 into one weight, which rounds
    differently."""
    rng = np.random.default_rng(0)

    def w(name):
        k = scale if name == "w1" else 1.0
        return numpy_helper.from_array((rng.standard_normal((64, 64)) * 0.3 * k).astype(dtype), name)

    nodes = [helper.make_node("MatMul", ["x", "w0"], ["a"]), helper.make_node("MatMul", ["a", "w1"], ["y"])]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", elem, [8, 64])],
                          [helper.make_tensor_value_info("y", elem, [8, 64])], [w("w0"), w("w1")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_output_tolerance_follows_the_dtype():
    assert output_tolerance("float32", 1e-4) == 1e-4 and output_tolerance("float64", 1e-4) == 1e-4
    assert output_tolerance("float16", 1e-4) == DTYPE_TOLERANCE["float16"] == 1e-2
    assert output_tolerance("bfloat16", 1e-4) == 5e-2
    assert output_tolerance("float16", 0.5) == 0.5  # a looser configured tolerance wins


@pytest.mark.parametrize("method", ["greedy", "taso"])
def test_float16_model_imports_optimises_and_verifies(method):
    model = chain_model()
    g = load_onnx(model)
    assert {g.types[v].dtype for v in (*g.inputs, *g.outputs)} == {"float16"}
    out = rlflow.optimize(model, method=method, target="analytic", speed_check=False)
    assert [n.op_type for n in out.graph.node] == ["MatMul"]  # w0 @ w1 folded into one weight
    assert out.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    diff = check_equal(g, load_onnx(out))
    assert 1e-4 < diff <= 1e-2  # past float32's tolerance (this failed before), within float16's


def test_float16_check_still_rejects_a_wrong_graph():
    g, wrong = load_onnx(chain_model()), load_onnx(chain_model(scale=1.05))
    with pytest.raises(RLFlowError, match=r"output 'y' differs .*tolerance 0\.01 for float16"):
        check_equal(g, wrong)


def test_float16_graphs_pass_evaluate_check():
    """evaluate's output check uses the same per-dtype tolerance (its rows keep the measured difference)."""
    from rlflow.evaluation import evaluate_graphs
    from rlflow.evaluation.protocol import Protocol

    model = chain_model()
    found = load_onnx(rlflow.optimize(model, method="greedy", target="analytic", speed_check=False))
    res = evaluate_graphs([("original", load_onnx(model)), ("greedy", found)], ["ort"], "cpu",
                          Protocol(sessions=2, warmup=1, budget_s=5.0, min_rounds=3, max_rounds=3), aa=False,
                          progress=False, log=lambda s: None)
    by = {r.method: r for r in res}
    assert by["greedy"].status == "ok" and 1e-4 < by["greedy"].max_rel_diff <= 1e-2


def test_bfloat16_model_is_refused_in_one_line(tmp_path):
    """onnxruntime's CPU build has no bfloat16 kernels for most ops (Relu, MatMul), so a bfloat16 model cannot
    be checked on the CPU: the importer refuses it naming the type."""
    import ml_dtypes

    path = tmp_path / "bf16.onnx"
    onnx.save(chain_model(ml_dtypes.bfloat16, TensorProto.BFLOAT16), path)
    with pytest.raises(RLFlowError, match=r"bf16\.onnx: input 'x' has unsupported element type BFLOAT16$"):
        load_onnx(path)
