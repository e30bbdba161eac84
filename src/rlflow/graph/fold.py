"""Fold static subgraphs: nodes whose inputs are all constants (a weight transposed, two weights concatenated,
a kernel enlarged, BatchNormalization parameters combined) become constants computed once.

Rewrites leave such nodes in the graph (cheap to apply, and the cost model can treat them as free); search
results and exported models are folded with :func:`fold_constants`, as TASO folds weight-only ops after its
search.

Value-aware canonicalisation, which no rule can do (rules see shapes, not values): :func:`additive_masks` writes
a multiplicative 0/1 attention mask before a Softmax as an additive one (GPT-2's ``s * B - C * (1 - B)``), and
:func:`drop_nan_guards` removes Hugging Face's ``Where(IsNaN(p), 0, p)`` after a softmax whose constant mask
leaves every row a key, so the rules into ONNX's fused ``Attention`` match. :func:`at_opset` applies both
(:func:`canonical_attention`) from the opset that defines ``Attention``; the importer does so for files of that
opset.
"""

from __future__ import annotations

import numpy as np

from rlflow.graph.ir import Constant, Graph, Node
from rlflow.graph.ops import OPS
from rlflow.graph.ops.attention import ATTENTION_OPSET

#: the least mask magnitude :func:`additive_masks` accepts (see there for why this is enough)
MASK_MIN = 1e4


def static_values(graph: Graph) -> tuple[set[str], list[int]]:
    """(static values, indices of static nodes): a static node reads only constants or outputs of static nodes
    (a weight reshaped, two weights concatenated); its outputs and the constants are the static values."""
    static = set(graph.constants)
    out = []
    for i, n in enumerate(graph.nodes):
        if n.op != "Opaque" and n.inputs and all(v in static for v in n.inputs if v):
            static.update(n.outputs)
            out.append(i)
    return static, out


def static_nodes(graph: Graph) -> list[int]:
    """Indices of the nodes that read only constants or outputs of such nodes."""
    return static_values(graph)[1]


#: ops whose folding needs no torch: data movement (exact in any dtype) and the four arithmetic ops on floats
#: (IEEE-rounded alike in numpy and torch, with the same broadcasting). What searches leave static is mostly
#: these (merged or transposed weights, folded scales), so a search stage need not import torch (seconds per
#: job) to fold them; tests/test_fold.py checks each against the op's torch compute.
NUMPY_FOLD = {
    "Concat": lambda xs, a: [np.concatenate(xs, axis=a["axis"])],
    "Split": lambda xs, a: np.split(xs[0], np.cumsum(a["split"])[:-1], axis=a["axis"]),
    "Transpose": lambda xs, a: [np.transpose(xs[0], a["perm"]).copy()],
    "Reshape": lambda xs, a: [xs[0].reshape(a["shape"])],
    "Identity": lambda xs, a: [xs[0]],
    "Add": lambda xs, a: [xs[0] + xs[1]],
    "Sub": lambda xs, a: [xs[0] - xs[1]],
    "Mul": lambda xs, a: [xs[0] * xs[1]],
    "Div": lambda xs, a: [xs[0] / xs[1]],
    "ScalarMul": lambda xs, a: [xs[0] * xs[1]],
}
_ARITHMETIC = {"Add", "Sub", "Mul", "Div", "ScalarMul"}


def _fold_node(op: str, attrs: dict, ins: list[np.ndarray]) -> list[np.ndarray]:
    """One static node's outputs: with numpy where :data:`NUMPY_FOLD` has the op (arithmetic on floats only),
    else with the op's torch compute."""
    if op in NUMPY_FOLD and (op not in _ARITHMETIC or all(x.dtype.kind == "f" for x in ins)):
        return NUMPY_FOLD[op](ins, attrs)
    import torch

    with torch.inference_mode():
        outs = OPS[op].compute([torch.from_numpy(np.array(x)) for x in ins], attrs)  # (a writeable copy)
    return [t.contiguous().numpy() for t in outs]


def fold_constants(graph: Graph) -> Graph:
    """The same graph with every static node replaced by constants (computed with the ops' semantics in the
    tensors' own dtype: numpy for :data:`NUMPY_FOLD`'s ops, torch for the rest). Constants nobody reads any more
    are dropped. Returns ``graph`` itself if there is nothing to fold."""
    idx = static_nodes(graph)
    if not idx:
        return graph
    fold = set(idx)
    constants = dict(graph.constants)
    for i in idx:
        n = graph.nodes[i]
        outs = _fold_node(n.op, n.attrs, [np.asarray(constants[v].array) for v in n.inputs])
        for v, t in zip(n.outputs, outs):
            constants[v] = Constant(np.asarray(t).astype(graph.types[v].dtype, copy=False))
    nodes = [n for i, n in enumerate(graph.nodes) if i not in fold]
    used = {v for n in nodes for v in n.inputs} | set(graph.outputs)
    g = graph.copy()
    g.nodes = nodes
    g.constants = {k: c for k, c in constants.items() if k in used}
    g.types = {k: t for k, t in graph.types.items() if k not in constants or k in used}
    return g


def drop_unused_constants(g: Graph) -> Graph:
    """``g`` without the constants no node and no output reads (``g`` itself if there are none)."""
    used = {v for n in g.nodes for v in n.inputs} | set(g.outputs)
    if all(c in used for c in g.constants):
        return g
    g = g.copy()
    g.constants = {k: c for k, c in g.constants.items() if k in used}
    g.types = {k: t for k, t in g.types.items() if k in used or k in g.inputs or k not in g.constants}
    return g


def _additive_mask(graph: Graph, i: int) -> tuple[int, str, np.ndarray] | None:
    """For node ``i``, ``Sub(Mul(s, B), D)`` or ``Add(Mul(s, B), N)`` (either operand order of the Mul and the
    Add) read only by Softmax nodes, whose values make it a 0/1 mask (see :func:`additive_masks`): (index of the
    Mul, s, the additive mask M); None otherwise."""
    n, types, consts = graph.nodes[i], graph.types, graph.constants
    if n.op not in ("Sub", "Add") or n.outputs[0] in graph.outputs:
        return None
    pairs = [(n.inputs[0], n.inputs[1], -1.0)] if n.op == "Sub" else [(n.inputs[0], n.inputs[1], 1.0),
                                                                         (n.inputs[1], n.inputs[0], 1.0)]
    cons, prod = graph.consumers(), graph.producer()
    readers = [graph.nodes[k] for k in cons.get(n.outputs[0], [])]
    if not readers or any(r.op != "Softmax" for r in readers):
        return None
    for scores, bias, sign in pairs:
        m = graph.nodes[prod[scores]] if scores in prod else None
        if bias not in consts or m is None or m.op != "Mul" or cons[scores] != [i] or scores in graph.outputs:
            continue
        for s, b in ((m.inputs[0], m.inputs[1]), (m.inputs[1], m.inputs[0])):
            t = types[s]
            if s in consts or b not in consts or t.dtype not in ("float16", "float32", "float64") \
                    or types[scores] != t or types[n.outputs[0]] != t:
                continue
            keep, add = np.broadcast_arrays(np.asarray(consts[b].array), sign * np.asarray(consts[bias].array))
            lead = (1,) * (len(t.shape) - keep.ndim)  # to the scores' rank, for the Softmax's axis
            keep, add = keep.reshape(lead + keep.shape), add.reshape(lead + add.shape)
            if not (np.isin(keep, (0, 1)).all() and (add[keep == 1] == 0).all()
                    and (add[keep == 0] <= -MASK_MIN).all()):
                continue
            if not all(np.any(keep == 1, axis=r.attrs["axis"]).all() for r in readers):
                continue  # a row the mask leaves no key: there the two forms differ
            return prod[scores], s, np.where(keep == 1, 0, add).astype(t.dtype)
    return None


def additive_masks(graph: Graph) -> Graph:
    """``graph`` with every multiplicative 0/1 mask before a Softmax written as an additive one: the scores ``s``
    times a constant ``B`` whose values are all 0 or 1, minus a constant ``D`` that is 0 where ``B`` is 1 and at
    least :data:`MASK_MIN` where ``B`` is 0 (``s * B - C * (1 - B)`` as OpenAI's GPT-2 writes its causal mask,
    ``(1 - B)`` folded by the importer; or plus ``N = -D``), read only by Softmax nodes each of whose rows the
    mask leaves at least one key, becomes ``s + M`` with the constant ``M = where(B == 1, 0, -D)``: one Add, the
    additive mask the fused-attention rules match. Every other graph comes back as itself.

    Where ``B`` is 1 both forms are ``s`` exactly. Where ``B`` is 0 the original is ``-D`` and the new one
    ``s - D``: different numbers, but after the softmax both weigh exactly 0. float32's ``exp`` is 0 below about
    -104, and the Softmax subtracts the row's maximum, which is an unmasked score (every row keeps a key): a
    masked entry weighs ``exp(-D - max)`` in the original and ``exp(s - D - max)`` in the new form, both 0 as long
    as the scores lie within ``(D - 104) / 2`` of zero (about 5,000 at ``D`` = :data:`MASK_MIN`, 5e9 at GPT-2's
    1e10; scores beyond that break the original mask too). The unmasked entries are the same numbers, so the
    softmax outputs are equal to within float32 rounding (in practice identical)."""
    found = {i: hit for i in range(len(graph.nodes)) if (hit := _additive_mask(graph, i)) is not None}
    if not found:
        return graph
    g = graph.copy()
    g.constants, g.types = dict(graph.constants), dict(graph.types)
    drop = {mul for mul, _, _ in found.values()}
    nodes = []
    for i, n in enumerate(graph.nodes):
        if i in found:
            _, s, mask = found[i]
            name = f"{n.name}_additive_mask"
            while name in g.types:
                name += "_"
            g.constants[name] = Constant(mask)
            g.types[name] = g.constants[name].type
            nodes.append(Node(n.name, "Add", (s, name), n.outputs, {}))
        elif i not in drop:
            nodes.append(n)
    g.nodes = nodes
    gone = {graph.nodes[d].outputs[0] for d in drop}
    g.types = {k: t for k, t in g.types.items() if k not in gone}
    return drop_unused_constants(g)


def _onnx_op(node: Node) -> str | None:
    """The standard ONNX op a node runs: its IR op, or an opaque node's op type (None for another domain's)."""
    if node.op != "Opaque":
        return node.op
    return node.attrs["op_type"] if node.attrs.get("domain") in ("", "ai.onnx") else None


def _nan_guard(graph: Graph, i: int) -> tuple[int, str] | None:
    """For node ``i``, ``Where(IsNaN(p), 0, p)`` with ``p = Softmax(s + M)`` and ``M`` a constant leaving every
    Softmax row a finite entry (see :func:`drop_nan_guards`): (index of the IsNaN, p); None otherwise."""
    w, prod, cons, consts = graph.nodes[i], graph.producer(), graph.consumers(), graph.constants
    if _onnx_op(w) != "Where" or len(w.inputs) != 3 or w.outputs[0] in graph.outputs:
        return None
    cond, zero, p = w.inputs
    isnan = graph.nodes[prod[cond]] if cond in prod else None
    soft = graph.nodes[prod[p]] if p in prod else None
    if isnan is None or _onnx_op(isnan) != "IsNaN" or isnan.inputs != (p,) or cons[cond] != [i] \
            or cond in graph.outputs or zero not in consts or np.asarray(consts[zero].array).any() \
            or soft is None or soft.op != "Softmax" or graph.types[w.outputs[0]] != graph.types[p]:
        return None
    add = graph.nodes[prod[soft.inputs[0]]] if soft.inputs[0] in prod else None
    if add is None or add.op != "Add":
        return None
    rank = len(graph.types[p].shape)
    for m in add.inputs:
        if m in consts and not any(v in consts for v in add.inputs if v != m):
            finite = np.isfinite(np.asarray(consts[m].array))
            finite = finite.reshape((1,) * (rank - finite.ndim) + finite.shape)
            if np.any(finite, axis=soft.attrs["axis"]).all():
                return prod[cond], p
    return None


def drop_nan_guards(graph: Graph) -> Graph:
    """``graph`` without the guards Hugging Face's exports put after an attention softmax,
    ``Where(IsNaN(p), 0, p)`` with ``p = Softmax(s + M)``, where the constant mask ``M`` leaves every Softmax row
    at least one finite entry (GPT-2's causal mask: 0 on and below the diagonal, float32's lowest value above);
    readers of the guard read ``p``. Every other graph comes back as itself.

    The guard is the identity wherever the scores ``s`` are finite, the values every rule is verified on: a
    softmax output is NaN only in a row holding a NaN or a +inf, or one that is -inf throughout, and ``s + M``
    is none of these when ``s`` is finite and each row of ``M`` has a finite entry. (For the one case the guard
    exists for, a row masked throughout with -inf, ONNX's fused ``Attention`` gives zeros as the guard does.)"""
    found = {i: hit for i in range(len(graph.nodes)) if (hit := _nan_guard(graph, i)) is not None}
    if not found:
        return graph
    drop = set(found) | {isnan for isnan, _ in found.values()}
    rename = {graph.nodes[i].outputs[0]: p for i, (_, p) in found.items()}
    g = graph.copy()
    g.nodes = [Node(n.name, n.op, tuple(rename.get(v, v) for v in n.inputs), n.outputs, n.attrs)
               for i, n in enumerate(graph.nodes) if i not in drop]
    gone = {v for i in drop for v in graph.nodes[i].outputs}
    g.types = {k: t for k, t in graph.types.items() if k not in gone}
    return drop_unused_constants(g)


def canonical_attention(graph: Graph) -> Graph:
    """``graph`` with its attention masks in the form the rules into ONNX's ``Attention`` match:
    :func:`additive_masks`, then :func:`drop_nan_guards`."""
    return drop_nan_guards(additive_masks(graph))


def at_opset(graph: Graph, opset: int) -> Graph:
    """A copy of ``graph`` at ``opset`` (what ``rlflow optimize --opset`` writes); from :data:`ATTENTION_OPSET`
    on, its attention masks in canonical form (:func:`canonical_attention`) so attention can fuse."""
    g = graph.copy()
    g.opset = opset
    return canonical_attention(g) if opset >= ATTENTION_OPSET else g
