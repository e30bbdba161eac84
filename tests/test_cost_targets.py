"""Cost targets (rlflow.cost.targets): simulated GPUs, ort-cpu, cuda without a GPU, calibration."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlflow.config import load_config
from rlflow.cost import make_cost_model, resolve_target
from rlflow.cost.ort_cpu import profile_in_context
from rlflow.cost.simgpu import gemm_efficiency
from rlflow.errors import RLFlowError
from rlflow.evaluation.protocol import FASTER, ratio_interval, verdict
from rlflow.graph import GraphBuilder, load_onnx, zoo


@pytest.fixture(autouse=True)
def _calibration_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def config():
    return load_config(None)


@pytest.fixture(scope="module")
def qkv_sequence(tmp_path_factory):
    """One BERT-base layer (hidden 768, seq 128) and the graphs after merging Q with K, then QK with V, by the
    project's own rule (b-matmul-merge) and engine (MatchIndex)."""
    from rlflow.rewrite.builtin import builtin_rules
    from rlflow.rewrite.matcher import MatchIndex

    path = tmp_path_factory.mktemp("qkv") / "bert1.onnx"
    zoo.export_model("bert", path, dict(zoo.DEFAULT_SIZES["bert"], layers=1, vocab=512))
    g = load_onnx(path)
    rules = [r for r, _ in builtin_rules() if r.id == "b-matmul-merge"]
    seq, idx = [g], MatchIndex(g, rules)
    for _ in range(2):
        assert idx.matches[0], "the Q/K/V MatMuls must be mergeable"
        idx = idx.apply(0, 0)
        seq.append(idx.graph)
    assert [h.op_counts().get("Split", 0) for h in seq] == [0, 1, 2]
    assert [h.op_counts()["MatMul"] for h in seq] == [8, 7, 6]  # Q, K, V, scores, context, output, 2 FFN
    return seq


def test_qkv_merge_lowers_sim_h100_but_not_ort_cpu(qkv_sequence, config):
    """Issue H: the Q/K/V merge sequence of one BERT layer pays on the simulated H100 (fewer launches, better SM
    occupancy) but not on what onnxruntime runs here (three fused MatMul+bias Gemms become one MatMul, a Split
    and three unfused Adds)."""
    from rlflow.cost.calibration import measure

    sim = make_cost_model(config, "cpu", kind="sim-h100")
    s = [sim.graph_metrics(g).runtime_ms for g in qkv_sequence]
    assert s[2] < s[1] < s[0] and s[2] < 0.96 * s[0]
    assert sim.graph_metrics(qkv_sequence[2]).launches == sim.graph_metrics(qkv_sequence[0]).launches - 2

    ort = make_cost_model(config, "cpu", kind="ort-cpu")
    ort.warmup, ort.repeats = 2, 10
    ort.set_calibration(measure("ort", repeats=5))
    ort.learn(qkv_sequence)  # onnxruntime fuses MatMul + bias Add (Gemm) but nothing across the merged Split
    assert ("MatMul", "Add") in ort.fusable and ("MatMul", "Split") not in ort.fusable
    ort.measure(qkv_sequence)
    k = [ort.graph_metrics(g).launches for g in qkv_sequence]
    assert k[2] > k[0]  # Split + three unfused bias Adds replace three fused Gemms
    # What the ort-cpu target times: each kernel inside its whole model. The two graphs' totals are taken in
    # paired sessions (random order within each pair) and compared as the timing protocol compares latencies: the
    # ratio's interval over the sessions, Student's t. Quiet, the merge came out 0.96-1.04x per session (no
    # detectable difference); beside a busy core 0.68-1.6x, so a fixed margin on one pair of totals (the test's
    # old form, >= 0.95x) failed by chance. At 99.9% a merge that does not pay is called faster about once in 2000
    # runs. What the check catches, quiet, 12 sessions: the same layer at seq 108 against seq 128 (15% less work)
    # was called faster in two runs of two; at seq 120 (6% less) it was not, in one.
    graphs = [qkv_sequence[0], qkv_sequence[2]]
    groups = [ort.groups(g) for g in graphs]
    totals: list[list[list[float]]] = [[], []]
    rng = np.random.default_rng(0)
    for _ in range(12):
        for j in rng.permutation(2):
            per, rest, _ = profile_in_context(graphs[j], groups[j], ort.warmup, ort.repeats, ort.threads,
                                              sessions=1)
            totals[j].append([sum(per) + rest])
    ratio, low, high, _ = ratio_interval(totals[0], totals[1], confidence=0.999)
    assert verdict(low, high) != FASTER, (ratio, low, high, totals)


def test_sim_gpu_quantisation_and_free_data_movement(config):
    # one wave of full 128x128 tiles on all SMs is the peak; a small GEMM is best cut into 16 tiles of 32x32
    # (each sustaining 45% of an SM), which fill 16 of the 132 SMs
    assert gemm_efficiency(128 * 12, 128 * 11, 4096, 1, 132) == pytest.approx(1.0)
    assert gemm_efficiency(128, 128, 128, 1, 132) == pytest.approx(16 * 0.45 / 132)
    assert gemm_efficiency(128 * 12, 128 * 11 + 1, 4096, 1, 132) < 1.0  # a partial extra tile column
    b = GraphBuilder("movement")
    x = b.input("x", (64, 256))
    w = b.const("w", np.ones((256, 256), np.float32))
    y = b.op("MatMul", [x, w], name="mm")
    t = b.op("Transpose", [y], name="t", perm=(1, 0))
    r = b.op("Reshape", [t], name="r", shape=(256 * 64,))
    g = b.build([r])
    for gpu in ("v100", "a100", "h100"):
        sim = make_cost_model(config, "cpu", kind=f"sim-{gpu}")
        costs = dict(zip([n.name for n in g.nodes], sim.node_costs(g)))
        assert costs["t"][0] == 0 and costs["t"][3] == 0 and costs["r"] == (0.0, 0.0, 0.0, 0.0)
        spec = config["cost"]["gpus"][gpu]
        flops, nbytes = 2 * 64 * 256 * 256, (64 * 256 + 256 * 256 + 64 * 256) * 4
        eff = gemm_efficiency(64, 256, 256, 1, spec["sms"])
        want = max(flops / (spec["tflops_fp32"] * 1e12 * eff), nbytes / (spec["gbps"] * 1e9)) * 1e3 + \
            spec["launch_us"] * 1e-3
        assert costs["mm"][0] == pytest.approx(want)
        assert sim.label == f"simulated {gpu.upper()}" and sim.describe()["simulated"]


def test_targets_resolve_and_fail_in_one_line(config):
    import torch

    gpu = torch.cuda.is_available()
    assert resolve_target({"cost": {"target": "auto"}}) == ("cuda" if gpu else "sim-h100")
    assert resolve_target({"cost": {"target": "machine"}}) == ("cuda" if gpu else "ort-cpu")
    assert resolve_target({"cost": {"target": "sim-h100", "model": "measured"}}) == "torch-eager"  # old key wins
    assert resolve_target({"cost": {"model": "analytic"}}) == "analytic"
    with pytest.raises(RLFlowError, match="unknown cost target 'gpu'"):
        resolve_target({"cost": {"target": "gpu"}})
    if not gpu:
        with pytest.raises(RLFlowError, match="needs a CUDA GPU") as e:
            make_cost_model(config, "cpu", kind="cuda")
        assert "\n" not in str(e.value)
    with pytest.raises(RLFlowError, match="cost.gpus.h100.sms"):
        make_cost_model({"cost": {"gpus": {"h100": {"tflops_fp32": 1, "gbps": 1, "sms": 0, "launch_us": 1}}}},
                        "cpu", kind="sim-h100")


def test_calibration_is_measured_once_and_cached(tmp_path):
    from rlflow.cost import calibration

    path = tmp_path / "cal.json"
    c = calibration.load_or_measure("ort", "cpu", path)
    assert c.gemm_flops_per_s > 1e8 and c.bandwidth_bytes_per_s > 1e8 and c.kernel_overhead_s >= 0
    assert json.loads(path.read_text())["calibration"]["ort"]["gemm_flops_per_s"] == c.gemm_flops_per_s
    assert calibration.load_or_measure("ort", "cpu", path) == c  # read back, not measured again
    assert calibration.read(path)["ort"].as_peak()["gflops"] == pytest.approx(c.gemm_flops_per_s / 1e9)
    path.write_text('{"calibration": {"ort": {"gemm_flops_per_s": "fast"}}}')
    with pytest.raises(RLFlowError, match="cal.json"):
        calibration.read(path)


def test_ort_cpu_fused_conv_relu_is_onnxruntimes_own_conv_relu_kernel(config):
    """A Conv with a fused ReLU is the kernel onnxruntime makes of Conv + Relu itself, so the rewrite changes
    nothing in the ort-cpu estimate (it did: the fused node had no in-model timing and InceptionV3's 94 fusions
    were credited with 8.4% that end to end was 1.001 [0.988, 1.014])."""
    from rlflow.cost.calibration import measure
    from rlflow.cost.ort_cpu import group_signature, unfused_signature
    from rlflow.rewrite.builtin import builtin_rules
    from rlflow.rewrite.matcher import MatchIndex

    rng = np.random.default_rng(0)
    b = GraphBuilder("convs")
    h = b.input("x", (1, 8, 16, 16))
    for k in range(2):
        w = b.const(f"w{k}", rng.standard_normal((8, 8, 3, 3)).astype("float32"))
        h = b.op("Relu", [b.op("Conv", [h, w], name=f"conv{k}", strides=(1, 1), pads=(1, 1, 1, 1), group=1,
                                activation="none")], name=f"relu{k}")
    g = b.build([h])
    rules = [r for r, _ in builtin_rules() if r.name == "conv-relu-fuse"]
    idx = MatchIndex(g, rules)
    while idx.counts()[0]:
        idx = idx.apply(0, 0)
    fused = idx.graph
    assert [n.attrs.get("activation") for n in fused.nodes if n.op == "Conv"] == ["relu", "relu"]
    assert "Relu" not in fused.op_counts()
    k = next(i for i, n in enumerate(g.nodes) if n.name == "conv0")
    kf = next(i for i, n in enumerate(fused.nodes) if n.op == "Conv" and n.inputs[0] == "x")
    assert unfused_signature(fused, [kf]) == group_signature(g, [k, k + 1])
    assert unfused_signature(g, [k]) is None

    ort = make_cost_model(config, "cpu", kind="ort-cpu")
    ort.warmup, ort.repeats = 2, 10
    ort.set_calibration(measure("ort", repeats=5))
    ort.learn([g])  # the Conv + Relu groups timed inside the model
    assert ("Conv", "Relu") in ort.fusable
    assert ort.graph_metrics(fused).runtime_ms == pytest.approx(ort.graph_metrics(g).runtime_ms, rel=1e-9)
    # eqsat's extraction sums per-op costs: the fused Conv costs its in-model Conv + Relu kernel there too
    sig = group_signature(g, [k, k + 1])
    assert sig in ort.context
    assert ort.alone_ms(fused.nodes[kf], fused.types) == pytest.approx(ort.context[sig] + ort.overhead_ms)


def test_in_model_ratios_are_time_weighted_and_a_rare_pattern_takes_its_class():
    """ort-cpu scales a kernel timed alone by its pattern's in-model / alone ratio: total over total, so a long
    kernel counts for more than a short one; a pattern seen in fewer than MIN_PATTERN_KERNELS kernels (one small
    Gemm of the zoo's GPT-2 ran 3.8x as long in the model as alone) or never seen takes its class's ratio
    (GEMM-like or not)."""
    from rlflow.cost.ort_cpu import MIN_PATTERN_KERNELS, _weighted_ratios, pattern_class

    assert pattern_class("Gemm") == pattern_class("MatMul+Add") == pattern_class("Conv[relu]") == "class:gemm"
    assert pattern_class("Add+LayerNormalization") == pattern_class("Reshape") == "class:other"
    pairs = {"MatMul+Add": [(8.0, 10.0), (0.3, 0.1), (0.9, 1.0)],  # (in model, alone) ms
             "Gemm": [(3.8, 1.0)],                                   # one kernel: not its own ratio
             "Add": [(1.0, 0.5)] * MIN_PATTERN_KERNELS}
    r = _weighted_ratios(pairs)
    assert r["MatMul+Add"] == pytest.approx(9.2 / 11.1)  # not the median of 0.8, 3, 0.9
    assert "Gemm" not in r and r["class:gemm"] == pytest.approx(13.0 / 12.1)
    assert r["Add"] == r["class:other"] == pytest.approx(2.0)
