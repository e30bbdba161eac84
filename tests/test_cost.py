"""Cost models (rlflow.cost), `rlflow cost` and the measure_costs stage."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlflow.cli import main
from rlflow.cost import AnalyticCost, MeasuredCost, Metrics, make_cost_model, signature
from rlflow.cost.platform import record_in_cache, resolve_platform
from rlflow.errors import RLFlowError
from rlflow.graph import GraphBuilder, load_onnx, save_onnx

@pytest.fixture(autouse=True)
def _calibration_cache(tmp_path, monkeypatch):
    """Calibrations measured by a test go to its own folder, not ~/.cache."""
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path / "cache"))


PEAK = {"gflops": 1.0, "gbps": 2.0, "launch_us": 10.0}  # 1e9 flop/s, 2e9 B/s, 0.01 ms per launch

ASSOC = {  # (x @ w0) @ w1 -> x @ (w0 @ w1), weights only
    "id": "t-assoc", "name": "matmul-assoc", "origin": "builtin",
    "src": [{"op": "MatMul", "inputs": ["x", "w0"], "attrs": {}}, {"op": "MatMul", "inputs": ["%0", "w1"], "attrs": {}}],
    "dst": [{"op": "MatMul", "inputs": ["w0", "w1"], "attrs": {}}, {"op": "MatMul", "inputs": ["x", "%0"], "attrs": {}}],
    "outputs": [["%1", "%1"]], "constraints": {"const": ["w0", "w1"]},
    "verified": {"method": "by hand", "trials": 0},
}


def _w(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def chain_graph():
    """x[4x8] @ w0[8x16] @ w1[16x2] -> Relu -> Reshape; plus Transpose(w0) @ ... weight-only."""
    b = GraphBuilder("chain")
    x = b.input("x", (4, 8))
    h = b.op("MatMul", [x, b.const("w0", _w(8, 16))], name="mm0")
    h = b.op("MatMul", [h, b.const("w1", _w(16, 2, seed=1))], name="mm1")
    r = b.op("Relu", [h], name="relu")
    y = b.op("Reshape", [r], name="reshape", shape=(8,))
    return b.build([y])


def test_analytic_matmul_by_hand():
    g = chain_graph()
    model = AnalyticCost("cpu", PEAK)
    costs = dict(zip([n.name for n in g.nodes], model.node_costs(g)))
    flops, nbytes = 2 * 4 * 8 * 16, (4 * 8 + 8 * 16 + 4 * 16) * 4          # 2MKN; inputs + output, float32
    runtime = max(flops / 1e9, nbytes / 2e9) * 1e3 + 0.01
    assert costs["mm0"] == pytest.approx((runtime, flops, nbytes, 1.0))
    flops1, nbytes1 = 2 * 4 * 16 * 2, (4 * 16 + 16 * 2 + 4 * 2) * 4
    assert costs["mm1"] == pytest.approx((max(flops1 / 1e9, nbytes1 / 2e9) * 1e3 + 0.01, flops1, nbytes1, 1.0))
    assert costs["reshape"] == (0.0, 0.0, 0.0, 0.0)  # a view: no launch, no bytes
    m = model.graph_metrics(g)
    assert m == Metrics(*(sum(c[i] for c in costs.values()) for i in range(4)))
    assert m.launches == 3
    # the bound moves the inputs, the output and the two weights once (not the intermediate mm0 -> mm1)
    essential = (4 * 8 + 8 * 16 + 16 * 2 + 4 * 2) * 4
    assert model.roofline_bound_ms(g) == pytest.approx(max(m.flops / 1e9, essential / 2e9) * 1e3)
    assert model.roofline_bound_ms(g) < m.runtime_ms


def test_roofline_bound_reads_only_the_gathered_rows_of_a_table():
    """An embedding lookup moves the rows it gathers, not the whole table: a bound counting the table would lie
    above the measured time of a transformer export (its vocabulary table is tens of MB)."""
    from rlflow.cost.model import essential_bytes

    b = GraphBuilder("embed")
    ids = b.input("ids", (1, 4), "int64")
    e = b.op("Gather", [b.const("table", _w(1000, 16)), ids], name="embed", axis=0)
    y = b.op("MatMul", [e, b.const("w", _w(16, 8))], name="mm")
    g = b.build([y])
    rows, out, ids_b, w = 4 * 16 * 4, 4 * 8 * 4, 4 * 8, 16 * 8 * 4
    assert essential_bytes(g) == ids_b + rows + w + out
    model = AnalyticCost("cpu", PEAK)
    assert model.roofline_bound_ms(g) == pytest.approx(
        max(model.graph_metrics(g).flops / 1e9, (ids_b + rows + w + out) / 2e9) * 1e3)


def test_weight_only_nodes_cost_nothing():
    b = GraphBuilder("wt")
    x = b.input("x", (4, 8))
    wt = b.op("Transpose", [b.const("w", _w(16, 8))], name="wt", perm=(1, 0))   # weight-only: folded
    y = b.op("MatMul", [x, wt], name="mm")
    g = b.build([y])
    model = AnalyticCost("cpu", PEAK)
    c = dict(zip([n.name for n in g.nodes], model.node_costs(g)))
    assert c["wt"] == (0.0, 0.0, 0.0, 0.0)
    assert c["mm"][3] == 1.0 and c["mm"][1] == 2 * 4 * 8 * 16
    assert model.graph_metrics(g).launches == 1


def test_cache_after_rewrite_matches_fresh_model():
    from rlflow.rewrite.matcher import MatchIndex
    from rlflow.rewrite.rule import rule_from_json

    g0 = chain_graph()
    idx = MatchIndex(g0, [rule_from_json(ASSOC)])
    assert idx.counts() == [1]
    g1 = idx.apply(0, 0).graph
    table = {signature(n, [g0.types[v] for v in n.inputs]): {"op": n.op, "runtime_ms": 0.5, "flops": 1.0,
                                                             "bytes": 1.0}
             for n in g0.nodes if n.name == "mm0"}
    for make in (lambda: AnalyticCost("cpu", PEAK), lambda: MeasuredCost("cpu", PEAK, table)):
        model = make()
        before = model.graph_metrics(g0)
        cached = len(model._by_node)
        after = model.graph_metrics(g1)
        assert after == make().graph_metrics(g1)
        assert len(model._by_node) == cached + 1  # only the new x @ (w0 @ w1) was costed; Relu was reused
        assert after.launches == 2 and after.flops < before.flops  # w0 @ w1 is weight-only: free


def test_measured_measure_save_load(tmp_path):
    g = chain_graph()
    model = MeasuredCost("cpu", PEAK, warmup=0, repeats=3)
    assert set(model.missing([g])) == {signature(n, [g.types[v] for v in n.inputs])
                                       for n in g.nodes if n.op != "Reshape"}
    assert model.measure([g, g]) == 3
    assert model.measure([g]) == 0 and not model.missing([g])
    assert all(e["runtime_ms"] > 0 for e in model.table.values())
    path = tmp_path / "costs.json"
    model.save(path)
    loaded = MeasuredCost.load(path, "cpu", PEAK)
    assert loaded.table == model.table
    assert loaded.graph_metrics(g) == model.graph_metrics(g)
    data = json.loads(path.read_text())
    assert data["device"] == "cpu" and data["hardware"] and data["repeats"] == 3
    with pytest.raises(RLFlowError, match="made before caches recorded their platform"):
        make_cost_model({"cost": {"model": "measured"}}, "cpu", path)  # a cache must say what it was made for
    record_in_cache(path, resolve_platform({"device": "cpu"}, "torch-eager"))
    via_config = make_cost_model({"cost": {"model": "measured"}}, "cpu", path)
    assert isinstance(via_config, MeasuredCost) and via_config.table == model.table
    assert MeasuredCost.load(tmp_path / "none.json", "cpu").table == {}  # no file yet: an empty table


def test_calibration_of_unmeasured_ops():
    g = chain_graph()
    mm0 = g.nodes[0]
    sig0 = signature(mm0, [g.types[v] for v in mm0.inputs])
    flops, nbytes = 2 * 4 * 8 * 16, (4 * 8 + 8 * 16 + 4 * 16) * 4
    base0 = max(flops / 1e9, nbytes / 2e9) * 1e3 + 0.01
    model = MeasuredCost("cpu", PEAK, {sig0: {"op": "MatMul", "runtime_ms": 3 * base0, "flops": flops,
                                              "bytes": nbytes}})
    assert model.ratio == {"MatMul": pytest.approx(3.0)}
    c = dict(zip([n.name for n in g.nodes], model.node_costs(g)))
    assert c["mm0"][0] == pytest.approx(3 * base0)                      # measured
    analytic = dict(zip([n.name for n in g.nodes], AnalyticCost("cpu", PEAK).node_costs(g)))
    assert c["mm1"][0] == pytest.approx(3 * analytic["mm1"][0])           # roofline x MatMul's ratio
    assert c["relu"][0] == pytest.approx(3 * analytic["relu"][0])         # no Relu measured: the overall ratio


def test_cache_errors(tmp_path):
    g = chain_graph()
    model = MeasuredCost("cpu", PEAK, warmup=0, repeats=1)
    model.measure([g])
    path = tmp_path / "c.json"
    model.save(path)
    with pytest.raises(RLFlowError, match="measured on 'cpu', but the device is 'cuda'") as e:
        MeasuredCost.load(path, "cuda")
    assert "\n" not in str(e.value)
    bad = tmp_path / "bad.json"
    for text in ("{not json", json.dumps({"format": "x", "ops": {}}), json.dumps([1, 2]),
                 json.dumps({**model.to_json(), "ops": {"MatMul[](x)": {"op": "MatMul", "runtime_ms": "fast"}}})):
        bad.write_text(text)
        with pytest.raises(RLFlowError, match="bad.json") as e:
            MeasuredCost.load(bad, "cpu")
        assert "\n" not in str(e.value)
    with pytest.raises(RLFlowError, match="unknown cost target"):
        make_cost_model({}, "cpu", kind="magic")


@pytest.fixture
def tiny_onnx(tmp_path):
    path = tmp_path / "chain.onnx"
    save_onnx(chain_graph(), path)
    return path


def test_cli_cost(tiny_onnx, tmp_path, capsys):
    assert main(["cost", str(tiny_onnx), "--model", "analytic", "--per-op"]) == 0
    out = capsys.readouterr().out
    for word in ("runtime", "GFLOP", "memory access", "kernel launches", "roofline bound", "MatMul", "Relu"):
        assert word in out
    cache = tmp_path / "cache.json"
    assert main(["cost", str(tiny_onnx), "--target", "torch-eager", "--json", "--per-op", "--save-cache",
                 str(cache)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["cost_model"] == "torch-eager" and res["measured_now"] == 3 and res["saved_cache"] == str(cache)
    assert res["metrics"]["launches"] == 3 and res["metrics"]["flops"] == 2 * 4 * 8 * 16 + 2 * 4 * 16 * 2 + 4 * 2
    assert res["per_op"]["MatMul"]["count"] == 2 and sum(r["share"] for r in res["per_op"].values()) == \
        pytest.approx(1.0)
    assert main(["cost", str(tiny_onnx), "--target", "torch-eager", "--costs", str(cache), "--json"]) == 0
    res2 = json.loads(capsys.readouterr().out)
    assert res2["measured_now"] == 0 and res2["missing_from_cache"] == 0
    assert res2["metrics"] == res["metrics"]
    assert main(["cost", str(tiny_onnx), "--model", "measured", "--costs", str(cache)]) == 0
    assert "3 of 3 op signatures measured" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--model", "magic"], "unknown cost target 'magic'"),
    (["--target", "magic"], "unknown cost target 'magic'"),
    (["--costs", "missing.json"], "no such cost cache"),
    (["--target", "sim-h100", "--costs", "x.json"], "apply to the measured targets"),
    pytest.param(["--target", "cuda"], "needs a CUDA GPU", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a GPU is there: the cuda target works (test_cli_cost_cuda_target_on_a_gpu)")),
])
def test_cli_cost_errors(tiny_onnx, capsys, args, message):
    assert main(["cost", str(tiny_onnx), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.gpu
def test_cli_cost_cuda_target_on_a_gpu(tiny_onnx, capsys):
    """On a GPU box the cuda target times every op with CUDA events and says so."""
    assert main(["cost", str(tiny_onnx), "--target", "cuda", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["cost_model"] == "cuda" and res["metrics"]["runtime_ms"] > 0


def test_cli_cost_bad_files(tmp_path, tiny_onnx, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not an onnx model")
    assert main(["cost", str(bad)]) == 2
    err = capsys.readouterr()
    assert err.out == "" and err.err.startswith("rlflow: error:") and err.err.count("\n") == 1
    cache = tmp_path / "bad.json"
    cache.write_text("[]")
    assert main(["cost", str(tiny_onnx), "--costs", str(cache)]) == 2
    err = capsys.readouterr()
    assert err.out == "" and "not a cost cache" in err.err and err.err.count("\n") == 1


def test_explore_is_seeded(tiny_zoo, rules_file):
    from rlflow.rewrite.rule import load_rules
    from rlflow.stages.measure_costs import explore

    g, rules = load_onnx(tiny_zoo["bert"]), load_rules(rules_file)
    runs = []
    for _ in range(2):
        stats: dict = {}
        runs.append(([h.structural_hash() for h in explore(g, rules, 12, seed=3, stats=stats)], stats))
    assert runs[0] == runs[1]
    hashes, stats = runs[0]
    assert stats["neighbours"] > 0 and stats["walk_steps"] == 12
    assert len(hashes) == 1 + stats["neighbours"] + 12 and hashes[0] == g.structural_hash()


def test_measure_costs_stage(tiny_zoo, rules_file, tmp_path, capsys):
    out = tmp_path / "costs" / "cpu" / "bert.json"
    args = ["measure-costs", "--model", "bert", "--onnx", str(tiny_zoo["bert"]), "--rules", str(rules_file),
            "--out", str(out), "--no-progress", "--set", "device=cpu", "--set", "cost.explore_steps=10",
            "--set", "cost.repeats=2", "--set", "cost.warmup=0", "--set", "cost.target=torch-eager"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "op signatures measured" in text and "ms torch-eager" in text and "ms analytic" in text
    assert "calibration ort: GEMM" in text
    model = MeasuredCost.load(out, "cpu")
    g = load_onnx(tiny_zoo["bert"])
    assert model.table and not model.missing([g])  # every signature of the model is measured
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["repeats"] == 2 and data["warmup"] == 0
    assert main(["cost", str(tiny_zoo["bert"]), "--target", "torch-eager", "--costs", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["missing_from_cache"] == 0
    assert main(args[:-10] + ["--out", str(tmp_path)]) == 2  # --out a folder: a one-line error


def test_commutative_ops_share_a_signature():
    from rlflow.cost.model import signature
    from rlflow.graph.ir import Node, TensorType

    a, b = TensorType((2, 3), "float32"), TensorType((3,), "float32")
    add = Node("n", "Add", ("x", "y"), ("z",))
    assert signature(add, [a, b]) == signature(add, [b, a])
    mm = Node("m", "MatMul", ("x", "y"), ("z",))
    a2, b2 = TensorType((2, 3), "float32"), TensorType((3, 2), "float32")
    assert signature(mm, [a2, b2]) != signature(mm, [b2, a2])


def test_measure_costs_analytic_target_on_a_gpu_box(tiny_zoo, rules_file, tmp_path, capsys, monkeypatch):
    """cost.target analytic with device cuda: the cache measure_costs writes is read back on the run's device
    (it was written as 'cpu' and refused as 'measured on cpu, but the device is cuda')."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU box, simulated
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Simulated GPU")
    out = tmp_path / "costs" / "auto" / "bert.json"
    args = ["measure-costs", "--model", "bert", "--onnx", str(tiny_zoo["bert"]), "--rules", str(rules_file),
            "--out", str(out), "--no-progress", "--set", "device=auto", "--set", "cost.target=analytic"]
    assert main(args) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["device"] == "cuda" and data["platform"]["device"] == "cuda"
    assert data["hardware"] == "Simulated GPU"
    config = {"device": "auto", "cost": {"target": "analytic"}}
    assert make_cost_model(config, "cuda", out).device == "cuda"  # what the stages that score graphs do
