"""The package on its own: every third-party module the code imports is declared in pyproject.toml (core, or the
optional group rlflow.cli names for it), the pinned requirements name nothing undeclared, a missing optional
module is a one-line error naming its group, and the files a release needs are there. The install itself into a
clean venv is tests/test_install.py (`make test-install`)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from rlflow.cli import OPTIONAL_MODULES, main

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement line (``xla-cpu-pjrt>=0.0.1`` -> xla-cpu-pjrt)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement.strip()).group(0)).lower()


def _imported_modules() -> dict[str, list[str]]:
    """Top-level third-party modules imported anywhere in src/rlflow -> the files importing them."""
    found: dict[str, list[str]] = {}
    for f in sorted((ROOT / "src/rlflow").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"rlflow"}:
                found.setdefault(top, []).append(str(f.relative_to(ROOT)))
    return found


def test_every_imported_module_is_declared_in_its_group():
    core = {_name(r) for r in PYPROJECT["dependencies"]}
    extras = {group: {_name(r) for r in reqs} for group, reqs in PYPROJECT["optional-dependencies"].items()}
    dists = importlib.metadata.packages_distributions()
    imported = _imported_modules()
    assert {"torch", "onnx", "gymnasium"} <= set(imported)  # the scan sees the code
    for module, files in imported.items():
        names = {_name(d) for d in dists[module]}
        group = OPTIONAL_MODULES.get(module)
        declared = core if group is None else extras[group]
        assert names & declared, (f"{module} (imported by {files[0]}) is not declared in pyproject.toml's "
                                  f"{'dependencies' if group is None else f'optional group {group!r}'}")


def test_pinned_requirements_are_all_declared():
    """envs/requirements*.txt pin what the Makefile installs; each must be a declared dependency, or one that a
    declared dependency requires (pinned for a reproducible install: opt_einsum for jax)."""
    declared = {_name(r) for r in PYPROJECT["dependencies"]}
    for reqs in PYPROJECT["optional-dependencies"].values():
        declared |= {_name(r) for r in reqs if not r.startswith("rlflow[")}
    required = {_name(r) for d in declared for r in importlib.metadata.requires(d) or []}
    for path in (ROOT / "envs/requirements.txt", ROOT / "envs/requirements-test.txt"):
        for line in path.read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                assert _name(line) in declared | required, f"{path.name}: {line} is not declared in pyproject.toml"
    assert len(PYPROJECT["dependencies"]) == len({_name(r) for r in PYPROJECT["dependencies"]})  # none twice


def test_missing_optional_module_names_its_group(monkeypatch, capsys):
    import rlflow.commands.inspect as inspect_command

    def needs_tf(args):
        raise ModuleNotFoundError("No module named 'tensorflow'", name="tensorflow")

    monkeypatch.setattr(inspect_command, "run", needs_tf)
    assert main(["inspect", "model.onnx"]) == 2
    err = capsys.readouterr().err
    assert err == "rlflow: error: this needs tensorflow, from rlflow's optional group 'tf': pip install 'rlflow[tf]'\n"


def test_release_files_and_shipped_data_are_in_place():
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    citation = (ROOT / "CITATION.cff").read_text()
    assert "cff-version:" in citation and "RLFlow" in citation and "TASO" in citation and "XLA" in citation
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "rewrite/data/*.json.gz" in package_data["rlflow"]


def test_import_rlflow_is_cheap_and_names_the_api():
    """``import rlflow`` loads no torch (the Snakefile imports it); the API's names resolve on first use."""
    import subprocess

    code = ("import sys, rlflow; assert 'torch' not in sys.modules; "
            "print(all(callable(getattr(rlflow, n)) for n in ('optimize', 'estimate_cost', 'load', 'save')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert r.stdout.strip() == "True", r.stderr
