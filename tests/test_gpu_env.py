"""The GPU box's environment, checked on the CPU: the GPU requirement lists, and every executor's record of the
device it actually ran on (a backend that cannot reach the GPU is a labelled row, never a silent CPU run)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from rlflow.graph.builder import GraphBuilder
from rlflow.graph.exec import get_runner, make_inputs

ROOT = Path(__file__).resolve().parents[1]


def _pins(name: str) -> dict[str, str]:
    """package name (extras dropped) -> its line, of envs/<name>."""
    out = {}
    for line in (ROOT / "envs" / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            out[re.split(r"[\[<>=~ ;]", line, maxsplit=1)[0].lower()] = line
    return out


# ------------------------------------------------------------------ the requirement lists
def test_gpu_lists_are_the_cpu_list_with_the_cuda_builds_swapped_in():
    """requirements-gpu.txt and requirements-tensorflow-gpu.txt are requirements.txt with only the named packages
    swapped (so a pin bumped in one list and not the others fails here); nothing in them names torch, so pip
    never resolves it (the Makefile installs torch==2.13.0 first)."""
    cpu, gpu, tf = _pins("requirements.txt"), _pins("requirements-gpu.txt"), _pins("requirements-tensorflow-gpu.txt")
    assert {k: v for k, v in gpu.items() if k not in ("onnxruntime-gpu", "jax")} == {
        k: v for k, v in cpu.items() if k not in ("onnxruntime", "jax")}
    assert (gpu["onnxruntime-gpu"], gpu["jax"]) == ("onnxruntime-gpu[cuda,cudnn]==1.31.1", "jax[cuda13]==0.10.2")
    assert cpu["onnxruntime"].endswith("==1.31.1") and cpu["jax"] == "jax==0.10.2"  # the same versions as on the CPU
    assert {k: v for k, v in tf.items() if k != "tensorflow"} == {k: v for k, v in cpu.items() if k != "tensorflow-cpu"}
    assert tf["tensorflow"] == "tensorflow[and-cuda]==2.21.0" and cpu["tensorflow-cpu"] == "tensorflow-cpu==2.21.0"
    for pins in (gpu, tf):
        assert "torch" not in pins and all("==" in v or ">=" in v for v in pins.values())


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_makefile_installs_torch_first_in_each_gpu_env(tmp_path):
    """`make -n` (prints the commands, runs none) of each GPU setup into a fresh venv path: torch==2.13.0 in its
    own pip call before the requirement list, then rlflow without dependencies."""
    for target, reqs in (("setup-gpu", "requirements-gpu.txt"), ("setup-tf-gpu", "requirements-tensorflow-gpu.txt")):
        r = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'v'}"], cwd=ROOT, capture_output=True,
                           text=True, check=True)
        if target == "setup-tf-gpu" and "requirements-tensorflow-gpu.txt" not in r.stdout:
            pytest.skip(".venv-tf is set up here already")  # make prints nothing to do
        lines = r.stdout.splitlines()
        torch = next(i for i, s in enumerate(lines) if "pip install torch==2.13.0" in s)
        req = next(i for i, s in enumerate(lines) if f"-r envs/{reqs}" in s)
        assert torch < req < next(i for i, s in enumerate(lines) if "--no-deps -e ." in s), target


# ------------------------------------------------------------------ where each executor ran
def _graph():
    b = GraphBuilder("mm")
    x = b.input("x", (2, 8))
    y = b.op("Relu", [b.op("MatMul", [x, b.const("w", np.ones((8, 4), np.float32))])])
    return b.build([y])


BACKENDS = ["ort", "torch", "jax", pytest.param("tf", marks=pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="tensorflow is not installed"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_executor_records_the_device_it_ran_on(backend):
    g = _graph()
    runner = get_runner(g, backend, "cpu")
    assert (runner.ran_on, runner.device_note) == ("cpu", "")
    assert runner(make_inputs(g))[0].shape == (2, 4)


@pytest.mark.parametrize("backend", ["ort", "jax", pytest.param("tf", marks=pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="tensorflow is not installed"))])
def test_an_executor_without_the_gpu_says_so(backend):
    """Asked for cuda, a backend that cannot reach a GPU runs on the CPU and says why (here: this box's
    onnxruntime is the CPU build, TensorFlow sees no GPU, jax runs on XLA CPU)."""
    import onnxruntime as ort

    if backend == "ort" and "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    if backend == "tf":
        from rlflow.graph.exec.tf_exec import _tf

        if _tf().config.list_physical_devices("GPU"):
            pytest.skip("TensorFlow sees a GPU")
    runner = get_runner(_graph(), backend, "cuda")
    assert runner.ran_on == "cpu"
    assert {"ort": "no CUDA provider in this onnxruntime", "tf": "sees no GPU",
            "jax": "XLA CPU"}[backend] in runner.device_note
    if backend == "ort":
        assert runner.providers == ["CPUExecutionProvider"]


def test_ort_records_the_provider_the_session_took(monkeypatch):
    """Where onnxruntime lists the CUDA provider but the session does not take it, the runner says cpu."""
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    asked = []
    real = ort.InferenceSession

    def session(model, opts, providers):
        asked.append(providers)
        return real(model, opts, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(ort, "InferenceSession", session)
    runner = get_runner(_graph(), "ort", "cuda")
    assert asked == [["CUDAExecutionProvider", "CPUExecutionProvider"]]
    assert (runner.ran_on, runner.device_note) == ("cpu", "onnxruntime could not start its CUDA provider")


def test_evaluate_rows_on_a_gpu_run_name_the_device_and_why(monkeypatch):
    """A GPU run whose onnxruntime is the CPU build: the rows say device cpu with the note, and the log says it once."""
    import onnxruntime as ort

    from rlflow.evaluation import evaluate_graphs, make_rows
    from rlflow.evaluation.protocol import Protocol

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    g = _graph()
    lines = []
    res = evaluate_graphs([("original", g), ("greedy", g.copy())], ["ort"], "cuda",
                          Protocol(sessions=2, warmup=1, budget_s=5.0, min_rounds=3, max_rounds=3), aa=False,
                          progress=False, log=lines.append)
    assert all(r.device == "cpu" and "no CUDA provider" in r.device_note for r in res)
    warned = [s for s in lines if "runs on cpu, not cuda" in s]
    assert len(warned) == 1 and "no CUDA provider in this onnxruntime" in warned[0]
    rows = make_rows("m", "cuda", res, nodes={"original": 2, "greedy": 2},
                     activation_bytes={"original": 0, "greedy": 0}, traces={})
    assert [(r["device"], "no CUDA provider" in r["device_note"]) for r in rows] == [("cpu", True)] * 2


# ------------------------------------------------------------------ TensorFlow on a GPU, simulated
class _FakeTF:
    """The part of TensorFlow's config API the tf backend touches, on a box with one GPU."""

    def __init__(self):
        self.tf32, self.growth = True, []
        exp = type("exp", (), {})()
        exp.set_memory_growth = lambda gpu, on: self.growth.append((gpu, on))
        exp.tensor_float_32_execution_enabled = lambda: self.tf32
        exp.enable_tensor_float_32_execution = lambda on: setattr(self, "tf32", on)
        self.config = type("config", (), {})()
        self.config.list_physical_devices = lambda kind: ["GPU:0"] if kind == "GPU" else []
        self.config.experimental = exp


def test_tf_memory_growth_is_set_once_per_process(monkeypatch):
    import rlflow.graph.exec.tf_exec as tf_exec

    monkeypatch.setattr(tf_exec, "_GROWING", False)
    fake = _FakeTF()
    assert tf_exec._grow_memory(fake) is fake and tf_exec._grow_memory(fake) is fake
    assert fake.growth == [("GPU:0", True)]


def test_tf_output_check_runs_without_tf32_and_timings_keep_it(monkeypatch):
    """evaluate's first run (the output check) of a tf runner on cuda sees TF32 off; it is on again after."""
    import rlflow.evaluation.runs as runs
    import rlflow.graph.exec.tf_exec as tf_exec

    fake = _FakeTF()
    monkeypatch.setattr(tf_exec, "_tf", lambda: fake)
    seen = []

    def runner(feeds):
        seen.append(fake.tf32)
        return [np.zeros(1)]

    monkeypatch.setattr(runs, "_gpu_memory", lambda backend: None)
    monkeypatch.setattr(runs, "new_runner", lambda g, backend, device, fresh=None: runner)
    for backend in ("tf", "tf-xla", "ort"):
        runs.first_run(_graph(), backend, "cuda", {})
    runs.first_run(_graph(), "tf", "cpu", {})
    assert seen == [False, False, True, True] and fake.tf32


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_executor_on_a_gpu_runs_there_or_says_why(backend):
    """On a GPU box: torch runs on cuda; onnxruntime and TensorFlow run there where their build can (else their
    note says why); jax says it runs on XLA CPU. Outputs match the CPU run of the same backend."""
    g = _graph()
    feeds = make_inputs(g)
    runner = get_runner(g, backend, "cuda")
    assert (runner.ran_on == "cuda") == (runner.device_note == ""), runner.device_note
    if backend == "torch":
        assert runner.ran_on == "cuda"
    if backend == "ort":
        import onnxruntime as ort

        has = "CUDAExecutionProvider" in ort.get_available_providers()
        assert runner.ran_on == ("cuda" if has else "cpu") and runner.providers[0] == (
            "CUDAExecutionProvider" if has else "CPUExecutionProvider")
    from rlflow.graph.exec import max_rel_diff

    assert max_rel_diff(get_runner(g, backend, "cpu")(feeds), runner(feeds)) <= 1e-2  # TF32 where it is on


def test_the_never_slower_check_names_where_its_runners_ran():
    """The gate's trace record says where the backend ran and why not on the asked device (here: onnxruntime's CPU
    build asked for cuda); on the asked device the line stays as it was."""
    import onnxruntime as ort

    from rlflow.evaluation.protocol import Protocol, speed_check

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    g = _graph()
    p = Protocol(sessions=2, warmup=1, budget_s=2.0, min_rounds=3, max_rounds=3)
    rec = speed_check(g, g.copy(), "ort", "cuda", make_inputs(g), p)
    assert rec["device"] == "cpu" and "no CUDA provider in this onnxruntime" in rec["device_note"]
    assert rec["line"].endswith("on ort (on cpu: " + rec["device_note"] + ")")
    here = speed_check(g, g.copy(), "ort", "cpu", make_inputs(g), p)
    assert (here["device"], here["device_note"]) == ("cpu", "") and here["line"].endswith(" on ort")
