"""Load and validate ``config.yaml`` (the Snakemake config and the DVC params file).

The JSON schema lives beside this module (``config.schema.yaml``); ``workflow/schemas/config.schema.yaml``
is a link to the same file, so Snakemake and the CLI validate against one schema.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import yaml

from rlflow.errors import RLFlowError

SCHEMA_PATH = Path(__file__).with_name("config.schema.yaml")


def load_schema() -> dict:
    """The config schema (a fresh copy: callers may change it). Parsed once per process: every command builds
    its parser from it (model names, pass variants), so reading it per use cost seconds at each start."""
    return copy.deepcopy(_parsed_schema())


@functools.lru_cache(maxsize=1)
def _parsed_schema() -> dict:
    return yaml.load(SCHEMA_PATH.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _with_defaults(schema: dict, value: Any) -> Any:
    """Fill object defaults from the schema (recursively), as Snakemake's ``validate(set_default=True)`` does."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    out = dict(value)
    for key, sub in schema.get("properties", {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = _with_defaults(sub, out[key])
    return out


def validate(config: dict, source: str = "config") -> dict:
    """Validate ``config`` against the schema; return it with defaults filled. One-line error on failure."""
    import jsonschema

    schema = load_schema()
    config = _with_defaults(schema, config)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        raise RLFlowError(f"{source}: {describe_error(errors[0])}")
    return config


def check_models(config: dict, source: str = "config") -> None:
    """Every name in ``models`` is a zoo model or an own model (a ``zoo`` entry naming its ONNX file). Checked
    where the whole config is known (the Snakefile; export_model): a stage job gets only the keys it reads."""
    zoo = load_schema()["$defs"]["zoo_model"]["enum"]
    for name in config.get("models", ()):
        if name not in zoo and name not in config.get("zoo", {}):
            raise RLFlowError(f"{source}: models: '{name}' is neither a zoo model ({', '.join(zoo)}) nor an own "
                              f"model (give its file as zoo.{name}.onnx: models/{name}.onnx)")


def describe_error(err) -> str:
    """One line for a ``jsonschema.ValidationError`` that names the offending dotted key."""
    path = [str(p) for p in err.absolute_path]
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = set(err.schema.get("properties", {}))
        extra = sorted(k for k in err.instance if k not in known)
        keys = ", ".join("'" + ".".join(path + [str(k)]) + "'" for k in extra)
        allowed = ", ".join(sorted(known))
        return f"unknown config key {keys} (allowed here: {allowed})"
    key = ".".join(path) or "(top level)"
    return f"invalid config key '{key}': {err.message}"


def deep_merge(base: Any, override: dict) -> dict:
    """Return ``base`` updated by ``override`` (neither is modified): mappings merge key by key, recursively;
    lists and scalars replace. This is Snakemake's ``--configfile`` merging (``snakemake.utils.update_config``,
    including its corner cases; a test compares the two), so ``rlflow ... --config config.yaml --config
    tiny.yaml`` sees what ``snakemake --configfile tiny.yaml`` sees."""

    def merge(node: Any, upd: dict) -> Any:
        for key, value in upd.items():
            if not isinstance(node, dict):
                node = {}
            if isinstance(value, dict):
                node[key] = merge(node.get(key, {}), value)
            else:
                node[key] = copy.deepcopy(value)
        return node

    return merge(copy.deepcopy(base), override)


def _read_yaml_mapping(p: Path) -> dict:
    if not p.is_file():
        raise RLFlowError(f"{p}: config file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise RLFlowError(f"{p}: not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise RLFlowError(f"{p}: the config must be a mapping of keys to values")
    return data


def apply_override(data: dict, item: str) -> dict:
    """Apply one ``key.sub=value`` override in place (``value`` is parsed as YAML, so JSON works too)."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise RLFlowError(f"override '{item}' must look like key.sub=value")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        raise RLFlowError(f"override '{item}': the value is not valid YAML") from None
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part, {}), dict):
            raise RLFlowError(f"override '{item}': '{part}' is not a mapping")
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return data


def load_config(path: str | Path | Sequence[str | Path] | None, overrides: list[str] | None = None) -> dict:
    """Read one or more YAML config files, apply ``key.sub=value`` overrides, and validate.

    ``path`` may be one file, a list of files (later files are deep-merged over earlier ones: mappings merge
    key by key, lists and scalars replace -- see :func:`deep_merge`), or None for the schema defaults only.
    Overrides apply last, each replacing the value at its dotted key.
    """
    if path is None:
        paths: list[Path] = []
    elif isinstance(path, (str, Path)):
        paths = [Path(path)]
    else:
        paths = [Path(p) for p in path]
    data: dict = {}
    for p in paths:
        data = deep_merge(data, _read_yaml_mapping(p))
    for item in overrides or []:
        apply_override(data, item)
    source = " + ".join([*(str(p) for p in paths), *(["--set"] if overrides else [])]) or "defaults"
    return validate(data, source)


def get(config: dict, dotted: str) -> Any:
    """``get(cfg, "zoo.bert.layers")``; a missing key is a one-line error naming it."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise RLFlowError(f"config key '{dotted}' is missing")
        node = node[part]
    return node


#: the device files a GPU driver makes (NVIDIA's; WSL2's; ROCm's): torch can see a GPU only where one exists
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg", "/dev/kfd")


def cuda_available() -> bool:
    """Whether torch sees a CUDA (or ROCm) GPU. Without a GPU driver (a check of a few files) the answer is no and
    torch is not imported: importing it to ask takes seconds, and each pipeline stage asks."""
    if "torch" not in sys.modules and not any(os.path.exists(p) for p in GPU_DEVICE_FILES):
        return False
    import torch

    return bool(torch.cuda.is_available())


def resolve_device(config: dict) -> str:
    """``device: auto|cpu|cuda`` -> ``cpu`` or ``cuda`` (auto picks cuda when torch sees a GPU)."""
    want = config.get("device", "auto")
    if want == "cpu":
        return "cpu"
    has_cuda = cuda_available()
    if want == "cuda" and not has_cuda:
        raise RLFlowError("config key 'device' is 'cuda' but torch sees no CUDA device")
    return "cuda" if has_cuda else "cpu"


def add_config_arguments(parser: argparse.ArgumentParser, example: str = "zoo.bert.layers=2") -> None:
    """``--config`` (repeatable, deep-merged) and ``--set KEY=VALUE`` (repeatable, applied last)."""
    parser.add_argument("--config", metavar="YAML", action="append", default=None,
                        help="config file; repeat to merge several, later ones win (default: schema defaults)")
    parser.add_argument("--set", metavar="KEY=VALUE", dest="overrides", action="append", default=[],
                        help=f"override one config key after the files, e.g. --set {example} (repeatable)")
