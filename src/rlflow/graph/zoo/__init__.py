"""Model zoo: the benchmark networks as torch modules, exported to static-shape ONNX.

Every model is written in this project (no torchvision / Hugging Face code), has seeded random
weights (see :mod:`rlflow.graph.zoo._common`) and settable sizes, so tests can use tiny versions.

>>> model, inputs = build("bert", TINY_SIZES["bert"])      # eval-mode module + example inputs
>>> export_model("resnet18", "out/resnet18.onnx")           # one self-contained ONNX file
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings
from pathlib import Path

import onnx
import torch
from torch import nn

from rlflow.atomic import atomic_path
from rlflow.errors import RLFlowError

from . import bert, gpt2, inception, resnet, squeezenet, taso_bert, vit
from ._common import ModelSpec, init_weights


_SPECS: dict[str, ModelSpec] = {
    **bert.MODELS,
    **vit.MODELS,
    **resnet.MODELS,
    **squeezenet.MODELS,
    **inception.MODELS,
    **taso_bert.MODELS,
    **gpt2.MODELS,
}

MODEL_NAMES: tuple[str, ...] = tuple(_SPECS)
DEFAULT_SIZES: dict[str, dict] = {name: dict(spec.default_sizes) for name, spec in _SPECS.items()}
TINY_SIZES: dict[str, dict] = {name: dict(spec.tiny_sizes) for name, spec in _SPECS.items()}
OUTPUT_NAMES: dict[str, str] = {name: spec.output_name for name, spec in _SPECS.items()}
EXPORTERS = ("dynamo", "torchscript")


def _spec(name: str) -> ModelSpec:
    if name not in _SPECS:
        raise RLFlowError(f"unknown zoo model {name!r} (known: {', '.join(MODEL_NAMES)})")
    return _SPECS[name]


def resolve_sizes(name: str, sizes: dict | None = None) -> dict:
    """DEFAULT_SIZES[name] updated with ``sizes``; unknown keys or non-positive values are errors."""
    defaults = _spec(name).default_sizes
    resolved = dict(defaults)
    for key, value in (sizes or {}).items():
        if key not in defaults:
            raise RLFlowError(f"unknown size key {key!r} for zoo model {name!r} (known: {', '.join(defaults)})")
        want = float if isinstance(defaults[key], float) else int
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise RLFlowError(f"zoo model {name!r}: size {key!r} must be a positive number, got {value!r}")
        if want is int and value != int(value):
            raise RLFlowError(f"zoo model {name!r}: size {key!r} must be an integer, got {value!r}")
        resolved[key] = want(value)
    return resolved


def build(name: str, sizes: dict | None = None, seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Module in eval mode with seeded random weights, and example inputs keyed by ONNX input name.

    ``sizes`` overrides DEFAULT_SIZES keys; an unknown model name or size key raises RLFlowError.
    The inputs come from their own generator (also from ``seed``); a model with a ``calibrate(inputs)``
    method (taso-bert) rescales its weights on them once, deterministically.
    """
    spec = _spec(name)
    resolved = resolve_sizes(name, sizes)
    model = spec.make(resolved)
    init_weights(model, seed)
    model.eval()
    inputs = spec.example_inputs(resolved, seed)
    calibrate = getattr(model, "calibrate", None)
    if calibrate is not None:
        calibrate(inputs)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, inputs


@contextlib.contextmanager
def _quiet_exporter():
    """Hide the exporters' known harmless noise (only these warnings; errors still propagate)."""
    registration_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration_log.level
    registration_log.setLevel(logging.ERROR)  # "torchvision is not installed. Skipping torchvision::nms"
    try:
        with warnings.catch_warnings():
            # deprecation notices about torch's own internals (the legacy exporter, its logging setup, pytree)
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx")
            warnings.filterwarnings("ignore", "You are using the legacy TorchScript-based ONNX export")
            warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            yield
    finally:
        registration_log.setLevel(level)


def export_model(
    name: str,
    path: str | os.PathLike,
    sizes: dict | None = None,
    *,
    opset: int = 18,
    exporter: str = "dynamo",
    seed: int = 0,
) -> None:
    """Export to ONE self-contained static-shape ONNX file at ``path``, written atomically.

    exporter: "dynamo" -> ``torch.onnx.export(..., dynamo=True)``, "torchscript" -> ``dynamo=False``.
    Weights are stored inline (no external-data file); the TorchScript exporter writes its raw file in a
    temporary directory. The dynamo exporter emits opset 18 or later; a lower ``opset`` is reached with
    ONNX's version converter. The file's opset is checked against ``opset``.
    """
    if exporter not in EXPORTERS:
        raise RLFlowError(f"unknown ONNX exporter {exporter!r} (known: {', '.join(EXPORTERS)})")
    model, inputs = build(name, sizes, seed)
    output_name = _spec(name).output_name
    with _quiet_exporter():
        if exporter == "dynamo":
            proto = _export_dynamo(model, inputs, output_name, max(opset, 18))
        else:
            proto = _export_torchscript(model, inputs, output_name, opset)
    if _opset_of(proto) > opset:
        proto = _down_convert(proto, opset)
    if _opset_of(proto) != opset:
        raise RLFlowError(f"zoo model {name!r}: {exporter} exporter produced opset {_opset_of(proto)}, not {opset}")
    _strip_stack_traces(proto)
    with atomic_path(path) as tmp:
        onnx.save(proto, str(tmp), save_as_external_data=False)


#: ops the dynamo exporter's optimiser must not constant-fold, so that the graph shows what a framework
#: export looks like: BERT's position / token-type embedding lookups (Gather of constant ids) and its
#: attention-mask construction (Equal/Where, hence the Expand after them). rlflow's importer folds them.
_KEEP_UNFOLDED = frozenset({"Gather", "Equal", "Where"})


def _keep_unfolded(node) -> bool | None:
    """``should_fold`` hook for onnxscript's constant folder: False vetoes folding, None leaves it the default."""
    return False if node.domain in ("", "ai.onnx") and node.op_type in _KEEP_UNFOLDED else None


def _export_dynamo(model: nn.Module, inputs: dict, output_name: str, opset: int) -> onnx.ModelProto:
    """torch.export-based exporter, then the optimisation ``optimize=True`` would run, minus some folding."""
    import onnxscript.optimizer  # imported here: it takes a while and only exports need it
    import onnxscript.rewriter.onnx_fusions

    program = torch.onnx.export(
        model,
        tuple(inputs.values()),
        input_names=list(inputs),
        output_names=[output_name],
        opset_version=opset,
        dynamo=True,
        optimize=False,
        verbose=False,
    )
    onnxscript.optimizer.optimize_ir(program.model, should_fold=_keep_unfolded)
    onnxscript.rewriter.onnx_fusions.fuse(program.model)
    return program.model_proto


def _export_torchscript(model: nn.Module, inputs: dict, output_name: str, opset: int) -> onnx.ModelProto:
    """Legacy TorchScript exporter, via a temporary directory so nothing is left next to the target."""
    with tempfile.TemporaryDirectory(prefix="rlflow-zoo-") as tmpdir:
        raw = Path(tmpdir) / "model.onnx"
        torch.onnx.export(
            model,
            tuple(inputs.values()),
            str(raw),
            input_names=list(inputs),
            output_names=[output_name],
            opset_version=opset,
            dynamo=False,
            do_constant_folding=True,
            verbose=False,
        )
        return onnx.load(str(raw))  # pulls in any external data written next to the raw file


def _opset_of(proto: onnx.ModelProto) -> int:
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def _down_convert(proto: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """ONNX's version converter, plus a fix for its Reduce* adapter (opset 18 -> 17).

    The adapter moves ``axes`` back from an input to an attribute but keeps ``noop_with_empty_axes``,
    which before opset 18 only ReduceSum has; its default 0 is exactly the old behaviour, so drop it.
    """
    import onnx.version_converter

    converted = onnx.version_converter.convert_version(proto, opset)
    if opset < 18:
        for node in converted.graph.node:
            if node.op_type.startswith("Reduce") and node.op_type != "ReduceSum":
                kept = [a for a in node.attribute if not (a.name == "noop_with_empty_axes" and a.i == 0)]
                del node.attribute[:]
                node.attribute.extend(kept)
    return converted


def _strip_stack_traces(proto: onnx.ModelProto) -> None:
    """Drop the dynamo exporter's per-node Python stack traces: they hold absolute source paths, which
    would make the file depend on where the checkout lives."""
    for node in proto.graph.node:
        kept = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.stack_trace"]
        if len(kept) != len(node.metadata_props):
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
