"""Small ONNX models built in the tests: torch exports of an HF-style transformer block, and hand-made files."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def hf_block_module(hidden=32, heads=2, vocab=50, seq=8):
    """An HF-style encoder block: token + position embeddings (Gather), LayerNorm, an attention mask built from
    a constant all-ones mask with Equal/Where/Expand, softmax attention, erf-GELU FFN."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(s):
            super().__init__()
            s.h, s.n = hidden, heads
            s.emb, s.pos = nn.Embedding(vocab, hidden), nn.Embedding(64, hidden)
            s.register_buffer("pos_ids", torch.arange(64)[None])
            s.ln, s.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            s.q, s.k, s.v, s.o = (nn.Linear(hidden, hidden) for _ in range(4))
            s.ff1, s.ff2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(s, ids):
            b, t = ids.shape
            x = s.ln(s.emb(ids) + s.pos(s.pos_ids[:, :t]))
            mask = torch.ones(b, t)
            ext = torch.where(mask[:, None, None, :] == 0, torch.tensor(torch.finfo(torch.float32).min),
                              torch.tensor(0.0)).expand(b, s.n, t, t)

            def split(y):
                return y.view(b, t, s.n, s.h // s.n).transpose(1, 2)

            q, k, v = split(s.q(x)), split(s.k(x)), split(s.v(x))
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(s.h // s.n) + ext, -1)
            x = s.ln2(x + s.o((att @ v).transpose(1, 2).reshape(b, t, s.h)))
            return x + s.ff2(nn.functional.gelu(s.ff1(x)))

    torch.manual_seed(0)
    return Block().eval(), torch.randint(0, vocab, (1, seq))


def export_hf_block(path, dynamo: bool, opset: int = 18, dynamic_batch: bool = False) -> None:
    import torch

    module, ids = hf_block_module()
    kw = {}
    if dynamic_batch:
        if dynamo:
            kw["dynamic_shapes"] = ({0: torch.export.Dim("batch", min=1, max=64)},)
        else:
            kw["dynamic_axes"] = {"input_ids": {0: "batch"}}
    torch.onnx.export(module, (ids,), str(path), dynamo=dynamo, opset_version=opset, input_names=["input_ids"],
                      external_data=False, **kw)


def _model(nodes, inputs, outputs, inits=(), opset=18, value_info=()):
    g = helper.make_graph(nodes, "test", inputs, outputs, list(inits), value_info=list(value_info))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def with_opaque_op():
    """Conv -> Elu (not in the IR's op set) -> Relu -> HardSigmoid."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Elu", ["c"], ["e"], name="elu", alpha=0.7),
             helper.make_node("Relu", ["e"], ["r"], name="relu"),
             helper.make_node("HardSigmoid", ["r"], ["y"], name="hs", alpha=0.3, beta=0.4)]
    return _model(nodes, [x], [y], [w])


def with_cycle():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
    nodes = [helper.make_node("Add", ["x", "b"], ["a"], name="add_a"),
             helper.make_node("Relu", ["a"], ["b"], name="relu_b"),
             helper.make_node("Identity", ["a"], ["y"], name="out")]
    return _model(nodes, [x], [y])


def with_string_input():
    x = helper.make_tensor_value_info("x", TensorProto.STRING, [2])
    y = helper.make_tensor_value_info("y", TensorProto.STRING, [2])
    return _model([helper.make_node("Identity", ["x"], ["y"], name="id")], [x], [y])


def with_dynamic_input():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    return _model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [x], [y])


def with_data_dependent_shape():
    """NonZero's output length depends on the data: no static shape exists."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [2, "n"])
    return _model([helper.make_node("NonZero", ["x"], ["y"], name="nz")], [x], [y])


def shared_input_mlp(batch: int | str = 8) -> onnx.ModelProto:
    """'mlp': x [batch, 64] -> MatMul w1 -> Relu, x -> MatMul w2 -> Relu, Add (two MatMuls on one input, which the
    rules merge into one). ``batch`` a string: a dynamic (symbolic) batch dimension of that name."""
    rng = np.random.default_rng(0)
    w = [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), f"w{k}") for k in (1, 2)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 64])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"]), helper.make_node("MatMul", ["x", "w2"], ["b"]),
             helper.make_node("Relu", ["a"], ["ra"]), helper.make_node("Relu", ["b"], ["rb"]),
             helper.make_node("Add", ["ra", "rb"], ["y"])]
    g = helper.make_graph(nodes, "mlp", [x], [y], w)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
