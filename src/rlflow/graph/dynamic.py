"""Keeping a model's dynamic input dimensions through optimisation.

rlflow rewrites static graphs: the importer fixes every dynamic (symbolic) input dimension to the size given
with ``--input-shape``, and folds shapes into constants. :func:`keep_dynamic` asks whether the optimised graph
still computes what the original computes at other sizes of those dimensions: it puts the original's symbols
back on the graph's inputs (and the original's output shapes on its outputs), then runs it and the original
under onnxruntime at ``TRIALS`` other sizes on the same random inputs. Each Reshape's target shape is made to
follow its input's sizes first (:func:`follow_input_sizes`). If every trial agrees, the model is written with
its dynamic dimensions; if one fails (a size still baked into the graph), it is written specialised to the
given sizes, and a one-line note says so either way.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import onnx

from rlflow.graph.ir import Graph

#: the other sizes tried: each dynamic dimension of size v at 2v, then 2v + 1
TRIALS = (lambda v: 2 * v, lambda v: 2 * v + 1)


def dynamic_axes(model: onnx.ModelProto) -> dict[str, dict[int, str]]:
    """The graph inputs' dynamic dimensions: input name -> {axis: symbol}. The symbol is the dimension's name
    (``dim_param``), or ``<input>_<axis>`` for an unnamed one."""
    weights = {t.name for t in model.graph.initializer}
    axes: dict[str, dict[int, str]] = {}
    for inp in model.graph.input:
        if inp.name in weights:
            continue
        for axis, dim in enumerate(inp.type.tensor_type.shape.dim):
            if not (dim.HasField("dim_value") and dim.dim_value > 0):
                axes.setdefault(inp.name, {})[axis] = dim.dim_param or f"{inp.name}_{axis}"
    return axes


def io_shapes(graph: Graph, original: onnx.ModelProto, axes: dict[str, dict[int, str]]
              ) -> dict[str, list[int | str | None] | None]:
    """The shapes to write on the optimised graph's inputs (its static shapes with the symbols of ``axes``) and
    outputs (the original's, dynamic dimensions included; None where the original gives none)."""
    shapes: dict[str, list[int | str | None] | None] = {}
    for name in graph.inputs:
        dims: list[int | str | None] = list(graph.types[name].shape)
        for axis, symbol in axes.get(name, {}).items():
            dims[axis] = symbol
        shapes[name] = dims
    declared = {o.name: o.type.tensor_type for o in original.graph.output}
    for name in graph.outputs:
        tt = declared.get(name)
        shapes[name] = None if tt is None or not tt.HasField("shape") else [
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or None) for d in tt.shape.dim]
    return shapes


def keep_dynamic(graph: Graph, original: str | os.PathLike | bytes, seed: int = 0, tol: float = 1e-4
                 ) -> tuple[onnx.ModelProto | None, str | None]:
    """Whether ``graph`` (optimised from ``original``, a path or the bytes of an ONNX file) may keep the
    original's dynamic input dimensions. Returns (the model to write with them, or None: write ``graph`` as it
    is, static; a one-line note, or None when the original has no dynamic dimension)."""
    from rlflow.graph.onnx_io import _first_line, set_io_shapes, to_onnx

    model = _structure(original)
    axes = dynamic_axes(model)
    if not axes:
        return None, None
    sizes = {symbol: graph.types[name].shape[axis] for name, ax in axes.items() for axis, symbol in ax.items()}
    given = ", ".join(f"{symbol}={v}" for symbol, v in sizes.items())
    candidate = to_onnx(graph)
    set_io_shapes(candidate, io_shapes(graph, model, axes))
    follow_input_sizes(candidate, graph)
    try:
        onnx.checker.check_model(candidate)
    except Exception as e:
        return None, f"specialised to the given sizes ({given}): {_first_line(e)}"
    data = candidate.SerializeToString()
    tried = []
    for trial in TRIALS:
        at = {symbol: trial(v) for symbol, v in sizes.items()}
        where = ", ".join(f"{symbol}={v}" for symbol, v in at.items())
        failure = _compare(graph, original, data, axes, at, seed, tol)
        if failure:
            return None, (f"specialised to the given sizes ({given}): at {where} {failure}; the written model "
                          "has them fixed")
        tried.append(where)
    return candidate, (f"kept the dynamic dimensions ({', '.join(sizes)}): the optimised model matches the "
                       f"original at {' and at '.join(tried)} too")


def follow_input_sizes(model: onnx.ModelProto, graph: Graph) -> int:
    """Make each Reshape's constant target shape (a static graph has every one fixed) follow its input's sizes:
    a dimension equal to the input's at the same position becomes 0 (ONNX's "copy the input's"), and the first
    of the others -1 (the size that is left). At the given sizes nothing changes; whether the model now holds at
    other sizes is for the trials to say. Returns the number of Reshapes changed."""
    from onnx import numpy_helper

    weights = {t.name: t for t in model.graph.initializer}
    changed = 0
    for node in model.graph.node:
        if (node.op_type != "Reshape" or len(node.input) < 2 or node.input[1] not in weights
                or node.input[0] not in graph.types or any(a.name == "allowzero" and a.i for a in node.attribute)):
            continue
        target = [int(d) for d in numpy_helper.to_array(weights[node.input[1]]).reshape(-1)]
        source = graph.types[node.input[0]].shape
        new = [0 if k < len(source) and d == source[k] else d for k, d in enumerate(target)]
        rest = [k for k, d in enumerate(new) if d != 0]
        if rest and -1 not in new:
            new[rest[0]] = -1
        if new == target:
            continue
        name = f"{node.input[1]}_follows_input"
        while name in weights:
            name += "_"
        weights[name] = numpy_helper.from_array(np.asarray(new, np.int64), name)
        model.graph.initializer.append(weights[name])
        node.input[1] = name
        changed += 1
    used = {i for n in model.graph.node for i in n.input}
    keep = [t for t in model.graph.initializer if t.name in used or t.name in set(graph.outputs)]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    return changed


def _structure(original: str | os.PathLike | bytes) -> onnx.ModelProto:
    """The model's graph without its weights' data (only the inputs and outputs are read)."""
    if isinstance(original, (bytes, bytearray)):
        return onnx.load_from_string(bytes(original))
    return onnx.load(os.fspath(original), load_external_data=False)


def _compare(graph: Graph, original, candidate: bytes, axes, at: dict[str, int], seed: int, tol: float) -> str | None:
    """Run the original and the candidate at the sizes ``at`` on the same random inputs; None if they agree,
    else what went wrong, in words."""
    from rlflow.graph.exec import make_inputs, max_rel_diff
    from rlflow.graph.onnx_io import load_onnx

    shapes = {name: tuple(at[ax[axis]] if axis in ax else d for axis, d in enumerate(graph.types[name].shape))
              for name, ax in axes.items() if name in graph.types}
    try:
        feeds = make_inputs(load_onnx(original, shapes), seed)  # integer inputs bounded as the model needs them
        want = _run(original, feeds)
    except Exception as e:  # an RLFlowError from the import, or onnxruntime's own
        return f"the original does not run ({_short(e)}), so other sizes cannot be checked"
    try:
        got = _run(candidate, feeds)
    except Exception as e:
        return f"onnxruntime cannot run the optimised graph ({_short(e)})"
    for name, a, b in zip(graph.outputs, want, got):
        if a.shape != b.shape:
            return f"its output '{name}' has shape {list(b.shape)}, the original's {list(a.shape)}"
    diff = max_rel_diff(want, got)
    if not diff <= tol:
        return f"its outputs differ from the original's (by {diff:.3g})"
    return None


def _short(e: BaseException, limit: int = 160) -> str:
    """An error in one short line: onnxruntime's without its status prefix and source location."""
    import re

    from rlflow.graph.exec.errors import error_message

    text = re.sub(r"^/\S+:\d+ \S+\(.*?\) ", "", error_message(e))  # the C++ file:line function(args) prefix
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _run(model: str | os.PathLike | bytes, feeds) -> Sequence:
    import onnxruntime as ort

    from rlflow.graph.exec.ort_exec import quiet_options

    source = bytes(model) if isinstance(model, (bytes, bytearray)) else os.fspath(model)
    session = ort.InferenceSession(source, quiet_options(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)
