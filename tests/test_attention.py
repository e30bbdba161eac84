"""The fused Attention op: equal to its primitive composition softmax(Q K^T * scale + mask) V on every backend,
for random shapes (4-D and 3-D forms, grouped KV heads, with and without a mask, causal or not); ONNX import of
torch's opset-23 export and export back; shape errors; FLOPs and flash-style bytes; every cost target."""

from __future__ import annotations

import contextlib
import importlib.util
import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from rlflow.errors import RLFlowError
from rlflow.graph import GraphBuilder, load_onnx, save_onnx
from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff
from rlflow.graph.ir import Graph
from rlflow.graph.onnx_io import ir_version, to_onnx
from rlflow.graph.ops import OPS, ShapeError, graph_bytes, graph_flops

BACKENDS = ["torch", "ort", "jax"] + (["tf"] if importlib.util.find_spec("tensorflow") else [])
TOL = 1e-4


# ------------------------------------------------------------------------------------------------ references
def reference(q, k, v, mask, scale, causal, heads):
    """numpy float64: softmax(Q K^T * scale + mask) V, K/V heads repeated for grouped queries."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if heads:
        hq, hkv = heads
        q, k, v = (x.reshape(x.shape[0], x.shape[1], h, -1).transpose(0, 2, 1, 3)
                   for x, h in ((q, hq), (k, hkv), (v, hkv)))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) * scale
    if mask is not None:
        s = s + mask
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    y = (p / p.sum(-1, keepdims=True)) @ v
    if heads:
        y = y.transpose(0, 2, 1, 3).reshape(y.shape[0], y.shape[2], -1)
    return y


def attention_graph(shapes, mask_shape, scale, causal, heads, opset=23) -> Graph:
    b = GraphBuilder("attention", opset=opset)
    ins = [b.input(n, s) for n, s in zip("qkv", shapes)] + ([b.input("m", mask_shape)] if mask_shape else [])
    hq, hkv = heads or (0, 0)
    y = b.op("Attention", ins, name="att", scale=scale, is_causal=causal, q_num_heads=hq, kv_num_heads=hkv)
    return b.build([y])


def primitive_graph(shapes, mask_shape, scale, causal, heads) -> Graph:
    """The same computation from the IR's primitive ops (Reshape, Transpose, Concat, MatMul, Mul, Add, Softmax)."""
    b = GraphBuilder("primitive", opset=18)
    q, k, v = (b.input(n, s) for n, s in zip("qkv", shapes))
    batch = shapes[0][0]
    if heads:
        hq, hkv = heads
        q, k, v = (b.op("Transpose", [b.op("Reshape", [x], shape=(batch, s[1], h, s[2] // h))], perm=(0, 2, 1, 3))
                   for x, s, h in ((q, shapes[0], hq), (k, shapes[1], hkv), (v, shapes[2], hkv)))
    hq, hkv = (b.types[q].shape[1], b.types[k].shape[1])
    if hq != hkv:  # each KV head hq / hkv times in a row
        def repeat(x):
            _, _, s, d = b.types[x].shape
            x5 = b.op("Reshape", [x], shape=(batch, hkv, 1, s, d))
            return b.op("Reshape", [b.op("Concat", [x5] * (hq // hkv), axis=2)], shape=(batch, hq, s, d))
        k, v = repeat(k), repeat(v)
    s = b.op("MatMul", [q, b.op("Transpose", [k], perm=(0, 1, 3, 2))])
    s = b.op("Mul", [s, b.const("scale", np.array([scale], np.float32))])
    if mask_shape:
        s = b.op("Add", [s, b.input("m", mask_shape)])
    if causal:
        sq, skv = b.types[s].shape[-2:]
        s = b.op("Add", [s, b.const("causal", np.triu(np.full((sq, skv), -np.inf, np.float32), 1))])
    y = b.op("MatMul", [b.op("Softmax", [s], axis=3), v])
    if heads:
        _, _, sq, dv = b.types[y].shape
        y = b.op("Reshape", [b.op("Transpose", [y], perm=(0, 2, 1, 3))], shape=(batch, sq, hq * dv))
    return b.build([y])


@st.composite
def cases(draw):
    batch, hkv, group = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    sq, skv, d = draw(st.integers(1, 6)), draw(st.integers(1, 6)), draw(st.integers(1, 8))
    dv = draw(st.sampled_from([d, draw(st.integers(1, 8))]))
    hq = hkv * group
    three_d = draw(st.booleans())
    if three_d:
        shapes, heads = [(batch, sq, hq * d), (batch, skv, hkv * d), (batch, skv, hkv * dv)], (hq, hkv)
    else:
        shapes, heads = [(batch, hq, sq, d), (batch, hkv, skv, d), (batch, hkv, skv, dv)], None
    full = (batch, hq, sq, skv)
    mask = None
    if draw(st.booleans()):  # any shape that broadcasts to the scores: some dims 1, leading ones dropped
        mask = tuple(1 if draw(st.booleans()) else n for n in full)[draw(st.integers(0, 2)):]
    scale = draw(st.sampled_from([None, 0.125, 0.7, 1.5]))
    return shapes, mask, scale if scale is not None else 1 / np.sqrt(d), draw(st.integers(0, 1)), heads


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases(), seed=st.integers(0, 2**16))
def test_attention_equals_its_composition_on_every_backend(case, seed):
    shapes, mask, scale, causal, heads = case
    g = attention_graph(shapes, mask, scale, causal, heads)
    prim = primitive_graph(shapes, mask, scale, causal, heads)
    feeds = make_inputs(g, seed=seed)
    want = [reference(feeds["q"], feeds["k"], feeds["v"], feeds.get("m"), scale, causal, heads)]
    assert g.types[g.outputs[0]].shape == want[0].shape
    for backend in BACKENDS:
        assert max_rel_diff(want, get_runner(g, backend)(feeds)) < TOL, backend
        assert max_rel_diff(want, get_runner(prim, backend)(feeds)) < TOL, backend
    # the export below opset 23 (the primitive ops) computes the same on onnxruntime; both exports read back as
    # IR ops only (no opaque node), which the jax backend runs
    old = attention_graph(shapes, mask, scale, causal, heads, opset=18)
    assert max_rel_diff(want, get_runner(old, "ort")(feeds)) < TOL
    for graph in (g, old):
        back = load_onnx(to_onnx(graph).SerializeToString())
        assert not back.opaque_nodes() and ("Attention" in back.op_counts()) == (graph.opset >= 23)
        assert max_rel_diff(want, get_runner(back, "jax")(feeds)) < TOL
    # the reference semantics in float64 (what rule verification runs) is exact
    import torch

    got = OPS["Attention"].compute([torch.from_numpy(np.asarray(feeds[n], np.float64)) for n in g.inputs],
                                   g.nodes[0].attrs)[0].numpy()
    assert np.max(np.abs(got - want[0])) < 1e-10


def test_tf_xla_runs_attention():
    if "tf" not in BACKENDS:
        pytest.skip("tensorflow is not installed")
    g = attention_graph([(1, 4, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8)], (1, 1, 5, 7), 0.3, 1, None)
    feeds = make_inputs(g, seed=3)
    assert max_rel_diff(get_runner(g, "torch")(feeds), get_runner(g, "tf-xla")(feeds)) < TOL


# ------------------------------------------------------------------------------------------------ ONNX
class _Sdpa:
    """torch's scaled_dot_product_attention with a mask, causal with a scale, and grouped-query heads."""

    @staticmethod
    def module():
        import torch
        import torch.nn.functional as F

        class M(torch.nn.Module):
            def forward(self, q, k, v, m, kg, vg):
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
                c = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
                gq = F.scaled_dot_product_attention(q, kg, vg, enable_gqa=True)
                return a + c + gq

        torch.manual_seed(0)
        args = (torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8), torch.randn(1, 1, 6, 6),
                torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))
        return M().eval(), args


def _export_sdpa(path, opset):
    import torch

    module, args = _Sdpa.module()
    with contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(module, args, str(path), dynamo=True, opset_version=opset,
                          input_names=["q", "k", "v", "m", "kg", "vg"])
    return module, args


def test_torch_export_at_opset_23_imports_as_attention_and_round_trips(tmp_path):
    src = tmp_path / "sdpa.onnx"
    module, args = _export_sdpa(src, 23)
    assert [n.op_type for n in onnx.load(str(src)).graph.node].count("Attention") == 3
    g = load_onnx(src)
    assert g.op_counts() == {"Add": 2, "Attention": 3}
    atts = [n.attrs for n in g.nodes if n.op == "Attention"]
    assert sorted(a["is_causal"] for a in atts) == [0, 0, 1]
    assert sorted(round(a["scale"], 6) for a in atts) == [0.3, round(1 / np.sqrt(8), 6), round(1 / np.sqrt(8), 6)]
    out = tmp_path / "out.onnx"
    save_onnx(g, out)
    m = onnx.load(str(out))
    assert m.opset_import[0].version == 23 and m.ir_version == ir_version(23)
    assert [n.op_type for n in m.graph.node].count("Attention") == 3
    assert load_onnx(out).structural_hash() == g.structural_hash()
    feeds = {n: a.numpy() for n, a in zip(["q", "k", "v", "m", "kg", "vg"], args)}
    want = [module(*args).numpy()]
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert max_rel_diff(want, ref) < TOL
    for backend in BACKENDS:
        assert max_rel_diff(want, get_runner(g, backend)(feeds)) < TOL, backend
    assert max_rel_diff(ref, ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feeds)) \
        <= 1e-6


def _attention_model(attrs=None, mask_type=TensorProto.FLOAT, outputs=(("y", [1, 2, 3, 4]),), extra_inputs=(),
                     shapes=None, opset=23):
    shapes = shapes or {"q": [1, 2, 3, 4], "k": [1, 2, 5, 4], "v": [1, 2, 5, 4]}
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items()]
    names = list(shapes)
    if mask_type is not None:
        inputs.append(helper.make_tensor_value_info("m", mask_type, [1, 1, 3, 5]))
        names.append("m")
    for n, s in extra_inputs:
        inputs.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, s))
        names.append(n)
    node = helper.make_node("Attention", names, [o for o, _ in outputs], name="att", **(attrs or {}))
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, s) for o, s in outputs]
    g = helper.make_graph([node], "g", inputs, outs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version(opset))


def test_import_keeps_what_the_op_does_not_model_opaque():
    def op_of(model):
        return load_onnx(model.SerializeToString()).nodes[0].op

    assert op_of(_attention_model()) == "Attention"
    assert load_onnx(_attention_model().SerializeToString()).nodes[0].attrs == {
        "scale": 0.5, "is_causal": 0, "q_num_heads": 0, "kv_num_heads": 0}  # 1 / sqrt(4) filled in
    assert op_of(_attention_model(mask_type=TensorProto.BOOL)) == "Opaque"
    assert op_of(_attention_model({"softcap": 2.0})) == "Opaque"
    assert op_of(_attention_model({"qk_matmul_output_mode": 1})) == "Opaque"
    assert op_of(_attention_model(outputs=(("y", [1, 2, 3, 4]), ("present_k", [1, 2, 7, 4]), ("present_v", [1, 2, 7, 4])),
                                  extra_inputs=(("pk", [1, 2, 2, 4]), ("pv", [1, 2, 2, 4])))) == "Opaque"
    assert op_of(_attention_model({"softmax_precision": TensorProto.DOUBLE})) == "Opaque"
    assert op_of(_attention_model({"softmax_precision": TensorProto.FLOAT})) == "Attention"
    # opset 25's sliding window
    assert op_of(_attention_model({"left_window_size": 2}, opset=25)) == "Opaque"
    assert op_of(_attention_model(opset=25)) == "Attention"
    three = _attention_model({"q_num_heads": 2, "kv_num_heads": 1}, mask_type=None, outputs=(("y", [1, 3, 12]),),
                             shapes={"q": [1, 3, 8], "k": [1, 5, 4], "v": [1, 5, 6]})
    g = load_onnx(three.SerializeToString())
    assert g.nodes[0].op == "Attention" and g.types["y"].shape == (1, 3, 12)
    assert g.nodes[0].attrs["scale"] == 0.5
    feeds = make_inputs(g, seed=1)
    ref = ort.InferenceSession(three.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for backend in BACKENDS:
        assert max_rel_diff(ref, get_runner(g, backend)(feeds)) < TOL, backend


def test_bool_mask_opaque_still_runs():
    m = _attention_model({"is_causal": 1}, mask_type=TensorProto.BOOL)
    g = load_onnx(m.SerializeToString())
    feeds = make_inputs(g, seed=2)
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert max_rel_diff(ref, get_runner(g, "torch")(feeds)) < TOL  # the opaque node runs on onnxruntime
    assert max_rel_diff(ref, get_runner(g, "ort")(feeds)) <= 1e-6


@pytest.mark.parametrize("shapes,mask,attrs,message", [
    ([(1, 2, 3, 4), (1, 2, 5, 3), (1, 2, 5, 4)], None, {}, "do not fit together"),
    ([(1, 3, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4)], None, {}, "do not fit together"),
    ([(1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 6, 4)], None, {}, "do not fit together"),
    ([(1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4)], (1, 1, 3, 4), {}, "mask shape (1, 1, 3, 4) does not broadcast"),
    ([(1, 3, 8), (1, 5, 8), (1, 5, 8)], None, {}, "needs 4-D Q, K, V"),
    ([(1, 3, 8), (1, 5, 8), (1, 5, 8)], None, {"q_num_heads": 3, "kv_num_heads": 1}, "do not split into 3"),
    ([(1, 3, 8), (1, 5, 8), (1, 5, 8)], None, {"q_num_heads": 2, "kv_num_heads": 0}, "both 0"),
    ([(1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4)], None, {"is_causal": 2}, "is_causal must be 0 or 1"),
])
def test_shape_errors_are_one_line(shapes, mask, attrs, message):
    a = {"scale": 1.0, "is_causal": 0, "q_num_heads": 0, "kv_num_heads": 0, **attrs}
    b = GraphBuilder("bad", opset=23)
    ins = [b.input(n, s) for n, s in zip("qkv", shapes)] + ([b.input("m", mask)] if mask else [])
    with pytest.raises(ShapeError) as e:
        b.op("Attention", ins, name="att", **a)
    assert message in str(e.value) and "node 'att' (Attention)" in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, RLFlowError)


def test_int_inputs_are_a_shape_error():
    b = GraphBuilder("bad", opset=23)
    ins = [b.input(n, (1, 1, 2, 2), dtype="int64") for n in "qkv"]
    with pytest.raises(ShapeError, match="one float type"):
        b.op("Attention", ins, scale=1.0, is_causal=0, q_num_heads=0, kv_num_heads=0)


# ------------------------------------------------------------------------------------------------ costs
def test_flops_and_flash_style_bytes():
    g = attention_graph([(2, 4, 16, 8), (2, 2, 32, 8), (2, 2, 32, 6)], (1, 1, 16, 32), 0.5, 0, None)
    scores = 2 * 4 * 16 * 32
    assert graph_flops(g) == scores * (2 * 8 + 2 * 6 + 1 + 1 + 5)
    q, k, v, m, y = 2 * 4 * 16 * 8, 2 * 2 * 32 * 8, 2 * 2 * 32 * 6, 16 * 32, 2 * 4 * 16 * 6
    assert graph_bytes(g) == 4 * (q + k + v + m + y)  # never the (2, 4, 16, 32) score matrix
    prim = primitive_graph([(2, 4, 16, 8), (2, 2, 32, 8), (2, 2, 32, 6)], (1, 1, 16, 32), 0.5, 0, None)
    assert graph_bytes(prim) > 3 * graph_bytes(g)


@pytest.fixture(scope="module")
def config():
    from rlflow.config import load_config

    return load_config(None)


def _bert_like_attention(opset=23):
    """One BERT-base attention (12 heads, seq 128, head 64) fused, and as the primitive ops."""
    shapes, mask = [(1, 12, 128, 64)] * 3, (1, 1, 1, 128)
    return (attention_graph(shapes, mask, 0.125, 0, None, opset=opset),
            primitive_graph(shapes, mask, 0.125, 0, None))


@pytest.mark.parametrize("gpu", ["v100", "a100", "h100"])
def test_sim_targets_cost_attention_with_flash_traffic(config, gpu):
    from rlflow.cost import make_cost_model

    fused, prim = _bert_like_attention()
    sim = make_cost_model(config, "cpu", kind=f"sim-{gpu}")
    (runtime, flops, nbytes, launches), = sim.node_costs(fused)
    assert nbytes == 4 * (3 * 12 * 128 * 64 + 128 + 12 * 128 * 64) and flops == graph_flops(fused)
    assert launches == 1 and runtime > 0
    spec = config["cost"]["gpus"][gpu]
    assert runtime >= nbytes / (spec["gbps"] * 1e9) * 1e3
    m_fused, m_prim = sim.graph_metrics(fused), sim.graph_metrics(prim)
    assert m_fused.runtime_ms < m_prim.runtime_ms and m_fused.launches < m_prim.launches


def test_every_cost_target_costs_attention(config, tmp_path, monkeypatch):
    """analytic, torch-eager (timed through torch's SDPA) and ort-cpu (onnxruntime's Attention kernel, timed)."""
    from rlflow.cost import make_cost_model
    from rlflow.cost.calibration import measure

    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path / "cache"))
    fused, _ = _bert_like_attention()
    small = attention_graph([(1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4)], None, 0.5, 1, None)
    analytic = make_cost_model({**config, "cost": {**config["cost"], "target": "analytic"}}, "cpu")
    assert analytic.graph_metrics(fused).runtime_ms > 0
    eager = make_cost_model(config, "cpu", kind="torch-eager")
    eager.warmup, eager.repeats = 1, 3
    assert eager.measure([fused, small]) == 2
    assert all(e["op"] == "Attention" and e["runtime_ms"] > 0 for e in eager.table.values())
    assert eager.graph_metrics(fused).runtime_ms > 0
    ortc = make_cost_model(config, "cpu", kind="ort-cpu")
    ortc.warmup, ortc.repeats = 1, 3
    ortc.set_calibration(measure("ort", repeats=3))
    before = ortc.graph_metrics(fused).runtime_ms  # estimated from the calibrated roofline
    assert before > 0
    assert ortc.measure([fused, small]) == 2
    assert all(e["pattern"] == "Attention" and e["runtime_ms"] > 0 for e in ortc.kernels.values())
    assert ortc.graph_metrics(fused).runtime_ms > 0


def test_export_broadcasts_a_mask_onnxruntime_does_not(tmp_path):
    """onnxruntime needs the mask's last two dimensions to be (Sq, Skv); Hugging Face's (B, 1, 1, Skv) is
    broadcast in the file by adding zeros, which reads back as the IR's Add (every backend runs the round trip),
    and folds into a constant mask where the mask is constant."""
    shapes = [(1, 2, 4, 8)] * 3
    g = attention_graph(shapes, (1, 1, 1, 4), 0.3, 0, None)
    m = to_onnx(g)
    assert [n.op_type for n in m.graph.node] == ["Add", "Attention"]
    feeds = make_inputs(g, seed=4)
    want = [reference(feeds["q"], feeds["k"], feeds["v"], feeds["m"], 0.3, 0, None)]
    assert max_rel_diff(want, get_runner(g, "ort")(feeds)) < TOL
    back = load_onnx(m.SerializeToString())
    assert back.op_counts() == {"Add": 1, "Attention": 1} and not back.opaque_nodes()
    for backend in BACKENDS:
        assert max_rel_diff(want, get_runner(back, backend)(feeds)) < TOL, backend
    b = GraphBuilder("const_mask", opset=23)
    q, k, v = (b.input(n, s) for n, s in zip("qkv", shapes))
    y = b.op("Attention", [q, k, v, b.const("m", np.zeros((1, 1, 1, 4), np.float32))], scale=0.3, is_causal=0,
             q_num_heads=0, kv_num_heads=0)
    back = load_onnx(to_onnx(b.build([y])).SerializeToString())
    assert back.op_counts() == {"Attention": 1}
    assert next(iter(back.constants.values())).array.shape == (1, 1, 4, 4)


@pytest.mark.parametrize("d,dv,causal", [(4, 4, 0), (4, 4, 1), (4, 6, 1)])
def test_a_row_without_keys_is_zeros_on_every_backend(d, dv, causal):
    """ONNX: a query row whose mask is -inf for every key gives zeros, not NaN (jax's and TF's softmax would)."""
    g = attention_graph([(1, 2, 3, d), (1, 2, 5, d), (1, 2, 5, dv)], (1, 1, 3, 5), 0.5, causal, None)
    feeds = make_inputs(g, seed=5)
    mask = np.zeros((1, 1, 3, 5), np.float32)
    mask[0, 0, 1] = -np.inf          # row 1: no key at all
    mask[0, 0, 2, :1] = -np.inf      # row 2: with the causal mask, none either (it allows keys 0..2 only)
    mask[0, 0, 2, 3:] = -np.inf
    mask[0, 0, 2, 1:3] = -np.inf if causal else 0.0
    feeds["m"] = mask
    want = reference(feeds["q"], feeds["k"], feeds["v"], np.where(np.isinf(mask), 0.0, mask), 0.5, causal, None)
    want[:, :, 1] = 0
    if causal:
        want[:, :, 2] = 0
    for backend in BACKENDS + (["tf-xla"] if "tf" in BACKENDS else []):
        got = get_runner(g, backend)(feeds)[0]
        assert np.isfinite(got).all(), backend
        assert max_rel_diff([want[:, :, :1]], [got[:, :, :1]]) < TOL, backend
        assert np.all(got[:, :, 1] == 0) and (not causal or np.all(got[:, :, 2] == 0)), backend


@pytest.mark.parametrize("mshape", [(), (3,), (1, 3), (2, 3)])
def test_low_rank_mask_on_every_backend(mshape):
    """A mask of rank < 2 (a scalar, or one value per key) broadcasts as ONNX says: torch's SDPA takes masks of
    rank >= 2 only, so its executor reshapes it (a fused-rule binding found this)."""
    g = GraphBuilder("a", opset=23)
    q, k, v = g.input("q", [1, 2, 2, 4]), g.input("k", [1, 2, 3, 4]), g.input("v", [1, 2, 3, 4])
    m = g.input("m", list(mshape))
    graph = g.build([g.op("Attention", [q, k, v, m], scale=0.5, is_causal=0, q_num_heads=0, kv_num_heads=0)])
    feeds = make_inputs(graph, 0)
    want = [reference(feeds["q"], feeds["k"], feeds["v"], feeds["m"], 0.5, False, None)]
    for backend in BACKENDS:
        assert max_rel_diff(want, get_runner(graph, backend)(feeds)) < TOL, backend
