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
