"""onnxruntime's offline transformer optimizer as a baseline method (``ort_optimizer``): what a user of
onnxruntime runs instead of a rewrite search.

``onnxruntime.transformers.optimizer.optimize_model`` (shipped in the onnxruntime package) pattern-matches a
transformer's subgraphs and replaces them by onnxruntime contrib ops (``com.microsoft`` SkipLayerNormalization,
Gelu / BiasGelu / FastGelu, Attention, EmbedLayerNormalization, ...), with its default optimisation level for the
model type. Only onnxruntime runs those ops: the IR keeps them as opaque nodes, with the output types that
onnxruntime's symbolic shape inference gives them. For a model that is no transformer (the zoo's CNNs) the
optimizer does not apply and the original graph is the result.
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from pathlib import Path

from rlflow.errors import RLFlowError
from rlflow.graph.ir import Graph
from rlflow.search.result import SearchResult

#: zoo model -> the optimizer's model type (the zoo's CNNs have none: the optimizer does not apply to them)
MODEL_TYPES = {"bert": "bert", "taso-bert": "bert", "gpt2": "gpt2", "vit": "vit"}


def model_type(model: str) -> str | None:
    """The optimizer's model type for a zoo model's name (None: no transformer, it does not apply)."""
    return MODEL_TYPES.get(model)


def optimize_file(onnx_path: str | Path, kind: str, heads: int = 0, hidden: int = 0, input_shapes=None) -> Graph:
    """Run the optimizer on an ONNX file for model type ``kind`` (``heads``/``hidden``: 0 = detect them from
    the graph) and import its output into the IR (contrib ops become opaque nodes; ``input_shapes`` as
    :func:`rlflow.graph.onnx_io.load_onnx` takes them, for inputs of dynamic size)."""
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    from onnxruntime.transformers.optimizer import optimize_model

    from rlflow.graph.onnx_io import load_onnx

    try:
        opt = optimize_model(str(onnx_path), model_type=kind, num_heads=heads, hidden_size=hidden, use_gpu=False)
        model = SymbolicShapeInference.infer_shapes(opt.model, auto_merge=True)
    except Exception as e:  # the optimizer's own failure on this graph: one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RLFlowError(f"{onnx_path}: onnxruntime's transformer optimizer failed ({kind}): {first}") from None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "optimised.onnx"
        onnx.save(model, str(path), save_as_external_data=model.ByteSize() > 1_500_000_000)
        return load_onnx(path, input_shapes)


def ort_optimizer(original: Graph, onnx_path: str | Path, kind: str | None, cost, heads: int = 0,
                  hidden: int = 0, input_shapes=None) -> SearchResult:
    """The optimizer's graph for the model in ``onnx_path`` (``original`` is that file imported), scored by
    ``cost``; ``kind`` None: it does not apply and the result is the original."""
    t0 = time.perf_counter()
    graph = original if kind is None else optimize_file(onnx_path, kind, heads, hidden, input_shapes)
    contrib = Counter(f"{n.attrs['domain']}:{n.attrs['op_type']}" for n in graph.nodes
                      if n.op == "Opaque" and n.attrs.get("domain") not in ("", "ai.onnx"))
    before, after = cost.graph_metrics(original), cost.graph_metrics(graph)
    reason = "not a transformer: the optimizer does not apply" if kind is None else (
        "fused " + ", ".join(f"{op} x{c}" for op, c in sorted(contrib.items())) if contrib else "found nothing to fuse")
    return SearchResult(method="ort_optimizer", graph=graph, initial=before, final=after, trace=[], expansions=0,
                        seconds=time.perf_counter() - t0, stop_reason=reason, nodes_before=len(original.nodes),
                        nodes_after=len(graph.nodes),
                        settings={"model_type": kind, "num_heads": heads, "hidden_size": hidden},
                        stats={"contrib_ops": dict(contrib)})
