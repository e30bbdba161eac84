"""Dynamic input dimensions through `rlflow optimize` (rlflow.graph.dynamic): a model exported with a dynamic
batch keeps it where the optimised graph is shape-generic (outputs equal to the original's at batch 1 and 4),
and where it is not, the written model is specialised to the given sizes and the command says so."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_models
import rlflow
from rlflow.cli import main
from rlflow.graph.dynamic import dynamic_axes
from rlflow.graph.exec import max_rel_diff


def _dims(vi) -> list:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


def _outputs(path, feeds) -> list:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.fixture(scope="module", params=[False, True], ids=["torchscript", "dynamo"])
def hf_dynamic(request, tmp_path_factory):
    """An HF-style transformer block exported by torch (both exporters) with a dynamic batch (input_ids
    [batch, 8])."""
    path = tmp_path_factory.mktemp("hf") / "block.onnx"
    onnx_models.export_hf_block(path, dynamo=request.param, dynamic_batch=True)
    assert dynamic_axes(onnx.load(path)) == {"input_ids": {0: "batch"}}
    return path


def test_dynamic_batch_is_kept_and_outputs_equal_at_batch_1_and_4(hf_dynamic, tmp_path, capsys):
    out = tmp_path / "fast.onnx"
    assert main(["optimize", str(hf_dynamic), "--out", str(out), "--input-shape", "input_ids=1x8", "--target",
                 "sim-h100", "--time-limit", "3", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "kept the dynamic dimensions (batch): the optimised model matches the original at batch=2 and at " \
           "batch=3 too" in text
    fast = onnx.load(out)
    assert _dims(fast.graph.input[0]) == ["batch", 8]
    assert len(fast.graph.node) < len(onnx.load(hf_dynamic).graph.node)  # it was rewritten, not copied
    rng = np.random.default_rng(1)
    for batch in (1, 4):
        feeds = {"input_ids": rng.integers(0, 50, (batch, 8)).astype(np.int64)}
        want, got = _outputs(hf_dynamic, feeds), _outputs(out, feeds)
        assert got[0].shape[0] == batch and max_rel_diff(want, got) < 1e-5


def _transposed_reshape(batch: str | int = "N"):
    """x [N, 4] -> Transpose -> [4, N] -> Reshape [2, 2, N] (a shape from Shape(x), folded on import) -> Relu:
    its Reshape's target cannot follow the batch by copying or inferring one dimension, so the optimised graph
    holds at the given batch only."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2, batch])
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
             helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Concat", ["two2", "n"], ["shape"], axis=0),
             helper.make_node("Reshape", ["t", "shape"], ["r"]),
             helper.make_node("Relu", ["r"], ["y"])]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([2, 2], np.int64), "two2")]
    return onnx_models._model(nodes, [x], [y], inits)


def test_a_graph_that_holds_at_the_given_size_only_is_specialised_and_says_so(tmp_path, capsys):
    src, out = tmp_path / "t.onnx", tmp_path / "t.fast.onnx"
    onnx.save(_transposed_reshape(), src)
    assert main(["optimize", str(src), "--out", str(out), "--input-shape", "x=3x4", "--target", "analytic",
                 "--no-speed-check", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert ("specialised to the given sizes (N=3): at N=6 its output 'y' has shape [4, 2, 3], the original's [2, 2, 6]; "
            "the written model has them fixed") in text
    assert _dims(onnx.load(out).graph.input[0]) == [3, 4]
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)}
    assert max_rel_diff(_outputs(src, feeds), _outputs(out, feeds)) == 0


def test_the_api_keeps_them_too_and_warns_when_it_cannot(tmp_path):
    dynamic = onnx_models.shared_input_mlp("N")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # kept: no warning
        fast = rlflow.optimize(dynamic, input_shapes={"x": (1, 64)}, target="sim-h100")
    assert _dims(fast.graph.input[0]) == ["N", 64] and _dims(fast.graph.output[0]) == ["N", 64]
    with pytest.warns(UserWarning, match=r"specialised to the given sizes \(N=3\)"):
        fast = rlflow.optimize(_transposed_reshape(), input_shapes={"x": (3, 4)}, target="analytic",
                               speed_check=False)
    assert _dims(fast.graph.input[0]) == [3, 4]


def test_a_static_model_gets_no_note(tmp_path, capsys):
    src = tmp_path / "static.onnx"
    onnx.save(onnx_models.shared_input_mlp(2), src)
    assert main(["optimize", str(src), "--out", str(tmp_path / "o.onnx"), "--target", "sim-h100",
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "dynamic" not in text and "specialised" not in text
