"""The pin list behind `make gpu-wheels` (envs/gpu-check-wheels.txt) is well formed. CPU only, no network."""

from __future__ import annotations

import re
from pathlib import Path

PINS = Path(__file__).resolve().parent.parent / "envs" / "gpu-check-wheels.txt"
# the lent GPU machine's image brings these (or they are far too big to carry): never in the wheel folder
FORBIDDEN = {"torch", "tensorflow", "tensorflow-cpu", "jax", "jaxlib", "onnxruntime"}
PIN = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> list[str]:
    lines = [line.split("#", 1)[0].strip() for line in PINS.read_text().splitlines()]
    return [line for line in lines if line]


def test_every_line_is_name_equals_version():
    pins = _pins()
    assert pins, "the pin list is empty"
    bad = [p for p in pins if not PIN.match(p)]
    assert not bad, f"not name==version: {bad}"


def test_one_version_per_package():
    names = [_norm(p.split("==")[0]) for p in _pins()]
    dupes = sorted({n for n in names if names.count(n) > 1})
    assert not dupes, f"listed more than once: {dupes}"


def test_no_image_side_giants():
    names = {_norm(p.split("==")[0]) for p in _pins()}
    assert not names & FORBIDDEN, f"must not be carried: {sorted(names & FORBIDDEN)}"
    assert not any(n.startswith("nvidia-") for n in names), "CUDA libraries come with the image"


def test_the_pipeline_entry_points_are_listed():
    names = {_norm(p.split("==")[0]) for p in _pins()}
    assert {"snakemake", "dvc", "dvclive", "jsonschema", "gymnasium"} <= names


def _fake_wheels(folder: Path, skip: str | None = None) -> None:
    folder.mkdir()
    for pin in _pins():
        name, version = pin.split("==")
        if name != skip:
            (folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"")


def test_gpu_check_dry_run_checks_the_wheel_folder_and_prints_the_commands(tmp_path):
    """benchmarks/gpu_check.sh --dry-run: the wheel folder against the pin list, each part's --help, the commands."""
    import subprocess
    import sys

    root = PINS.parent.parent
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "GPU_CHECK_WHEELS": str(tmp_path / "whl"),
           "PYTHON": sys.executable, "HOME": str(tmp_path)}
    _fake_wheels(tmp_path / "whl")
    run = lambda *a: subprocess.run(["bash", str(root / "benchmarks/gpu_check.sh"), "--dry-run", "--out",  # noqa: E731
                                     str(tmp_path / "out"), *a], env=env, capture_output=True, text=True, timeout=300)
    r = run("--parts", "agents,pipeline,evaluate,tests")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"holds the {len(_pins())} pinned wheels" in r.stdout
    for part in ("agents", "pipeline", "evaluate", "tests"):
        assert f"would run [{part}]" in r.stdout
    assert "would run [calibrate]" not in r.stdout
    assert "would run [fused]" not in r.stdout  # only when named
    r = run("--parts", "fused")
    assert r.returncode == 0 and "would run [fused]" in r.stdout and "fused_protocol.py --device cuda" in r.stdout
    missing = _pins()[0].split("==")[0]
    _fake_wheels(tmp_path / "whl3", skip=missing)
    env["GPU_CHECK_WHEELS"] = str(tmp_path / "whl3")
    r = run("--parts", "tests")
    assert r.returncode == 2 and "does not match envs/gpu-check-wheels.txt" in r.stdout + r.stderr
