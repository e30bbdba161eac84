"""Model zoo: tiny versions of every model export to valid ONNX that computes what the torch module computes."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from rlflow.errors import RLFlowError
from rlflow.graph import zoo

#: parameter counts of the default (paper) sizes: torchvision / Hugging Face reference architectures
#: (BERT without pooler, Inception-v3 without the auxiliary classifier)
REFERENCE_PARAMS = {
    "bert": 108_891_648,
    "vit": 86_567_656,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "resnext50": 25_028_904,
    "squeezenet": 1_235_496,
    "inceptionv3": 23_834_568,
    "taso-bert": 8 * 4 * 1024 * 1024,
    "gpt2": 124_439_808,
}


def torch_output(name: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    model, inputs = zoo.build(name, zoo.TINY_SIZES[name], seed=seed)
    with torch.no_grad():
        return inputs, model(*inputs.values()).numpy()


def ort_output(path, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {k: v.numpy() for k, v in inputs.items()})
    return out


def assert_matches_torch(path, name: str) -> None:
    inputs, expected = torch_output(name)
    got = ort_output(path, inputs)
    assert got.shape == expected.shape
    tolerance = 1e-4 * max(1.0, float(np.abs(expected).max()))
    assert float(np.abs(got - expected).max()) <= tolerance


def initializers(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def op_counts(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


@pytest.fixture(scope="module")
def dynamo_exports(tiny_zoo) -> dict:
    """Every tiny model exported once with the dynamo exporter at opset 18, each in its own directory: the
    session's tiny_zoo (conftest.py), which is exactly that."""
    return tiny_zoo


# ------------------------------------------------------------------------------------------ registry and sizes
def test_registry_names_and_size_keys():
    assert zoo.MODEL_NAMES == (
        "bert", "vit", "resnet18", "resnet50", "resnext50", "squeezenet", "inceptionv3", "taso-bert", "gpt2"
    )
    for name in zoo.MODEL_NAMES:
        assert set(zoo.TINY_SIZES[name]) == set(zoo.DEFAULT_SIZES[name])
    assert zoo.DEFAULT_SIZES["bert"] == {
        "layers": 12, "hidden": 768, "heads": 12, "ffn": 3072, "seq": 128, "batch": 1,
        "vocab": 30522, "max_positions": 512, "type_vocab": 2,
    }
    assert zoo.DEFAULT_SIZES["taso-bert"] == {"layers": 8, "seq": 64, "hidden": 1024, "heads": 16}
    assert zoo.DEFAULT_SIZES["inceptionv3"]["image"] == 299
    for name in ("vit", "resnet18", "resnet50", "resnext50", "squeezenet"):
        assert zoo.DEFAULT_SIZES[name]["image"] == 224
        assert zoo.DEFAULT_SIZES[name]["classes"] == 1000


@pytest.mark.parametrize("name", zoo.MODEL_NAMES)
def test_default_sizes_have_reference_parameter_counts(name):
    with torch.device("meta"):  # no memory, no init: just the architecture
        model = zoo._SPECS[name].make(zoo.resolve_sizes(name))
    assert sum(p.numel() for p in model.parameters()) == REFERENCE_PARAMS[name]


def test_unknown_model_and_size_key_raise(tmp_path):
    with pytest.raises(RLFlowError, match="nope"):
        zoo.build("nope")
    with pytest.raises(RLFlowError, match="depth"):
        zoo.build("bert", {"depth": 3})
    with pytest.raises(RLFlowError, match="heads"):
        zoo.build("bert", {"hidden": 30, "heads": 4})
    with pytest.raises(RLFlowError, match="nope"):
        zoo.export_model("nope", tmp_path / "x.onnx")
    with pytest.raises(RLFlowError, match="onnxscript"):
        zoo.export_model("taso-bert", tmp_path / "x.onnx", zoo.TINY_SIZES["taso-bert"], exporter="onnxscript")
    assert list(tmp_path.iterdir()) == []
    message = None
    try:
        zoo.build("resnet18", {"width": 2})
    except RLFlowError as e:
        message = str(e)
    assert message is not None and "\n" not in message and "'width'" in message and "resnet18" in message


def test_build_is_seeded_eval_and_batchnorm_is_not_identity():
    model_a, inputs_a = zoo.build("resnet18", zoo.TINY_SIZES["resnet18"], seed=3)
    model_b, inputs_b = zoo.build("resnet18", zoo.TINY_SIZES["resnet18"], seed=3)
    model_c, _ = zoo.build("resnet18", zoo.TINY_SIZES["resnet18"], seed=4)
    assert not model_a.training
    state_a, state_b, state_c = model_a.state_dict(), model_b.state_dict(), model_c.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert torch.equal(inputs_a["pixels"], inputs_b["pixels"])
    assert not torch.equal(state_a["fc.weight"], state_c["fc.weight"])
    bns = [m for m in model_a.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(bns) == 20
    for bn in bns:
        assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
        assert not torch.allclose(bn.running_mean, torch.zeros_like(bn.running_mean))
        assert not torch.allclose(bn.weight, torch.ones_like(bn.weight))


@pytest.mark.parametrize("name", zoo.MODEL_NAMES)
def test_tiny_outputs_are_finite_and_non_degenerate(name):
    _, out = torch_output(name)
    assert np.isfinite(out).all()
    assert float(out.std()) > 1e-2
    assert float(np.abs(out).max()) < 1e3


# ------------------------------------------------------------------------------------------ dynamo exports
@pytest.mark.parametrize("name", zoo.MODEL_NAMES)
def test_dynamo_export_checks_and_matches_torch(dynamo_exports, name):
    path = dynamo_exports[name]
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no *.onnx.data, no temp files
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [18]
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    _, inputs = zoo.build(name, zoo.TINY_SIZES[name])
    assert [i.name for i in model.graph.input] == list(inputs)
    assert [o.name for o in model.graph.output] == [zoo.OUTPUT_NAMES[name]]
    for value in list(model.graph.input) + list(model.graph.output):  # static shapes
        assert all(d.HasField("dim_value") for d in value.type.tensor_type.shape.dim)
    assert_matches_torch(path, name)


def test_expected_input_and_output_names(dynamo_exports):
    assert zoo.OUTPUT_NAMES["bert"] == "last_hidden_state"
    inputs = {name: onnx.load(str(p)).graph.input[0] for name, p in dynamo_exports.items()}
    assert inputs["bert"].name == "input_ids"
    assert inputs["bert"].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert inputs["taso-bert"].name == "x"
    assert [d.dim_value for d in inputs["taso-bert"].type.tensor_type.shape.dim] == [8, 32]
    for name in ("vit", "resnet18", "resnet50", "resnext50", "squeezenet", "inceptionv3"):
        assert inputs[name].name == "pixels"
        assert inputs[name].type.tensor_type.elem_type == onnx.TensorProto.FLOAT


def test_bert_dynamo_export_keeps_embedding_gathers_and_mask_ops(dynamo_exports):
    ops = op_counts(dynamo_exports["bert"])
    assert ops["Gather"] == 3  # word (input_ids), position ids, token type ids
    assert ops["Equal"] >= 1 and ops["Where"] >= 1 and ops["Expand"] >= 1
    assert ops["Softmax"] == 2 and ops["LayerNormalization"] == 5
    assert ops["Erf"] + ops["Gelu"] == 2


def test_taso_bert_is_matmul_reshape_transpose_only(dynamo_exports):
    ops = op_counts(dynamo_exports["taso-bert"])
    assert set(ops) == {"MatMul", "Reshape", "Transpose"}
    assert ops["MatMul"] == 2 * 6  # 2 layers x (Q, K, V, two batched, output)


def test_dynamo_export_is_deterministic(dynamo_exports, tmp_path):
    """Same seed -> same weights (and the same bytes); another seed -> other weights."""
    first = dynamo_exports["bert"]
    zoo.export_model("bert", tmp_path / "again.onnx", zoo.TINY_SIZES["bert"], seed=0)
    zoo.export_model("bert", tmp_path / "seed1.onnx", zoo.TINY_SIZES["bert"], exporter="torchscript", seed=1)
    a, b = initializers(first), initializers(tmp_path / "again.onnx")
    assert a.keys() == b.keys() and len(a) > 10
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert first.read_bytes() == (tmp_path / "again.onnx").read_bytes()
    key = "embeddings.word_embeddings.weight"
    assert not np.array_equal(a[key], initializers(tmp_path / "seed1.onnx")[key])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.onnx", "seed1.onnx"]


def test_dynamo_export_at_opset_17(tmp_path):
    """The dynamo exporter emits opset 18; 17 goes through ONNX's version converter (ReduceMean axes)."""
    path = tmp_path / "squeezenet.onnx"
    zoo.export_model("squeezenet", path, zoo.TINY_SIZES["squeezenet"], opset=17)
    model = onnx.load(str(path))
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [17]
    onnx.checker.check_model(model, full_check=True)
    assert op_counts(path)["ReduceMean"] == 1
    assert_matches_torch(path, "squeezenet")
    assert [p.name for p in tmp_path.iterdir()] == ["squeezenet.onnx"]


# ------------------------------------------------------------------------------------------ torchscript exports
@pytest.mark.parametrize("name,opset", [("bert", 17), ("resnet18", 18), ("taso-bert", 18)])
def test_torchscript_export_checks_and_matches_torch(dynamo_exports, tmp_path, name, opset):
    path = tmp_path / f"{name}.onnx"
    zoo.export_model(name, path, zoo.TINY_SIZES[name], opset=opset, exporter="torchscript")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [opset]
    assert [o.name for o in model.graph.output] == [zoo.OUTPUT_NAMES[name]]
    assert_matches_torch(path, name)
    if name == "bert":
        assert op_counts(path)["Gather"] == 3
        # both exporters see the same seeded module: the embedding tables are bit-identical
        key = "embeddings.word_embeddings.weight"
        assert np.array_equal(initializers(path)[key], initializers(dynamo_exports["bert"])[key])
