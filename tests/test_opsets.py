"""Every opset the pinned onnx defines: torch exports at opsets 21-25 round-trip and run equal on onnxruntime;
26 (onnxruntime's newest) too; 27 up to onnx's newest are read and written but only torch & co run them
(onnxruntime refuses them in one line); one beyond the newest is a one-line error. The IR version written per
opset stays within what onnxruntime reads."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnx_models
from rlflow.cli import main
from rlflow.errors import RLFlowError
from rlflow.graph import load_onnx, save_onnx
from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff, run_model
from rlflow.graph.onnx_io import MAX_OPSET, MIN_OPSET, ORT_MAX_IR_VERSION, ORT_MAX_OPSET, ir_version, to_onnx


def _tiny(opset: int, ir: int) -> bytes:
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir).SerializeToString()


def _ort_loads(model: bytes) -> bool:
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    try:
        ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 -- onnxruntime's own error types
        return False
    return True


def test_range_is_every_opset_onnx_defines():
    assert (MIN_OPSET, MAX_OPSET) == (13, onnx.defs.onnx_opset_version())
    assert MAX_OPSET >= 23  # Attention


def test_onnxruntime_limits_match_the_installed_onnxruntime():
    """The constants say what this onnxruntime reads: a change of onnxruntime must update them."""
    assert _ort_loads(_tiny(ORT_MAX_OPSET, ORT_MAX_IR_VERSION))
    assert not _ort_loads(_tiny(ORT_MAX_OPSET, ORT_MAX_IR_VERSION + 1))
    if ORT_MAX_OPSET < MAX_OPSET:
        assert not _ort_loads(_tiny(ORT_MAX_OPSET + 1, ORT_MAX_IR_VERSION))


def test_ir_version_per_opset():
    table = {o: ir_version(o) for o in range(MIN_OPSET, MAX_OPSET + 1)}
    assert all(table[o] == 8 for o in range(13, 19))  # as before
    assert (table[19], table[20], table[21], table[22], table[23], table[24], table[25]) == (9, 9, 10, 10, 11, 12, 13)
    assert all(8 <= v <= ORT_MAX_IR_VERSION for v in table.values())
    assert list(table.values()) == sorted(table.values())
    # what the writer uses, and what onnxruntime reads for every opset it runs
    for o in range(MIN_OPSET, ORT_MAX_OPSET + 1):
        assert _ort_loads(_tiny(o, table[o])), o


@pytest.fixture(scope="module", params=[21, 22, 23, 24, 25])
def export_at(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("opsets") / f"block_{request.param}.onnx"
    with contextlib.redirect_stdout(io.StringIO()):  # the dynamo exporter's progress lines
        onnx_models.export_hf_block(path, dynamo=True, opset=request.param)
    return request.param, path


def test_torch_export_at_new_opsets_round_trips(export_at, tmp_path):
    opset, path = export_at
    assert onnx.load(str(path)).opset_import[0].version == opset
    g = load_onnx(path)
    assert g.opset == opset and not g.opaque_nodes()
    out = tmp_path / "out.onnx"
    save_onnx(g, out)
    m = onnx.load(str(out))
    assert m.opset_import[0].version == opset and m.ir_version == ir_version(opset)
    feeds = make_inputs(g, seed=1)
    sess = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (path, out)]
    ref = sess[0].run(None, feeds)
    assert max_rel_diff(ref, sess[1].run(None, feeds)) <= 1e-5
    assert max_rel_diff(ref, get_runner(g, "torch")(feeds)) <= 1e-4
    assert load_onnx(out).structural_hash() == g.structural_hash()


@pytest.mark.parametrize("opset", sorted({ORT_MAX_OPSET, *range(ORT_MAX_OPSET + 1, MAX_OPSET + 1)}))
def test_newest_opsets_round_trip(opset, tmp_path):
    """A file stamped with opset 26 .. onnx's newest (none of the block's ops changed since 25)."""
    src = tmp_path / "block.onnx"
    with contextlib.redirect_stdout(io.StringIO()):
        onnx_models.export_hf_block(src, dynamo=True, opset=25)
    m = onnx.load(str(src))
    m.opset_import[0].version = opset
    m.ir_version = ir_version(opset)
    g = load_onnx(m.SerializeToString())
    assert g.opset == opset and not g.opaque_nodes()
    onnx.checker.check_model(to_onnx(g), full_check=True)
    g2 = load_onnx(to_onnx(g).SerializeToString())
    assert g2.structural_hash() == g.structural_hash()
    feeds = make_inputs(g, seed=1)
    want = get_runner(g, "torch")(feeds)
    assert max_rel_diff(want, get_runner(g2, "jax")(feeds)) <= 1e-4
    if opset <= ORT_MAX_OPSET:
        assert max_rel_diff(want, get_runner(g2, "ort")(feeds)) <= 1e-4
    else:
        with pytest.raises(RLFlowError, match=rf"^graph '.*' is opset {opset}: onnxruntime \S+ runs opsets up to "
                                              rf"{ORT_MAX_OPSET} \(run it on torch, jax or tf\)$"):
            run_model(g2, "ort", feeds)


def test_opset_beyond_the_newest_is_one_line(tmp_path, capsys):
    path = tmp_path / "future.onnx"
    path.write_bytes(_tiny(MAX_OPSET + 1, ORT_MAX_IR_VERSION))
    code = main(["inspect", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"opset {MAX_OPSET + 1} is not supported (supported: 13-{MAX_OPSET}); re-export with " \
           f"opset_version={MAX_OPSET}" in err
    old = tmp_path / "old.onnx"
    old.write_bytes(_tiny(12, 8))
    assert main(["inspect", str(old)]) == 2
    assert "opset 12 is not supported (supported: 13-" in capsys.readouterr().err


def test_relu_at_every_opset_runs_everywhere():
    """The smallest model at every opset: read, written, and run by onnxruntime where it can."""
    x = np.array([-1.0, 2.0], np.float32)
    for opset in range(MIN_OPSET, MAX_OPSET + 1):
        g = load_onnx(_tiny(opset, ir_version(opset)))
        assert to_onnx(g).ir_version == ir_version(opset)
        backends = ["torch", "jax"] + (["ort"] if opset <= ORT_MAX_OPSET else [])
        for b in backends:
            assert get_runner(g, b)({"x": x})[0].tolist() == [0.0, 2.0], (opset, b)
