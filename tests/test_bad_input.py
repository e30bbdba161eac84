"""Hostile input to the commands that run a model (optimize, run, convert, cost): files the importer accepts but
that cannot be run, or not on this machine. Each is one line on stderr naming the cause (file, node, input),
exit code 2, no traceback and no output file. The cases come from mutating small models, as a user would."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_models
from rlflow.cli import main
from rlflow.errors import RLFlowError
from rlflow.graph import exec as graph_exec
from rlflow.graph import load_onnx
from rlflow.graph.exec import check_memory, make_inputs, memory_needed

GiB = 1 << 30


@pytest.fixture
def rules(tmp_path):
    """An empty rule set: the search has nothing to apply, so optimize goes straight to the output check."""
    from rlflow.rewrite.rule import FORMAT

    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"format": FORMAT, "rules": []}))
    return path


def _save(tmp_path, name: str, model: onnx.ModelProto):
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return path


def _gather_out_of_range():
    """Gather 'gath' with constant indices [0, 100] into an input of 10 rows: imports, fails when run."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [10, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    idx = numpy_helper.from_array(np.array([0, 100], np.int64), "idx")
    return onnx_models._model([helper.make_node("Gather", ["x", "idx"], ["g"], name="gath", axis=0),
                               helper.make_node("Relu", ["g"], ["y"], name="relu")], [x], [y], [idx])


def _erf_float64():
    """Erf on float64 'erf64': valid ONNX, but onnxruntime has no such kernel (fails creating the session)."""
    x = helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 4])
    return onnx_models._model([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                               helper.make_node("Erf", ["r"], ["y"], name="erf64")], [x], [y])


def _with_input_dim(value: int):
    """with_opaque_op with input x (and output y) of height ``value``: 1x3x{value}x8."""
    m = onnx_models.with_opaque_op()
    for vi in (m.graph.input[0], m.graph.output[0]):
        vi.type.tensor_type.shape.dim[2].dim_value = value
        vi.type.tensor_type.shape.dim[3].dim_value = 8
    return m


def _one_line_error(code: int, err: str, *wanted: str) -> None:
    assert code == 2, err
    assert err.startswith("rlflow: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for w in wanted:
        assert w in err, err


def _optimize(path, tmp_path, rules, *extra):
    out = tmp_path / "out.onnx"
    code = main(["optimize", str(path), "--out", str(out), "--rules", str(rules), "--method", "greedy",
                 "--no-progress", *(extra or ("--cost-model", "analytic"))])
    return code, out


# ------------------------------------------------------------------------------------------------ no outputs
def test_no_graph_outputs_is_rejected_at_import(tmp_path, rules, capfd):
    m = onnx_models.with_opaque_op()
    m.graph.ClearField("output")
    path = _save(tmp_path, "no_outputs", m)
    for argv in (["inspect", str(path)], ["run", str(path), "--repeats", "1", "--warmup", "0"]):
        _one_line_error(main(argv), capfd.readouterr().err, f"{path}: the graph has no outputs")
    code, out = _optimize(path, tmp_path, rules)
    _one_line_error(code, capfd.readouterr().err, f"{path}: the graph has no outputs")
    assert not out.exists()


# ------------------------------------------------------------------------------------------------ initializers
def _matmul_with_weight(n: int, raw: bool = True):
    """x [1, n] @ W [n, n]: W as raw bytes (a 192x192 weight is large enough to be read zero-copy) or, with
    raw=False, in the typed float_data field."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])
    data = np.ones((n, n), np.float32)
    w = numpy_helper.from_array(data, "W") if raw else helper.make_tensor("W", TensorProto.FLOAT, [n, n],
                                                                          data.reshape(-1).tolist())
    return onnx_models._model([helper.make_node("MatMul", ["x", "W"], ["y"])], [x], [y], [w])


@pytest.mark.parametrize("n, raw, dims, wanted", [
    (192, True, [-192, -192], "declares a negative dimension, shape [-192, -192]"),  # a Hugging Face ViT's weight
    (4, True, [-1, 4], "declares a negative dimension, shape [-1, 4]"),
    (4, False, [4, -4], "declares a negative dimension, shape [4, -4]"),
    (192, True, [0, 192], "holds 147456 bytes of data, but its shape [0, 192] needs 0"),
    (4, False, [4, 0], "holds 16 values of data, but its shape [4, 0] needs 0"),
    (192, True, [2**32, 2**32], "18446744073709551616 elements, more than any tensor can hold"),
    (4, True, [2**62, 4], "18446744073709551616 elements, more than any tensor can hold"),  # int64 product wraps to 0
    (192, True, [100, 192], "holds 147456 bytes of data, but its shape [100, 192] needs 76800"),
    (4, True, [4, 8], "holds 64 bytes of data, but its shape [4, 8] needs 128"),
    (4, False, [2, 4], "holds 16 values of data, but its shape [2, 4] needs 8"),
])
def test_initializer_dims_and_data_are_checked_before_use(n, raw, dims, wanted, tmp_path, rules, capfd):
    m = _matmul_with_weight(n, raw)
    m.graph.initializer[0].dims[:] = dims
    path = _save(tmp_path, "bad_weight", m)
    _one_line_error(main(["inspect", str(path)]), capfd.readouterr().err, f"{path}: initializer 'W' {wanted}"[:60],
                    wanted)
    code, out = _optimize(path, tmp_path, rules)
    _one_line_error(code, capfd.readouterr().err, wanted)
    assert not out.exists()


def test_empty_initializer_is_still_accepted(tmp_path):
    """A zero-size weight with no data is valid ONNX (Resize's empty roi, say): only data that does not fit is
    refused."""
    m = _matmul_with_weight(4)
    m.graph.initializer.append(numpy_helper.from_array(np.zeros((0, 3), np.float32), "unused_empty"))
    load_onnx(_save(tmp_path, "empty_weight", m))


# ------------------------------------------------------------------------------------------------ memory
@pytest.mark.parametrize("dim", [2**31, 2**40])
def test_huge_input_is_refused_before_making_inputs(dim, tmp_path, rules, capfd, monkeypatch):
    monkeypatch.setattr(graph_exec, "available_memory", lambda: 16 * GiB)  # the same answer on any machine
    path = _save(tmp_path, f"h{dim}", _with_input_dim(dim))
    assert main(["inspect", str(path)]) == 0  # only reading it is fine
    assert f"float32[1x3x{dim}x8]" in capfd.readouterr().out
    code, out = _optimize(path, tmp_path, rules)
    input_gib = 3 * dim * 8 * 4 / GiB
    size = f"{input_gib:.1f} GiB" if input_gib < 1024 else f"{input_gib / 1024:.1f} TiB"
    _one_line_error(code, capfd.readouterr().err, f"{path}: running the model needs about",
                    "more than the 16.0 GiB available", f"input 'x' float32[1x3x{dim}x8] is {size}")
    assert not out.exists()
    for argv in (["run", str(path)], ["convert", str(path), "--out", str(out)],
                 ["optimize", str(path), "--out", str(out), "--rules", str(rules), "--cost-model", "measured"]):
        _one_line_error(main(argv), capfd.readouterr().err, "more than the 16.0 GiB available", "input 'x'")
        assert not out.exists()
    g = load_onnx(path)
    with pytest.raises(RLFlowError, match="more than the 16.0 GiB available"):
        make_inputs(g)  # every other caller (evaluate, the environment) is covered too


def test_memory_estimate_counts_live_tensors(tmp_path):
    """x (1x3x8x8) -> Conv -> c (1x4x8x8) -> Elu -> e -> Relu -> r -> HardSigmoid -> y, weights 4x3x3x3: at most
    x, two of the 1x4x8x8 tensors and the weights are alive at once."""
    g = load_onnx(_save(tmp_path, "m", onnx_models.with_opaque_op()))
    assert memory_needed(g) == (3 * 64 + 2 * 4 * 64) * 4 + 4 * 3 * 9 * 4


def test_large_input_that_fits_gets_a_one_line_note(tmp_path, capfd, monkeypatch):
    path = _save(tmp_path, "tall", _with_input_dim(4000))
    g = load_onnx(path)
    need = memory_needed(g)
    assert need == (3 + 4 + 4) * 4000 * 8 * 4 + 4 * 3 * 9 * 4
    monkeypatch.setattr(graph_exec, "NOTE_BYTES", need - 1)
    assert main(["run", str(path), "--repeats", "1", "--warmup", "0"]) == 0
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"rlflow: note: {path}: running the model needs about 1.3 MiB"), err
    assert "input 'x' float32[1x3x4000x8] is 375.0 KiB" in err
    monkeypatch.setattr(graph_exec, "NOTE_BYTES", need)
    assert check_memory(g, note=True) == need
    assert capfd.readouterr().err == ""  # at or under the threshold: no word


# ------------------------------------------------------------------------------------------------ run errors
def test_input_model_onnxruntime_cannot_run_names_the_node(tmp_path, rules, capfd):
    path = _save(tmp_path, "gather", _gather_out_of_range())
    assert main(["inspect", str(path)]) == 0  # the importer accepts it
    capfd.readouterr()
    code, out = _optimize(path, tmp_path, rules)
    _one_line_error(code, capfd.readouterr().err, f"{path}: onnxruntime failed on node 'gath' (Gather): indices "
                    "element out of data bounds, idx=100", f"{out} not written")
    assert not out.exists() and not list(tmp_path.glob(".out.onnx*"))
    # the measured cost model runs each op with torch first
    code, out = _optimize(path, tmp_path, rules, "--cost-model", "measured")
    _one_line_error(code, capfd.readouterr().err, f"{path}: torch failed on node 'gath' (Gather): index out of range")
    assert not out.exists()
    conv = tmp_path / "conv.onnx"
    _one_line_error(main(["convert", str(path), "--out", str(conv)]), capfd.readouterr().err,
                    f"{path}: onnxruntime failed on node 'gath' (Gather)")
    assert not conv.exists()


def test_session_that_cannot_be_created_names_the_node(tmp_path, rules, capfd):
    path = _save(tmp_path, "erf64", _erf_float64())
    code, out = _optimize(path, tmp_path, rules)
    _one_line_error(code, capfd.readouterr().err, f"{path}: onnxruntime failed on node 'erf64' (Erf): Could not find "
                    "an implementation for Erf")
    assert not out.exists()


@pytest.mark.parametrize("backend,message", [
    ("ort", "onnxruntime failed on node 'gath' (Gather): indices element out of data bounds"),
    ("torch", "torch failed on node 'gath' (Gather): index out of range"),
    ("tf", "TensorFlow failed on node 'gath' (Gather): indices[1] = 100 is not in [0, 10)"),
])
def test_run_on_each_backend_names_the_node(backend, message, tmp_path, capfd):
    path = _save(tmp_path, "gather", _gather_out_of_range())
    code = main(["run", str(path), "--backend", backend, "--repeats", "1", "--warmup", "0", "--device", "cpu"])
    _one_line_error(code, capfd.readouterr().err, f"{path}: {message}")


def test_real_process_prints_one_line_and_no_onnxruntime_log(tmp_path, rules, root):
    """onnxruntime's C++ logger writes to the process's stderr; only rlflow's line may appear there."""
    path = _save(tmp_path, "gather", _gather_out_of_range())
    out = tmp_path / "out.onnx"
    proc = subprocess.run([sys.executable, "-m", "rlflow.cli", "optimize", str(path), "--out", str(out), "--rules",
                           str(rules), "--cost-model", "analytic", "--no-progress"], capture_output=True, text=True,
                          cwd=root, env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"})
    _one_line_error(proc.returncode, proc.stderr, "onnxruntime failed on node 'gath' (Gather)")
    assert proc.stdout == "" and not out.exists()


# ------------------------------------------------------------------------------------------- fused attention
def _attention_model(q_shape, opset=23, mask=None, **attrs) -> onnx.ModelProto:
    shapes = [("q", q_shape), ("k", [1, 2, 5, 4]), ("v", [1, 2, 5, 4])] + ([("m", mask)] if mask else [])
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes]
    node = helper.make_node("Attention", [n for n, _ in shapes], ["y"], name="attn", **attrs)
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3, 4])
    m = helper.make_model(helper.make_graph([node], "g", ins, [out]), opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return m


@pytest.mark.parametrize("case, model, wanted", [
    ("rank", _attention_model([1, 2, 3]), "3D inputs expected to have q_num_heads"),
    ("heads", _attention_model([1, 3, 3, 4]), "shape inference failed"),
    ("mask", _attention_model([1, 2, 3, 4], mask=[7, 7]), "mask shape (7, 7) does not broadcast to (1, 2, 3, 5)"),
    ("causal", _attention_model([1, 2, 3, 4], is_causal=5), "is_causal must be 0 or 1, got 5"),
    ("opset", _attention_model([1, 2, 3, 4], opset=18), "No Op registered for Attention with domain_version of 18"),
])
def test_malformed_attention_is_one_line_and_writes_nothing(case, model, wanted, tmp_path, rules, capfd):
    """ONNX's fused Attention (opset 23) with a wrong rank, head counts that do not fit, a mask that does not
    broadcast, a bad attribute, or used below its opset: one line naming the cause, exit 2, no output file."""
    path = _save(tmp_path, case, model)
    code, out = _optimize(path, tmp_path, rules)
    _one_line_error(code, capfd.readouterr().err, f"{path}: ", wanted)
    assert not out.exists() and not list(tmp_path.glob(".out.onnx*"))


def test_a_well_formed_attention_model_optimises(tmp_path, rules, capfd):
    """The control for the malformed cases above: the same model, well formed, is written."""
    code, out = _optimize(_save(tmp_path, "ok", _attention_model([1, 2, 3, 4])), tmp_path, rules)
    assert code == 0, capfd.readouterr().err
    assert out.exists()
