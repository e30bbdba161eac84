import gc
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(autouse=True)
def _gc_skips_what_the_test_found():
    """Everything alive when a test starts (torch, TensorFlow, onnxruntime, the session's fixtures: about a
    million objects) is frozen for the test (gc.freeze), so a collection walks only what the test made. The
    measurement protocol runs a full gc.collect() after every session, which took 0.5-1.3 s each in the suite's
    process, several minutes in all; collecting the test's own objects, runners included, is unchanged. gc.unfreeze
    at the end hands the frozen objects back to the collector (garbage among them is collected later)."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


def run_folder(tmp_path_factory) -> Path:
    """The temporary folder of this pytest run that all its pytest-xdist workers share (each worker's base
    folder is a subfolder of it); without xdist, the run's own base folder."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory) -> dict:
    """Every zoo model at its tiny size (the default dynamo exporter, opset 18), each in a folder of its own
    (tests/test_zoo.py checks the export leaves nothing beside it): name -> ONNX path. Exported once per test
    run, shared by the pytest-xdist workers: each model has its own lock, and a worker first exports every model
    no other worker is exporting, then waits for the rest, so two workers export the nine models together (one
    worker alone took about 50 s while the other waited). Tests only read these files."""
    import fcntl

    from rlflow.graph import zoo

    shared = run_folder(tmp_path_factory) / "tiny-zoo"
    shared.mkdir(exist_ok=True)
    paths = {name: shared / name / f"{name}.onnx" for name in zoo.MODEL_NAMES}

    def export(name: str, wait: bool) -> bool:
        """Export ``name`` unless done; False if another worker holds its lock and ``wait`` is false."""
        with open(shared / f"{name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))  # released when the file closes
            except BlockingIOError:
                return False
            done = shared / f"{name}.done"
            if not done.is_file():
                paths[name].parent.mkdir(exist_ok=True)
                zoo.export_model(name, paths[name], zoo.TINY_SIZES[name])
                done.touch()
            return True

    busy = [name for name in paths if not export(name, wait=False)]
    for name in busy:
        export(name, wait=True)
    return paths


@pytest.fixture(scope="session")
def fresh_rules_file(tmp_path_factory) -> Path:
    """The rules file the pipeline's generate_rules stage makes with the default config now (config.yaml: TASO's
    3-operator enumeration plus the builtin rules; about a minute)."""
    from rlflow.cli import main

    out = tmp_path_factory.mktemp("rules") / "rules.json"
    code = main(["generate-rules", "--config", str(ROOT / "config.yaml"), "--out", str(out), "--no-progress"])
    assert code == 0 and out.is_file()
    return out


@pytest.fixture(scope="session")
def rules_file(tmp_path_factory) -> Path:
    """The default rule set as a rules file: the one shipped as package data, which
    test_shipped_rule_set_is_a_fresh_generation keeps byte for byte equal to :func:`fresh_rules_file` (so the
    tests read what generate_rules makes without generating it once per test worker)."""
    import gzip

    from rlflow.rewrite.rule import DEFAULT_RULES

    out = tmp_path_factory.mktemp("rules") / "rules.json"
    out.write_bytes(gzip.decompress(DEFAULT_RULES.read_bytes()))
    return out


def pytest_addoption(parser):
    parser.addoption("--run-install", action="store_true",
                     help="also run the tests marked install (a clean venv and pip install .: make test-install)")
    parser.addoption("--run-cluster", action="store_true",
                     help="also run the tests marked cluster (a SLURM cluster on this machine: make test-cluster)")


#: opt-in tests: marker -> (the option that runs them, why they are skipped without it)
OPT_IN = {"install": ("--run-install", "installs into a clean venv: run with --run-install (make test-install)"),
          "cluster": ("--run-cluster", "starts a SLURM cluster on this machine (system packages, minutes): run with "
                                       "--run-cluster (make test-cluster)")}


def pytest_collection_modifyitems(config, items):
    if any(item.get_closest_marker("gpu") for item in items):
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA GPU (benchmarks/gpu_check.sh runs these on one)")
            for item in items:
                if item.get_closest_marker("gpu"):
                    item.add_marker(skip)
    for marker, (option, reason) in OPT_IN.items():
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if item.get_closest_marker(marker):
                item.add_marker(skip)
