"""One resolved platform per run (rlflow.cost.platform): the target, and the backend and device that verify it;
the search stages gate on it, keep what a target this machine cannot verify found, and refuse old caches."""

from __future__ import annotations

import json

import numpy as np
import pytest

import rlflow.evaluation.protocol as protocol
from rlflow.cli import main
from rlflow.config import load_config
from rlflow.cost import make_cost_model
from rlflow.cost.platform import NOT_VERIFIABLE, resolve_platform
from rlflow.cost.targets import CHOICES
from rlflow.errors import RLFlowError
from rlflow.graph import load_onnx
from rlflow.graph.builder import GraphBuilder
from rlflow.graph.onnx_io import save_onnx
from rlflow.rewrite.builtin import builtin_rules
from rlflow.rewrite.rule import rules_document


def adds_graph():
    """x + c1 + c2: add-const-fold makes it x + (c1 + c2), one kernel fewer on every target."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("adds")
    x = b.input("x", (1, 64))
    c1, c2 = (b.const(n, rng.standard_normal((1, 64)).astype(np.float32)) for n in ("c1", "c2"))
    return b.build([b.op("Add", [b.op("Add", [x, c1]), c2])])


@pytest.fixture
def problem(tmp_path):
    onnx, rules = tmp_path / "adds.onnx", tmp_path / "rules.json"
    save_onnx(adds_graph(), onnx)
    rules.write_text(json.dumps(rules_document([r for r, _ in builtin_rules()], {})))
    return onnx, rules


def no_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def search(problem, tmp_path, *sets: str, costs=None) -> list[str]:
    onnx, rules = problem
    return ["search-greedy", "--model", "adds", "--onnx", str(onnx), "--rules", str(rules),
            "--costs", str(costs or tmp_path / "no-cache.json"), "--set", "device=cpu",
            "--set", "timing.budget_s=0.5", "--set", "timing.sessions=2", *(f"--set={s}" for s in sets),
            "--out", str(tmp_path / "out.onnx"), "--trace", str(tmp_path / "trace.json"), "--no-progress"]


def config(*sets: str) -> dict:
    return load_config(None, ["device=cpu", *sets])


# ------------------------------------------------------------------ resolution
def test_resolved_values_are_never_auto_and_follow_the_machine(monkeypatch):
    no_gpu(monkeypatch)
    for choice in CHOICES:
        p = resolve_platform(config(), choice).as_dict()
        assert set(p) == {"target", "label", "device", "backend", "verifiable"}
        assert p["target"] not in ("auto", "machine") and "auto" not in (p["device"], p["backend"])
        assert p["verifiable"] == (p["backend"] is not None)
    cpu_box = {t: resolve_platform(config(), t) for t in ("auto", "machine", "ort-cpu", "torch-eager", "sim-h100")}
    assert cpu_box["auto"].target == "sim-h100" and cpu_box["machine"].target == "ort-cpu"
    assert (cpu_box["ort-cpu"].backend, cpu_box["ort-cpu"].device) == ("ort", "cpu")
    assert (cpu_box["torch-eager"].backend, cpu_box["torch-eager"].device) == ("torch", "cpu")
    h100 = cpu_box["sim-h100"]
    assert (h100.label, h100.device, h100.backend, h100.verifiable) == ("simulated H100", "cuda", None, False)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the same config on a GPU box
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")  # (no calibration file)
    gpu_box = resolve_platform(config())
    assert (gpu_box.target, gpu_box.backend, gpu_box.device, gpu_box.verifiable) == ("cuda", "torch", "cuda", True)
    assert resolve_platform(config(), "sim-h100").backend == "torch"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")  # a GPU with a calibration file
    h200 = resolve_platform(config())
    assert (h200.target, h200.label, h200.backend, h200.verifiable) == ("sim-h200", "calibrated H200", "torch", True)


# ------------------------------------------------------------------ the gate follows the platform
def test_sim_target_on_a_cpu_box_is_not_gated_and_the_found_graph_is_written(problem, tmp_path, monkeypatch,
                                                                                 capsys):
    no_gpu(monkeypatch)
    timed = []
    real_compare = protocol.compare
    monkeypatch.setattr(protocol, "compare", lambda *a, **kw: timed.append(a) or real_compare(*a, **kw))
    assert main(search(problem, tmp_path, "cost.target=sim-h100")) == 0
    out = capsys.readouterr().out
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert not timed  # nothing was timed: no backend here can verify a simulated H100
    check = trace["speed_check"]
    assert check["kept"] == "optimised" and check["not_verifiable"] and check["backend"] is None
    assert NOT_VERIFIABLE in check["line"] and check["line"] in out
    assert trace["platform"] == {"target": "sim-h100", "label": "simulated H100", "device": "cuda",
                                 "backend": None, "verifiable": False}
    assert trace["config"]["timing.check_backend"] is None
    written, original = load_onnx(tmp_path / "out.onnx"), load_onnx(problem[0])
    assert [n.op for n in original.nodes] == ["Add", "Add"] and [n.op for n in written.nodes] == ["Add"]


def test_cpu_targets_gate_on_their_own_backend(problem, tmp_path, monkeypatch):
    no_gpu(monkeypatch)
    runners = []
    real = protocol.backend_runner
    monkeypatch.setattr(protocol, "backend_runner", lambda b, d: runners.append((b, d)) or real(b, d))
    assert main(search(problem, tmp_path, "cost.target=ort-cpu")) == 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert runners == [("ort", "cpu")]
    assert trace["speed_check"]["backend"] == "ort" and trace["speed_check"]["verdict"] is not None
    assert trace["platform"]["target"] == "ort-cpu" and trace["config"]["timing.check_backend"] == "ort"
    # torch-eager: torch on the CPU
    runners.clear()
    assert main(search(problem, tmp_path, "cost.target=torch-eager")) == 0
    assert runners == [("torch", "cpu")]
    # a backend named in the config wins over the platform's
    runners.clear()
    assert main(search(problem, tmp_path, "cost.target=ort-cpu", "timing.check_backend=torch")) == 0
    assert runners == [("torch", "cpu")]


@pytest.mark.gpu
@pytest.mark.parametrize("target", ["cuda", "sim-h100", "auto"])
def test_gpu_targets_on_a_gpu_box_gate_on_torch_cuda(target, monkeypatch):
    from rlflow.stages.search_common import never_slower_check

    runners = []
    real = protocol.backend_runner
    monkeypatch.setattr(protocol, "backend_runner", lambda b, d: runners.append((b, d)) or real(b, d))
    cfg = load_config(None, [f"cost.target={target}", "timing.budget_s=0.5", "timing.sessions=2"])
    g = adds_graph()
    from rlflow.rewrite.builtin import builtin_rules as rules
    from rlflow.search.greedy import greedy_search

    found = greedy_search(g, [r for r, _ in rules()], make_cost_model(cfg, "cuda")).graph
    record = never_slower_check(cfg)(g, found)
    assert runners == [("torch", "cuda")] and record["backend"] == "torch" and record["verdict"] is not None


def test_e2e_reward_follows_the_platform_or_says_why_it_cannot(monkeypatch):
    no_gpu(monkeypatch)
    from rlflow.cost.platform import resolved_reward
    from rlflow.stages.search_common import e2e_meter

    cfg = config("cost.target=ort-cpu", "env.reward.name=e2e")
    assert resolved_reward(cfg, resolve_platform(cfg))["e2e_backend"] == "ort"
    sim = config("cost.target=sim-h100", "env.reward.name=e2e")
    with pytest.raises(RLFlowError, match="cannot be measured on this machine"):
        e2e_meter(sim)
    assert callable(e2e_meter(config("cost.target=sim-h100", "env.reward.e2e_backend=ort")))


# ------------------------------------------------------------------ caches
def test_measure_costs_records_the_platform_and_a_search_reads_it(problem, tmp_path, monkeypatch):
    no_gpu(monkeypatch)
    onnx, rules = problem
    costs = tmp_path / "costs.json"
    assert main(["measure-costs", "--model", "adds", "--onnx", str(onnx), "--rules", str(rules), "--set", "device=cpu",
                 "--set", "cost.target=sim-h100", "--out", str(costs), "--no-progress"]) == 0
    cfg = config("cost.target=sim-h100")
    assert json.loads(costs.read_text())["platform"] == resolve_platform(cfg).as_dict()
    assert make_cost_model(cfg, "cpu", costs).name == "sim-h100"
    # the same cache on a GPU box (where sim-h100 is verified on torch/cuda) is refused, not reused
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RLFlowError, match="made for target sim-h100 \\(not verifiable there\\).*rlflow measure-costs"):
        make_cost_model(cfg, "cpu", costs)


def test_a_cache_made_before_the_platform_record_is_refused_in_one_line(problem, tmp_path, monkeypatch, capsys):
    no_gpu(monkeypatch)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "rlflow.costs/1", "device": "cpu", "target": "sim-h100", "ops": {}}))
    code = main(search(problem, tmp_path, "cost.target=sim-h100", costs=old))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("rlflow: error: ")
    assert "made before caches recorded their platform" in err and "rlflow measure-costs" in err
    assert not (tmp_path / "out.onnx").exists()


def test_a_trace_made_before_the_platform_record_is_refused_in_one_line(tmp_path):
    from rlflow.evaluation import load_trace

    old = tmp_path / "trace.json"
    old.write_text(json.dumps({"format": "rlflow.search-trace/1", "method": "eqsat", "steps": []}))
    with pytest.raises(RLFlowError, match="made before traces recorded their platform.*`rlflow search-eqsat`") as e:
        load_trace(old)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ rlflow optimize
def test_optimize_defaults_to_eqsat_on_the_machine_target_and_prints_it(problem, tmp_path, monkeypatch, capsys):
    no_gpu(monkeypatch)
    onnx, rules = problem
    out, trace = tmp_path / "o.onnx", tmp_path / "t.json"
    runners = []
    real = protocol.backend_runner
    monkeypatch.setattr(protocol, "backend_runner", lambda b, d: runners.append((b, d)) or real(b, d))
    assert main(["optimize", str(onnx), "--out", str(out), "--rules", str(rules), "--trace", str(trace),
                 "--no-progress", "--set", "timing.budget_s=0.5", "--set", "timing.sessions=2",
                 "--set", "eqsat.extraction=greedy"]) == 0
    text = capsys.readouterr().out
    doc = json.loads(trace.read_text())
    assert ("target ort-cpu (onnxruntime CPU (kernels timed)) on cpu; never-slower check: ort"
            in text.splitlines())
    assert doc["method"] == "eqsat" and doc["platform"]["target"] == "ort-cpu"
    assert runners == [("ort", "cpu")] and doc["speed_check"]["backend"] == "ort"


def test_device_auto_without_a_gpu_driver_does_not_import_torch(tmp_path):
    """Each pipeline stage resolves ``device: auto``: where no GPU driver's device file exists the answer is cpu
    without importing torch (seconds per stage); where one exists, torch is asked. ``device: cuda`` without a
    driver stays a one-line error."""
    import subprocess
    import sys

    code = ("import sys, rlflow.config as c; c.GPU_DEVICE_FILES = ({!r},); print(c.resolve_device({{'device': "
            "'auto'}}), 'torch' in sys.modules); c.resolve_device({{'device': 'cuda'}})")
    for path, want in ((tmp_path / "none", "cpu False"), (tmp_path, "cpu True")):  # tmp_path exists: torch asked
        r = subprocess.run([sys.executable, "-c", code.format(str(path))], capture_output=True, text=True)
        assert r.stdout.split("\n")[0] == want, r.stdout + r.stderr
        assert r.returncode == 1 and "'cuda' but torch sees no CUDA device" in r.stderr, r.stderr
