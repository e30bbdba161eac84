import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def tiny_zoo(tmp_path_factory) -> dict:
    """Every zoo model at its tiny size, exported once per test session: name -> ONNX path."""
    from rlflow.graph import zoo

    folder = tmp_path_factory.mktemp("tiny-zoo")
    paths = {}
    for name in zoo.MODEL_NAMES:
        paths[name] = folder / f"{name}.onnx"
        zoo.export_model(name, paths[name], zoo.TINY_SIZES[name])
    return paths


@pytest.fixture(scope="session")
def rules_file(tmp_path_factory) -> Path:
    """The rules file the pipeline's generate_rules stage makes with the default config (config.yaml: TASO's
    3-operator enumeration plus the builtin rules; about 30 s), made once per test session."""
    from rlflow.cli import main

    out = tmp_path_factory.mktemp("rules") / "rules.json"
    code = main(["generate-rules", "--config", str(ROOT / "config.yaml"), "--out", str(out), "--no-progress"])
    assert code == 0 and out.is_file()
    return out
