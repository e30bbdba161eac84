"""ONNX import/export: round trips on real torch exports (both exporters), folding, opaque ops, bad input."""

from __future__ import annotations

import subprocess
import sys

import onnx
import onnxruntime as ort
import pytest

import onnx_models
from rlflow.cli import main
from rlflow.errors import RLFlowError
from rlflow.graph import load_onnx, save_onnx
from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff

SHAPE_OPS = {"Shape", "ConstantOfShape", "Expand", "Where", "Equal", "Unsqueeze", "Squeeze", "Cast", "Range"}


def ort_run(path_or_bytes, feeds):
    sess = ort.InferenceSession(path_or_bytes, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.fixture(scope="module", params=[("dynamo", 18), ("dynamo", 17), ("torchscript", 18), ("torchscript", 17)],
                ids=lambda p: f"{p[0]}-opset{p[1]}")
def hf_export(request, tmp_path_factory):
    exporter, opset = request.param
    path = tmp_path_factory.mktemp("hf") / f"block_{exporter}_{opset}.onnx"
    onnx_models.export_hf_block(path, dynamo=exporter == "dynamo", opset=opset)
    return path


def test_roundtrip_torch_exports(hf_export, tmp_path):
    original_ops = {n.op_type for n in onnx.load(str(hf_export)).graph.node}
    if "torchscript" in hf_export.name:  # the legacy exporter leaves the mask/shape computations to fold
        assert {"ConstantOfShape", "Where", "Equal", "Expand"} <= original_ops, original_ops
    g = load_onnx(hf_export)
    out = tmp_path / "out.onnx"
    save_onnx(g, out)
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)
    feeds = make_inputs(g, seed=1)
    ref, new = ort_run(str(hf_export), feeds), ort_run(str(out), feeds)
    assert max_rel_diff(ref, new) <= 1e-4
    # the attention mask and shape computations are folded: the IR is static, with no shape-computing ops left
    assert not SHAPE_OPS & set(g.op_counts()), g.op_counts()
    assert not g.opaque_nodes()
    counts = g.op_counts()
    assert counts["Gather"] == 1 and counts["LayerNormalization"] == 2 and counts["Softmax"] == 1
    assert counts["MatMul"] >= 6
    # the torch interpreter of the IR agrees with onnxruntime on the original file
    assert max_rel_diff(ref, get_runner(g, "torch")(feeds)) <= 1e-4


def test_reimport_is_structurally_identical(hf_export, tmp_path):
    g = load_onnx(hf_export)
    save_onnx(g, tmp_path / "a.onnx")
    g2 = load_onnx(tmp_path / "a.onnx")
    assert g2.structural_hash() == g.structural_hash()
    assert g2.op_counts() == g.op_counts()


def test_dynamic_dimension_needs_input_shape(tmp_path):
    path = tmp_path / "dyn.onnx"
    onnx_models.export_hf_block(path, dynamo=False, dynamic_batch=True)
    with pytest.raises(RLFlowError, match=r"dynamic dimension 0 .*--input-shape input_ids="):
        load_onnx(path)
    g = load_onnx(path, ["input_ids=3x8"])
    assert g.types["input_ids"].shape == (3, 8)
    feeds = make_inputs(g, seed=2)
    assert max_rel_diff(ort_run(str(path), feeds), get_runner(g, "ort")(feeds)) <= 1e-4
    with pytest.raises(RLFlowError, match="dimension 1 is 9, the model fixes it to 8"):
        load_onnx(path, ["input_ids=3x9"])
    with pytest.raises(RLFlowError, match="unknown input 'ids'"):
        load_onnx(path, ["ids=3x8"])


def test_opaque_ops_are_preserved(tmp_path):
    src = tmp_path / "opaque.onnx"
    onnx.save(onnx_models.with_opaque_op(), str(src))
    g = load_onnx(src)
    assert [n.op_type_name() for n in g.opaque_nodes()] == ["Elu", "HardSigmoid"]
    assert g.op_counts() == {"Conv": 1, "Elu": 1, "HardSigmoid": 1, "Relu": 1}
    out = tmp_path / "out.onnx"
    save_onnx(g, out)
    exported = onnx.load(str(out))
    elu = next(n for n in exported.graph.node if n.op_type == "Elu")
    hs = next(n for n in exported.graph.node if n.op_type == "HardSigmoid")
    assert onnx.helper.get_attribute_value(elu.attribute[0]) == pytest.approx(0.7)
    assert {a.name: onnx.helper.get_attribute_value(a) for a in hs.attribute} == pytest.approx({"alpha": 0.3, "beta": 0.4})
    feeds = make_inputs(g)
    ref = ort_run(str(src), feeds)
    assert max_rel_diff(ref, ort_run(str(out), feeds)) <= 1e-6
    assert max_rel_diff(ref, get_runner(g, "torch")(feeds)) <= 1e-5  # opaque nodes run through onnxruntime


# ------------------------------------------------------------------------------------------------ bad input
def _bad_files(tmp_path):
    good = tmp_path / "good.onnx"
    onnx.save(onnx_models.with_opaque_op(), str(good))
    data = good.read_bytes()
    files = {
        "missing": (tmp_path / "nope.onnx", "no such file"),
        "empty": (tmp_path / "empty.onnx", "empty file"),
        "not_onnx": (tmp_path / "notes.onnx", "not an ONNX model"),
        "truncated": (tmp_path / "truncated.onnx", "not an ONNX model"),
        "cycle": (tmp_path / "cycle.onnx", "cycle through node 'add_a' (Add)"),
        "string_dtype": (tmp_path / "string.onnx", "input 'x' has unsupported element type STRING"),
        "dynamic_shape": (tmp_path / "dynamic.onnx", "input 'x' has dynamic dimension 0 ('batch'); pass --input-shape x=Nx4"),
        "no_static_shape": (tmp_path / "nonzero.onnx", "node 'nz' (NonZero): the shape of output 'y' cannot be inferred"),
        "no_outputs": (tmp_path / "no_outputs.onnx", "the graph has no outputs"),
        "deleted_initializer": (tmp_path / "no_init.onnx", "node 'conv' (Conv) reads 'w', which no node, graph input "
                                                           "or initializer defines"),
        "deleted_node": (tmp_path / "no_node.onnx", "node 'relu' (Relu) reads 'e', which no node, graph input or "
                                                    "initializer defines"),
        "dim_minus_one": (tmp_path / "dim_minus_one.onnx", "input 'x' dimension 0 is -1, not a size rlflow can "
                                                           "run (sizes are >= 1); pass --input-shape x=Nx3x8x8 with "
                                                           "N >= 1"),
        "dim_zero": (tmp_path / "dim_zero.onnx", "input 'x' dimension 2 is 0, not a size rlflow can run (sizes are "
                                                 ">= 1); pass --input-shape x=1x3xNx8 with N >= 1"),
    }
    files["empty"][0].write_bytes(b"")
    files["not_onnx"][0].write_text("name,value\nalpha,1\n" * 40)
    files["truncated"][0].write_bytes(data[: len(data) // 2])
    onnx.save(onnx_models.with_cycle(), str(files["cycle"][0]))
    onnx.save(onnx_models.with_string_input(), str(files["string_dtype"][0]))
    onnx.save(onnx_models.with_dynamic_input(), str(files["dynamic_shape"][0]))
    onnx.save(onnx_models.with_data_dependent_shape(), str(files["no_static_shape"][0]))
    for case, mutate in _MUTATIONS.items():
        m = onnx_models.with_opaque_op()
        mutate(m.graph)
        onnx.save(m, str(files[case][0]))
    return files


def _set_input_dim(d: int, value: int):
    return lambda g: setattr(g.input[0].type.tensor_type.shape.dim[d], "dim_value", value)


#: mutations of with_opaque_op (Conv 'conv' reads x and initializer w -> Elu 'elu' -> e -> Relu 'relu' -> HardSigmoid)
_MUTATIONS = {
    "no_outputs": lambda g: g.ClearField("output"),
    "deleted_initializer": lambda g: g.ClearField("initializer"),
    "deleted_node": lambda g: g.node.remove(g.node[1]),
    "dim_minus_one": _set_input_dim(0, -1),
    "dim_zero": _set_input_dim(2, 0),
}
BAD_CASES = ["missing", "empty", "not_onnx", "truncated", "cycle", "string_dtype", "dynamic_shape", "no_static_shape",
             *_MUTATIONS]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_one_line_exit_2_no_output(case, tmp_path, capsys):
    path, message = _bad_files(tmp_path)[case]
    out = tmp_path / "out.onnx"
    code = main(["convert", str(path), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("rlflow: error: "), err
    assert message in err and str(path) in err, err
    assert not out.exists()
    assert not list(tmp_path.glob(".out.onnx*"))  # no temporary leftovers either


@pytest.mark.parametrize("case", ["dim_minus_one", "dim_zero"])
def test_suggested_input_shape_is_accepted(case, tmp_path, capsys):
    """The --input-shape the error suggests (N filled in) is one the tool takes, unlike x=-1x3x8x8 before."""
    path, _ = _bad_files(tmp_path)[case]
    assert main(["inspect", str(path)]) == 2
    suggested = capsys.readouterr().err.split("--input-shape ")[1].split()[0]
    assert suggested in ("x=Nx3x8x8", "x=1x3xNx8")
    assert main(["inspect", str(path), "--input-shape", suggested.replace("N", "8" if case == "dim_zero" else "1"),
                 "--json"]) == 0
    assert '"x": "float32[1x3x8x8]"' in capsys.readouterr().out


def test_bad_input_real_process_has_no_traceback(tmp_path, root):
    path, _ = _bad_files(tmp_path)["truncated"]
    proc = subprocess.run([sys.executable, "-m", "rlflow.cli", "inspect", str(path)], capture_output=True, text=True,
                          cwd=root, env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_convert_writes_verified_static_model(tmp_path, capsys):
    src = tmp_path / "dyn.onnx"
    onnx.save(onnx_models.with_dynamic_input(), str(src))
    out = tmp_path / "static.onnx"
    assert main(["convert", str(src), "--out", str(out), "--input-shape", "x=2x4"]) == 0
    m = onnx.load(str(out))
    assert [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim] == [2, 4]
    assert "max relative output difference 0.00e+00" in capsys.readouterr().out


def test_output_into_a_closed_pipe_is_quiet(tmp_path, root):
    """`rlflow inspect m.onnx | true`: the reader is gone before rlflow writes (its imports take ~1 s)."""
    path = tmp_path / "m.onnx"
    onnx.save(onnx_models.with_opaque_op(), str(path))
    script = f"'{sys.executable}' -m rlflow.cli inspect '{path}' | true; echo \"status=${{PIPESTATUS[0]}}\""
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=root,
                          env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"})
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    assert "status=141" in proc.stdout
