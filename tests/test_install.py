"""`pip install .` into a clean venv (torch first, as the docs say), then `rlflow optimize` and `rlflow.optimize`
on an ONNX file made here, in a folder holding nothing else: the package needs no checkout, no pipeline output
and no undeclared dependency. The rewrite environment and the agents' encoder import too.

It installs about 40 packages, so it is marked ``install`` and skipped unless pytest gets ``--run-install``
(`make test-install`); tests/test_packaging.py checks the declarations on every run. TORCH_INDEX in the
environment is passed to pip for torch (e.g. PyTorch's CPU index)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

import onnx_models
from rlflow.rewrite import load_rules

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.install


def _run(argv, cwd=None, timeout=900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # nothing of this checkout
    r = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{argv[:4]}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def test_clean_venv_install_optimises_a_model_with_no_other_file(tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    pip = [venv / "bin/python", "-m", "pip", "install", "-q"]
    index = os.environ.get("TORCH_INDEX")
    _run(pip + ["torch==2.13.0"] + (["--index-url", index] if index else []))
    _run(pip + [ROOT])  # a regular (not editable) install: the package data must travel with it
    work = tmp_path / "work"
    work.mkdir()
    onnx.save(onnx_models.shared_input_mlp(), work / "model.onnx")

    r = _run([venv / "bin/rlflow", "optimize", "model.onnx", "--out", "fast.onnx", "--set", "timing.budget_s=2",
              "--no-progress"], cwd=work)
    n = len(load_rules())  # the shipped rule set, read from this checkout
    assert "wrote fast.onnx" in r.stdout and f"{n} of {n} rules" in r.stdout

    script = ("import rlflow\n"
              "fast = rlflow.optimize('model.onnx', target='sim-h100')\n"
              "rlflow.save(fast, 'api.onnx')\n"
              "print(*(rlflow.estimate_cost(m, target='sim-h100')['launches'] for m in ('model.onnx', fast)))\n"
              "import gymnasium, rlflow.nn.encoder\n"
              "env = gymnasium.make('rlflow/GraphRewrite-v0')\n"
              "print(type(env.reset(seed=0)[0]).__name__)\n")
    r = _run([venv / "bin/python", "-c", script], cwd=work)
    before, after = map(int, r.stdout.splitlines()[0].split())
    assert (before, after) == (5, 4) and (work / "api.onnx").is_file()  # the two MatMuls merged
    assert r.stdout.splitlines()[1] == "dict"
    assert sorted(p.name for p in work.iterdir()) == ["api.onnx", "fast.onnx", "model.onnx"]
