"""The code a stage depends on: the import closure of its module inside ``src/rlflow``, read from the source.

Every ``import`` and ``from ... import`` statement counts, at module level or inside a function (the stages
import their heavy libraries lazily), and so does every package ``__init__.py`` that importing a module runs.
Imports outside ``rlflow`` (torch, onnx, ...) are not followed. ``from rlflow.x import y`` depends on
``rlflow/x/y.py`` when that is a module, else on ``rlflow/x`` (``y`` is a name defined there).

The registry turns this into each stage's code dependencies, for both the Snakemake rule (files) and dvc.yaml,
so that editing any module a stage runs reruns the stage, with no hand-kept list to drift.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

#: src/ (holds the rlflow package)
SRC = Path(__file__).resolve().parents[2]
PACKAGE = "rlflow"


def module_file(module: str, src: Path = SRC) -> Path | None:
    """The source file of a dotted module name under ``src`` (a package's ``__init__.py``), or None."""
    base = src.joinpath(*module.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _is_package(module: str, src: Path) -> bool:
    return (src.joinpath(*module.split(".")) / "__init__.py").is_file()


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def _statements(body: list[ast.stmt]):
    """Every statement in ``body`` and in the blocks nested in it (functions, classes, if/try/with/loop/match
    bodies): where an import can stand. Expressions are not entered (an import is never one), which makes this
    several times quicker than ``ast.walk``."""
    for node in body:
        yield node
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            block = getattr(node, name, None)
            if isinstance(block, list):
                yield from _statements(block)


@lru_cache(maxsize=None)
def direct_imports(module: str, src: Path = SRC) -> frozenset[str]:
    """The ``rlflow`` modules one module imports anywhere in its source (not transitively)."""
    path = module_file(module, src)
    if path is None:
        raise ValueError(f"no module {module} under {src}")
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _statements(tree.body):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package upwards
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target]
            if _is_package(target, src):  # `from rlflow.x import y`: y may be a submodule
                names += [f"{target}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                while name and module_file(name, src) is None:  # `import rlflow.x.func`-like: the module part
                    name = name.rpartition(".")[0]
                if name:
                    found.add(name)
    found.discard(module)
    return frozenset(found)


def closure(module: str, src: Path = SRC) -> list[str]:
    """Every ``rlflow`` module that running ``module`` imports, itself and the packages' ``__init__`` included,
    sorted."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += [p for p in _parents(m) if p not in seen]
        todo += [d for d in direct_imports(m, src) if d not in seen]
    return sorted(seen)


def closure_files(module: str, src: Path = SRC) -> list[str]:
    """:func:`closure` as source files relative to the repository root (``src/rlflow/...py``), sorted."""
    root = src.parent
    return sorted(str(module_file(m, src).relative_to(root)) for m in closure(module, src))


def as_folders(files: list[str], root: Path) -> list[str]:
    """``files`` (repository-relative) with every folder whose ``.py`` files are all listed written as the
    folder (the shortest list of DVC deps that covers exactly those files, or a superset only by files that are
    not Python); sorted."""
    listed = set(files)
    folders: dict[str, bool] = {}

    def complete(folder: Path) -> bool:
        key = str(folder)
        if key not in folders:
            pys = [str(p.relative_to(root)) for p in (root / folder).rglob("*.py") if "__pycache__" not in p.parts]
            folders[key] = bool(pys) and all(p in listed for p in pys)
        return folders[key]

    out: set[str] = set()
    for f in files:
        top = None
        for parent in Path(f).parents:
            if parent == Path(".") or parent == Path("src"):
                break
            if complete(parent):
                top = parent
        out.add(str(top) if top is not None else f)
    return sorted(out)
