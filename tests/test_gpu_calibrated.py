"""Calibrated GPU targets (rlflow.cost.gpu_calibrated): fitting a calibration file from a recorded profile, its
round trip, the estimate it gives, the shipped H200 file as target sim-h200, and auto on a GPU box."""

from __future__ import annotations

import json

import pytest

from rlflow.cost import gpu_calibrated as gc
from rlflow.cost.model import signature
from rlflow.errors import RLFlowError
from rlflow.graph import load_onnx
from rlflow.graph.fold import fold_constants


def _manual_ms(graph, doc) -> float:
    total = 0.0
    for n in graph.nodes:
        hit = doc["signatures"][signature(n, [graph.types[v] for v in n.inputs if v])]
        total += max(hit["host_us"], hit["device_us"]) + doc["loop_us"]
    return total / 1e3


@pytest.fixture(scope="module")
def recorded(tiny_zoo):
    """A profile recorded on the CPU (host times; no kernels) of tiny bert, as gpu_calibrate.py --from writes."""
    from rlflow.cost.gpu_profile import profile_graph

    g = fold_constants(load_onnx(tiny_zoo["bert"]))
    return g, {"hardware": "test CPU", "graphs": {"bert/original": profile_graph(g, "cpu", runs=3, profiled=1)}}


def test_fit_round_trips_and_estimates_the_profiled_graph(recorded, tmp_path):
    g, profile = recorded
    doc = gc.fit(profile)
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(doc))
    assert gc.load(path) == doc
    cost = gc.CalibratedGpuCost("test", gc.load(path))
    assert cost.graph_metrics(g).runtime_ms == pytest.approx(_manual_ms(g, doc))
    # one graph: its host scale is 1, so the table holds its own median host times
    rec = profile["graphs"]["bert/original"]
    first = rec["nodes"][0]
    assert doc["signatures"][first["sig"]]["host_us"] == pytest.approx(first["host_us"], abs=1e-3)
    assert doc["loop_us"] >= 0 and doc["graphs"] == ["bert/original"]


def test_fit_leaves_out_the_held_out_graphs(recorded):
    _, profile = recorded
    two = {"hardware": "x", "graphs": {"a/original": profile["graphs"]["bert/original"],
                                       "hf-b/original": profile["graphs"]["bert/original"]}}
    assert gc.fit(two, exclude=["hf-"])["graphs"] == ["a/original"]
    with pytest.raises(RLFlowError, match="no profiled graphs"):
        gc.fit(two, exclude=["a/", "hf-"])


def test_fit_pools_the_profiles_of_several_sessions(recorded):
    """Two sessions of one GPU model: each graph of each is a measurement, their medians make the table; a session
    whose host ran twice as slow on every node moves no ratio, and profiles of two GPUs do not pool."""
    _, profile = recorded
    rec = profile["graphs"]["bert/original"]
    slow = {**rec, "nodes": [{**n, "host_us": 2 * n["host_us"]} for n in rec["nodes"]],
            "e2e_ms": [2 * x for x in rec["e2e_ms"]]}
    first = {"hardware": "x", "measured": "day 1", "graphs": {"bert/original": rec, "vit/original": rec}}
    second = {"hardware": "x", "measured": "day 2", "graphs": {"bert/original": slow}}
    doc = gc.fit([first, second])
    assert doc["graphs"] == ["bert/original", "vit/original"] and doc["profiles"] == 2
    assert doc["measured"] == "day 1, day 2"
    # three measurements of each signature, each session's scaled to a typical host (between the two): every
    # signature's time moves by one factor, so no ratio moves
    sig = rec["nodes"][0]["sig"]
    assert doc["signatures"][sig]["runs"] == 3 * sum(n["sig"] == sig for n in rec["nodes"])
    alone = gc.fit(first)["signatures"]
    factors = {round(doc["signatures"][s]["host_us"] / alone[s]["host_us"], 2) for s in alone if alone[s]["host_us"]}
    assert len(factors) == 1 and 1 < factors.pop() < 2
    assert gc.fit([first, second], exclude=["vit"])["graphs"] == ["bert/original"]
    with pytest.raises(RLFlowError, match="different GPUs: x, y"):
        gc.fit([first, {**second, "hardware": "y"}])


def test_a_graph_slower_than_its_profiles_typical_node_keeps_its_times(recorded):
    """The host speed is normalised per profile (the machine), not per graph: a graph whose own ops run 1.5x
    slower (inceptionv3's greedy graph on the H200s) keeps that in the table, so a search sees it."""
    _, profile = recorded
    rec = profile["graphs"]["bert/original"]
    slow = {**rec, "nodes": [{**n, "sig": n["sig"] + "|slow", "host_us": 1.5 * n["host_us"]} for n in rec["nodes"]]}
    doc = gc.fit({"hardware": "x", "graphs": {"a/original": rec, "a/greedy": slow, "b/original": rec}})
    sig = rec["nodes"][0]["sig"]
    assert doc["signatures"][sig + "|slow"]["host_us"] == pytest.approx(1.5 * doc["signatures"][sig]["host_us"],
                                                                       rel=1e-3)


def test_host_scales_find_the_slower_run():
    node = lambda op, us: {"op": op, "host_us": us}  # noqa: E731
    graphs = {"fast": {"nodes": [node("Add", 10), node("MatMul", 20)]},
              "slow": {"nodes": [node("Add", 20), node("MatMul", 40)]},
              "mid": {"nodes": [node("Add", 15), node("MatMul", 30)]}}
    s = gc.host_scales(graphs)
    assert s["mid"] == pytest.approx(1.0) and s["slow"] / s["fast"] == pytest.approx(2.0)


def test_an_unmeasured_signature_takes_its_op_median_and_the_roofline(tiny_zoo):
    g = fold_constants(load_onnx(tiny_zoo["bert"]))
    doc = {"hardware": "x", "loop_us": 2.0, "default_host_us": 7.0, "op_host_us": {"MatMul": 30.0},
           "device": {"launch_us": 1.0, "gemm_flops_per_us": 1e3, "bytes_per_us": 1e9}, "signatures": {}}
    cost = gc.CalibratedGpuCost("x", doc)
    mm = next(n for n in g.nodes if n.op == "MatMul")
    add = next(n for n in g.nodes if n.op == "Add")
    rt, flops, _, launches = cost.node_cost(mm, g.types)
    assert launches == 1 and rt == pytest.approx((max(30.0, 1.0 + flops / 1e3) + 2.0) / 1e3)
    assert cost.node_cost(add, g.types)[0] == pytest.approx((7.0 + 2.0) / 1e3)  # default host; bytes are fast


@pytest.mark.parametrize("damage, message", [
    ("not json", "not a GPU calibration .JSONDecodeError"),
    ('{"format": "other"}', "not a GPU calibration .format is not"),
    ('{"format": "rlflow.gpu-calibration/1", "hardware": "x"}', "without 'loop_us'"),
])
def test_a_bad_calibration_file_is_one_line(tmp_path, damage, message):
    p = tmp_path / "bad.json"
    p.write_text(damage)
    with pytest.raises(RLFlowError, match=message) as e:
        gc.load(p)
    assert "\n" not in str(e.value)


def test_sim_h200_is_the_shipped_h200_calibration(tiny_zoo):
    from rlflow.config import load_config
    from rlflow.cost import make_cost_model
    from rlflow.cost.platform import resolve_platform

    assert "h200" in gc.calibrated_gpus()
    doc = gc.load(gc.calibration_path("h200"))
    assert doc["hardware"] == "NVIDIA H200" and len(doc["signatures"]) > 100
    cfg = load_config(None)
    cost = make_cost_model(cfg, "cpu", kind="sim-h200")
    assert cost.label == "calibrated H200" and cost.describe()["calibrated"]
    g = fold_constants(load_onnx(tiny_zoo["bert"]))
    assert cost.graph_metrics(g).runtime_ms > len(g.nodes) * doc["loop_us"] / 1e3
    p = resolve_platform(cfg, "sim-h200")
    assert (p.label, p.device) == ("calibrated H200", "cuda")


@pytest.mark.parametrize("name, target", [("NVIDIA H200", "sim-h200"), ("NVIDIA H100 80GB HBM3", "cuda")])
def test_auto_on_a_gpu_box_takes_its_gpus_calibrated_target(monkeypatch, name, target):
    import torch

    from rlflow.cost import platform

    monkeypatch.setattr(platform, "has_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert platform.resolve_target({"cost": {"target": "auto"}}) == target
    assert platform.resolve_target({"cost": {"target": "machine"}}) == "cuda"


def test_gpu_calibrate_profiles_a_pack_without_comparisons(tiny_zoo, tmp_path):
    """``--from PACK --sessions 0``: the profile only (no protocol comparisons), which --help promises."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "pack" / "bert").mkdir(parents=True)
    shutil.copy(tiny_zoo["bert"], tmp_path / "pack" / "bert" / "original.onnx")
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_calibrate.py"), "--from", str(tmp_path / "pack"),
                        "--out", str(out), "--sessions", "0", "--rounds", "1", "--runs", "2"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert list(doc["graphs"]) == ["bert/original"] and doc["comparisons"] == {}
    assert doc["protocol"].startswith("none")


def test_the_pack_holds_an_attention_fused_graph_whose_fit_prices_attention(tiny_zoo, tmp_path):
    """``--pack`` writes <model>-o23 beside the zoo folders: the export at opset 23 and greedy's graph with the
    fused-kernel rules, every attention block one Attention; profiled, the fit then holds an Attention signature
    (the calibrated target's price of the fused op, which the opset-18 graphs never had)."""
    import sys
    from pathlib import Path

    import onnx

    from rlflow.cost.gpu_profile import profile_graph

    sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "benchmarks")]
    import gpu_calibrate

    dest = tmp_path / "bert-o23"
    n, diff = gpu_calibrate.pack_fused(tiny_zoo["bert"], dest)
    assert n == 2 and diff <= 1e-4  # tiny bert: two attention blocks, outputs checked against the export
    original, fused = (onnx.load(str(dest / f"{n}.onnx")) for n in ("original", "fused"))
    assert [o.version for o in original.opset_import if o.domain in ("", "ai.onnx")] == [23]
    assert not any(n.op_type == "Attention" for n in original.graph.node)
    assert not any(n.op_type == "Softmax" for n in fused.graph.node)
    from sim_vs_real import unpack

    graph = fold_constants(load_onnx(unpack(dest / "fused.onnx", tmp_path, 0)))
    profile = {"hardware": "test CPU", "graphs": {"bert-o23/fused": profile_graph(graph, "cpu", runs=2, profiled=1)}}
    assert any(k.startswith("Attention[") for k in gc.fit([profile])["signatures"])


def test_the_pack_refuses_a_fused_graph_that_computes_something_else(tiny_zoo, tmp_path, monkeypatch):
    """A fused graph whose outputs differ from the export's (here: a search that doubled a weight) stops the pack
    with the output named, and nothing is written for that model."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    import rlflow.search.output
    from rlflow.graph.ir import Constant

    sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "benchmarks")]
    import gpu_calibrate

    def broken(method, graph, rules, cost):  # the search's answer: the graph with its largest weight doubled
        g = graph.copy()  # new containers: the original graph keeps its weights
        name, weight = max(g.constants.items(), key=lambda kv: kv[1].array.size)
        g.constants[name] = Constant(weight.array * 2)
        return SimpleNamespace(graph=g)

    monkeypatch.setattr(rlflow.search.output, "run_method", broken)
    with pytest.raises(RLFlowError, match="differs from the original"):
        gpu_calibrate.pack_fused(tiny_zoo["bert"], tmp_path / "bert-o23")
    assert not (tmp_path / "bert-o23").exists()


def test_fit_skips_a_profiled_graph_whose_ops_the_pack_no_longer_has(recorded, tiny_zoo, tmp_path):
    """``--fit P1 P2 --from PACK``: a profile taken when the graph had other ops (e.g. before an op joined the IR)
    is pooled but not estimated against the pack's graph, and says so; the current one is estimated."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    g, profile = recorded
    (tmp_path / "pack" / "bert").mkdir(parents=True)
    shutil.copy(tiny_zoo["bert"], tmp_path / "pack" / "bert" / "original.onnx")
    old = json.loads(json.dumps(profile))
    old["graphs"]["bert/original"]["nodes"] = old["graphs"]["bert/original"]["nodes"][1:]  # one op fewer
    for name, doc in (("now", profile), ("before", old)):
        (tmp_path / f"{name}.json").write_text(json.dumps({**doc, "measured": name}))
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_calibrate.py"), "--fit",
                        str(tmp_path / "now.json"), str(tmp_path / "before.json"), "--from", str(tmp_path / "pack")],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    now, before = r.stdout.split("profile before.json")
    assert "bert/original" in now and "not estimated" not in now
    assert "its ops differ): not estimated" in before
