"""The ``jax`` backend: the IR lowered op by op into one ``jax.jit`` function, and the graph's HLO module.

Each op's lowering is its OpDef's ``jax`` facet (:mod:`rlflow.graph.ops`): ``(J, inputs, attrs, ctx) -> outputs``
with ``J`` holding ``jnp``, ``lax`` and ``nn`` and ``ctx`` the input and output shapes. Weights are embedded as
constants of the traced function (so XLA sees them, as TF-XLA does). Opaque nodes (ops outside the registry)
have no lowering: such graphs are refused with a one-line error naming the node.

:func:`hlo_text` gives the unoptimised HLO module of a graph (``jit(f).lower(...).compiler_ir('hlo')``), the
input of the XLA pass-ordering env: the weights either embedded as constants printed in full, or passed as
parameters (the module then holds the computation only).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np

from rlflow.errors import RLFlowError
from rlflow.graph.ir import Graph
from rlflow.graph.ops import OPS


def _jax():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import jax

    jax.config.update("jax_enable_x64", True)  # int64 indices and float64 graphs stay as typed
    import jax.numpy as jnp
    from jax import lax, nn

    return jax, SimpleNamespace(jnp=jnp, lax=lax, nn=nn)


def unsupported_reason(graph: Graph) -> str | None:
    """Why the jax backend cannot run ``graph``: an opaque node (no lowering); None if it can."""
    opaque = graph.opaque_nodes()
    if opaque:
        n = opaque[0]
        return f"the jax backend cannot lower node '{n.name}' (opaque op {n.op_type_name()}, outside the op registry)"
    missing = sorted({n.op for n in graph.nodes if OPS[n.op].jax is None})
    if missing:
        return f"the jax backend has no lowering for op(s) {', '.join(missing)}"
    return None


def graph_function(graph: Graph, J, params: tuple[str, ...] = ()):
    """The graph as a function of its inputs (in ``graph.inputs`` order), then of the constants named in
    ``params`` (weights passed as arguments), returning its outputs."""
    def run(*args):
        vals = dict(zip((*graph.inputs, *params), args))

        def get(v):
            if v not in vals:
                vals[v] = J.jnp.asarray(graph.constants[v].array)
            return vals[v]

        for n in graph.nodes:
            ins = [v for v in n.inputs if v]
            ctx = SimpleNamespace(in_shapes=[graph.types[v].shape for v in ins],
                                  out_shapes=[graph.types[v].shape for v in n.outputs])
            outs = OPS[n.op].jax(J, [get(v) for v in ins], n.attrs, ctx)
            for v, t in zip(n.outputs, outs):
                vals[v] = t.astype(graph.types[v].dtype) if t.dtype != np.dtype(graph.types[v].dtype) else t
        return [vals[v] if v in vals else get(v) for v in graph.outputs]

    return run


def _specs(jax, graph: Graph, values=None):
    return [jax.ShapeDtypeStruct(graph.types[v].shape, np.dtype(graph.types[v].dtype))
            for v in (graph.inputs if values is None else values)]


#: ``hlo_text(weights="parameters")`` passes float constants of at least this many elements as parameters
PARAMETER_MIN_ELEMENTS = 64


def weight_parameters(graph: Graph) -> tuple[str, ...]:
    """The constants :func:`hlo_text` passes as parameters: float tensors of at least
    :data:`PARAMETER_MIN_ELEMENTS` elements (the weights; shape and index constants stay constants)."""
    return tuple(v for v, c in graph.constants.items()
                 if np.issubdtype(c.array.dtype, np.floating) and c.array.size >= PARAMETER_MIN_ELEMENTS)


def hlo_text(graph: Graph, weights: str = "constants") -> str:
    """The graph's unoptimised HLO module (text), as JAX lowers it for XLA. ``weights``: ``constants`` embeds
    every weight in the module (printed in full: the module is the model); ``parameters`` makes each weight
    (:func:`weight_parameters`) a parameter after the graph's inputs, as a ``jax.jit`` of a model taking its
    parameters as arguments does: the module holds the computation only, and stays small."""
    if weights not in ("constants", "parameters"):
        raise RLFlowError(f"hlo_text: weights must be 'constants' or 'parameters', not {weights!r}")
    reason = unsupported_reason(graph)
    if reason:
        raise RLFlowError(reason)
    jax, J = _jax()
    params = weight_parameters(graph) if weights == "parameters" else ()
    fn = graph_function(graph, J, params)
    fn.__name__ = "".join(c if c.isalnum() else "_" for c in graph.name or "graph")
    # every constant printed in full: by default XLA elides large ones as ``{...}``, and the text would lose the
    # weights (the parser reads ``{...}`` back as arbitrary values)
    specs = _specs(jax, graph, (*graph.inputs, *params))
    return jax.jit(fn).lower(*specs).compiler_ir("hlo").as_hlo_text(print_large_constants=True)


class JaxRunner:
    """``feeds -> outputs`` through ``jax.jit`` of the graph (XLA CPU; compiled once, at construction)."""

    device = ran_on = "cpu"

    def __init__(self, graph: Graph, device: str = "cpu"):
        reason = unsupported_reason(graph)
        if reason:
            raise RLFlowError(reason)
        self.device_note = "" if device == "cpu" else "the jax backend runs on XLA CPU only"
        jax, J = _jax()
        self.graph, self._jax = graph, jax
        self._fn = jax.jit(graph_function(graph, J)).lower(*_specs(jax, graph)).compile()

    def __call__(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        missing = [v for v in self.graph.inputs if v not in feeds]
        if missing:
            raise RLFlowError(f"graph '{self.graph.name}': no value fed for input(s) {', '.join(missing)}")
        args = [np.asarray(feeds[v], dtype=self.graph.types[v].dtype) for v in self.graph.inputs]
        outs = self._fn(*args)
        return [np.asarray(o) for o in self._jax.block_until_ready(outs)]

    def peak_memory_bytes(self) -> int | None:
        return None  # XLA CPU does not report it
