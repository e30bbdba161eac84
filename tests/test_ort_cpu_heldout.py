"""The ort-cpu target on models it never learned from: a transformers BERT export (random weights) scored as
`rlflow cost --target ort-cpu` scores a user's file, against onnxruntime end to end."""

from __future__ import annotations

import json

import onnx
import pytest
from onnx import TensorProto, helper

from hf_exports import export
from rlflow.cli import main
from rlflow.graph import load_onnx
from rlflow.graph.exec import make_inputs, time_runner
from rlflow.graph.exec.ort_exec import OrtRunner
from rlflow.cost.ort_cpu import OrtCpuCost


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """transformers' BertModel (2 layers, hidden 128, 64 tokens), exported by torch.onnx (TorchScript exporter:
    about 1 s)."""
    return export("bert", "small", tmp_path_factory.mktemp("hf") / "bert.onnx", dynamo=False)


def e2e_ms(path) -> float:
    """End-to-end onnxruntime latency as the benchmarks take it: the fastest of 3 sessions' medians."""
    g = load_onnx(path)
    feeds = make_inputs(g)
    return min(time_runner(OrtRunner(g, "cpu"), feeds, 5, 30)["median_ms"] for _ in range(3))


def cost_ms(path, capsys) -> float:
    capsys.readouterr()
    assert main(["cost", str(path), "--target", "ort-cpu", "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)["metrics"]["runtime_ms"]


def test_every_kernel_onnxruntime_runs_is_charged_to_a_kernel_group(bert):
    """onnxruntime renames what it fuses (``<node>/MatMulAddFusion``, ``SkipLayerNormalization_token_*``, ``Gelu``)
    and adds Reshapes around a Gemm of 3-D inputs; each must be charged to the group it came from. Before, 91%
    of this export's profiled time was traced to no group and left out of the estimate (BERT 4 layers: 0.5 ms
    estimated, 3.7 ms end to end)."""
    from rlflow.cost.ort_cpu import OrtCpuCost, profile_in_context

    g = load_onnx(bert)
    groups = OrtCpuCost().groups(g)  # nothing learned: each node a group of its own
    per, rest, _ = profile_in_context(g, groups, warmup=2, repeats=5, sessions=1)
    assert sum(per) > 0 and rest <= 0.02 * (sum(per) + rest)


def test_ort_cpu_estimate_of_a_heldout_bert_export_is_near_onnxruntime_end_to_end(bert, tmp_path, monkeypatch,
                                                                                  capsys):
    """Within 40% of the end-to-end latency (the estimate was 86% below it on BERT 4 layers, hidden 256; 78% on
    this one). Each try measures this machine's calibration afresh (its own cache, not the user's), then the end
    to end right after. Under pytest-xdist the other worker's load can fall on one of the two and not the other
    (CI once saw the estimate 1.8x the end to end that way), so up to three such pairs are taken and one within
    40% passes; an estimator that is off, as the old one was, misses in every pair."""
    pairs = []
    for attempt in range(3):
        monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path / f"cache{attempt}"))
        est = cost_ms(bert, capsys)
        e2e = e2e_ms(bert)
        pairs.append((est, e2e))
        if abs(est - e2e) / e2e < 0.4:
            return
    pytest.fail(f"no (estimate ms, end-to-end ms) pair within 40%: {pairs}")


def test_profiler_overhead_is_not_counted_as_kernel_time(tmp_path, monkeypatch):
    """onnxruntime's profiler reports several us for a kernel that runs in 0.2 us: the target subtracts what the
    profiler adds (the calibration's ``profiler_overhead_s``) from every kernel it times, never going below 0.
    The profiled events are stubbed, so the figures are exact (a timed ratio against the run would flake under
    load; ``benchmarks/heldout_exports.py`` prints the measured one)."""
    import rlflow.cost.ort_cpu as ort_cpu
    from rlflow.cost.calibration import Calibration

    k = 6
    ops = ("Relu", "Sigmoid", "Neg")
    nodes = [helper.make_node(ops[i % 3], [f"v{i}"], [f"v{i + 1}"], name=f"n{i}") for i in range(k)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("v0", TensorProto.FLOAT, [16])],
                              [helper.make_tensor_value_info(f"v{k}", TensorProto.FLOAT, [16])])
    path = tmp_path / "chain.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8), path)
    g = load_onnx(path)
    reported_us = {"Relu": 5.0, "Sigmoid": 6.0, "Neg": 2.0}  # what the profiler says for each kernel

    def fake_runs(model, feeds, warmup, repeats, threads):
        op = onnx.load_from_string(model).graph.node[0].op_type
        events = [{"ts": 10 * r + 1, "dur": reported_us[op], "args": {"op_name": op}} for r in range(repeats)]
        return events, [10 * r for r in range(repeats)], None

    monkeypatch.setattr(ort_cpu, "_profiled_runs", fake_runs)
    cal = Calibration("ort", "cpu", "test", 1e11, 1e10, 1e-6, profiler_overhead_s=3e-6)
    cost = OrtCpuCost(calibration=cal)
    assert cost.measure([g]) == 3  # nothing learned: each node a kernel of its own, three signatures timed alone
    timed = {e["pattern"]: e["runtime_ms"] for e in cost.kernels.values()}
    # less 3 us each; Neg's 2 us stops at 0
    assert timed == pytest.approx({"Relu": 2e-3, "Sigmoid": 3e-3, "Neg": 0.0}), timed
