"""The backends and the whole-model profile on a CUDA GPU (marked ``gpu``: skipped without one, run by
benchmarks/gpu_check.sh), and the CPU halves of the same: the TF32 switch and the profile's record."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlflow.graph import load_onnx
from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff
from rlflow.graph.exec.numerics import strict_fp32
from rlflow.graph.fold import fold_constants


def test_strict_fp32_turns_tf32_off_and_restores_it():
    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    before = [f.allow_tf32 for f in flags]
    try:
        for f in flags:
            f.allow_tf32 = True
        with strict_fp32():
            assert [f.allow_tf32 for f in flags] == [False, False]
        assert [f.allow_tf32 for f in flags] == [True, True]
        with pytest.raises(ValueError), strict_fp32():
            raise ValueError("restored on errors too")
        assert [f.allow_tf32 for f in flags] == [True, True]
    finally:
        for f, b in zip(flags, before):
            f.allow_tf32 = b


def test_profile_graph_records_every_node_on_the_cpu(tiny_zoo):
    from rlflow.cost.gpu_profile import profile_graph

    g = fold_constants(load_onnx(tiny_zoo["bert"]))
    rec = profile_graph(g, "cpu", runs=3, profiled=1, warmup=1)
    assert rec["device"] == "cpu" and len(rec["e2e_ms"]) == 3 and all(t > 0 for t in rec["e2e_ms"])
    assert [n["op"] for n in rec["nodes"]] == [n.op for n in g.nodes]
    assert all(n["host_us"] > 0 and n["device_us"] == 0 and n["kernels"] == 0 for n in rec["nodes"])
    assert sum(n["flops"] for n in rec["nodes"] if n["op"] == "MatMul") > 0


def test_busy_is_the_union_of_intervals():
    from rlflow.cost.gpu_profile import _busy

    assert _busy([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0)]) == (5.0, 7.0)
    assert _busy([]) == (0.0, 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["bert", "resnet18", "inceptionv3"])
def test_torch_on_cuda_computes_what_onnxruntime_does(tiny_zoo, model):
    """The torch backend on the GPU, with TF32 off, within evaluate's default tolerance of onnxruntime (CPU)."""
    g = load_onnx(tiny_zoo[model])
    feeds = make_inputs(g, 0)
    want = get_runner(g, "ort", "cpu")(feeds)
    with strict_fp32():
        got = get_runner(g, "torch", "cuda")(feeds)
    assert max_rel_diff(want, got) <= 1e-4


@pytest.mark.gpu
def test_cudnn_convolution_in_tf32_needs_the_switch():
    """What the switch is for: a convolution on the GPU is float32-accurate inside strict_fp32."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((1, 64, 32, 32)).astype(np.float32))
    w = torch.from_numpy(rng.standard_normal((64, 64, 3, 3)).astype(np.float32))
    ref = torch.nn.functional.conv2d(x.double(), w.double(), padding=1)
    with strict_fp32():
        y = torch.nn.functional.conv2d(x.cuda(), w.cuda(), padding=1).cpu().double()
    assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.gpu
def test_profile_graph_on_cuda_sees_the_kernels(tiny_zoo):
    from rlflow.cost.gpu_profile import profile_graph

    g = fold_constants(load_onnx(tiny_zoo["bert"]))
    rec = profile_graph(g, "cuda", runs=5, profiled=2, warmup=2)
    matmuls = [n for n in rec["nodes"] if n["op"] == "MatMul"]
    assert matmuls and all(n["kernels"] >= 1 and n["device_us"] > 0 for n in matmuls)
    assert all(0 < b <= s for b, s in zip(rec["gpu_busy_ms"], rec["gpu_span_ms"]))


@pytest.mark.gpu
def test_evaluate_records_the_device_each_backend_ran_on(tiny_zoo):
    from rlflow.evaluation.runs import first_run, runner_device

    g = load_onnx(tiny_zoo["bert"])
    runner, outputs, peak = first_run(g, "torch", "cuda", make_inputs(g, 0))
    assert runner_device(runner) == ("cuda", "") and peak and peak > 0


def test_combine_pools_runs_and_takes_each_nodes_median():
    from rlflow.cost.gpu_profile import combine

    rec = lambda h, e: {"device": "cuda", "e2e_ms": [e], "gpu_busy_ms": [1.0], "gpu_span_ms": [2.0],  # noqa: E731
                        "nodes": [{"op": "Add", "sig": "s", "flops": 1.0, "bytes": 2.0, "host_us": h,
                                   "device_us": h / 10, "kernels": 1}]}
    out = combine([rec(10.0, 1.0), rec(30.0, 3.0), rec(20.0, 2.0)])
    assert out["e2e_ms"] == [1.0, 3.0, 2.0] and out["rounds"] == 3 and len(out["gpu_busy_ms"]) == 3
    assert out["nodes"][0]["host_us"] == 20.0 and out["nodes"][0]["device_us"] == 2.0
    assert out["nodes"][0]["op"] == "Add" and out["nodes"][0]["kernels"] == 1


@pytest.mark.slow
def test_the_learning_stages_part_times_each_stage_and_its_phases(tmp_path):
    """benchmarks/gpu_pipeline.py --parts stages (gpu_check's `stages`), at tiny size on the CPU: what the learning
    stages read is built first, then the stages in one snakemake call (--together, as gpu_check runs them); every
    stage has its wall time from its benchmark file and the two agents their phases (the figures a GPU check
    brings back)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    out = tmp_path / "stages.json"
    r = subprocess.run([sys.executable, str(root / "benchmarks/gpu_pipeline.py"), "--parts", "stages", "--device", "cpu",
                        "--size", "tiny", "--together", "--cores", "2", "--out", str(out), "--keep", str(tmp_path / "work")],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    doc = json.loads(out.read_text())["stages"]
    assert doc["size"] == "tiny" and doc["upstream"]["exit_code"] == 0
    assert list(doc["stages"]) == ["train_encoder", "train_world_model", "train_controller", "train_model_free"]
    for name, row in doc["stages"].items():
        assert row["exit_code"] == 0 and row["stage_seconds"] > 0, name
    for name in ("train_controller", "train_model_free"):
        phases = doc["stages"][name]["phase_seconds"]
        assert set(phases) == {"setup", "training", "optimisation", "checks"} and min(phases.values()) >= 0
