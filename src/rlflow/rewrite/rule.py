"""Rules are data: a source pattern, a target pattern, and which target value replaces which source value.

A rule in ``rules.json`` (format 1)::

    {"id": "g0007", "name": "matmul-assoc", "origin": "generated",
     "src": [{"op": "MatMul", "inputs": ["x", "w0"], "attrs": {}},
             {"op": "MatMul", "inputs": ["%0", "w1"], "attrs": {}}],
     "dst": [{"op": "MatMul", "inputs": ["w0", "w1"], "attrs": {}},
             {"op": "MatMul", "inputs": ["x", "%0"], "attrs": {}}],
     "outputs": [["%1", "%1"]],
     "constraints": {"const": ["w0", "w1"]},
     "verified": {"method": "random-float64", "trials": 5, "max_dims": [4, 4, 4, 4]}}

References (``inputs`` and ``outputs``): ``"%k"`` is output 0 of node k of the same side, ``"%k.j"`` its output j;
any other name is a **variable**: it matches any value of the graph (the same variable, the same value). Variables
are the source side's inputs; the target may only use those. Each pattern node gives every attribute of its op
(``OPS[op].attrs`` in :mod:`rlflow.graph.ops`) as one of:

- a literal (``1``, ``"relu"``, ``[1, 1]``): the graph's attribute must equal it;
- a parameter ``"$name"``: binds to the graph's value on first use, must be equal on every other use, and is
  copied into the target;
- an expression over the matched values' shapes: ``{"dim": [ref, axis]}``, ``{"rank": ref}`` (so the last axis
  of any rank is ``{"sum": [{"rank": "x"}, -1]}``: IR axes are never negative), ``{"kernel": ref}`` (the spatial size
  ``[kh, kw]`` of a 4-D kernel), ``{"same_pads": ref}`` (``[kh//2, kw//2, kh//2, kw//2]``: "same" padding for a
  stride-1 conv with that kernel), ``{"sum": [e, ...]}``, ``{"prod": [e, ...]}`` (e.g. the rows of a 3-D
  operand flattened to 2-D). Lists may mix literals and expressions.

A target node ``{"op": "Constant", "inputs": [], "attrs": {"value": 1e-5}}`` (value: a literal or a parameter)
makes a new 0-D float32 constant, e.g. BatchNormalization's epsilon when folding it into a Conv; with
``"shape": [...]`` (literals or expressions) it makes a tensor filled with the value, e.g. the ``(C, 1, 3, 3)``
kernel of 1/9 that computes a 3x3 average pooling as a depthwise Conv.
A node with several outputs says how many: ``"outputs": 2``. ``constraints.const`` lists variables that must be
bound to static values: constants (weights) or values computed from constants only (a reshaped or concatenated
weight), which are folded into constants after optimisation. ``constraints.no_broadcast: true`` restricts every
op that broadcasts (``OpDef.broadcasting``: Add, Sub, Mul, Div, Pow), on either side, to inputs of one shape: the
generator's element-wise ops never broadcast, and some of its identities hold only without it (a conv is
distributive over the sum of two kernels of one shape, not over a kernel broadcast along its spatial axes); the
generator adds it to a rule that fails verification without it and passes with it, and the matcher, the e-matcher
and the verifier all enforce it. ``constraints.min_opset`` (an integer) makes the rule apply only to
graphs whose ``opset`` is at least that: a target op ONNX defines from that opset on (the fused
``Attention`` of opset 23) is only put into a graph that may hold it (``rlflow optimize --opset`` raises a
graph's opset). ``verified`` records how the rule was checked; for
a generated rule its ``ranks`` (variable -> rank, or list of ranks) are the only ranks the matcher binds, since
the rule was verified at those alone (builtin rules are written, and tested, for every rank); a variable recorded
as ``{"min": 2}`` is *rank-general*: the generator verified the rule with its activations at ranks 2, 3 and 4
(``verified.rank_general``: the ranks tried and passed, see :func:`rlflow.rewrite.verify.verify_rank_general`), and
the matchers bind it at any rank from 2 up (:func:`bound_ranks`, read by the rewrite matcher, eqsat's e-matcher
and pruning).
"""

from __future__ import annotations

import gzip
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Container, Mapping, Sequence  # not typing's: isinstance is 10x slower
from typing import Any

import numpy as np

from rlflow.errors import RLFlowError
from rlflow.graph.builder import GraphBuilder
from rlflow.graph.ir import Graph, TensorType, _canonical
from rlflow.graph.ops import OPS

FORMAT = 1
#: the lowest rank a rank-general variable binds (``verified.ranks``: ``{"min": 2}``): the generator's activations
#: are 2-D to 4-D; a 1-D value is a bias or a scale vector, and binding those gave the searches rewrites such as
#: ``(x + bias) * gamma -> x * gamma + bias * gamma`` (eqsat on bert 3% worse within its limits)
MIN_GENERAL_RANK = 2
_REF = re.compile(r"%(\d+)(?:\.(\d+))?$")
_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")
_EXPR_KEYS = {"dim", "rank", "kernel", "same_pads", "sum", "prod"}

#: the rule generator's variable kinds: name prefix -> (symbolic shape, is a weight); a generated rule's variables
#: are named prefix + number (``x0``, ``k1``). TASO's symbolic inputs (4x1x3x3 left out: no grouped convolutions
#: among the generator's templates).
VARIABLE_KINDS: dict[str, tuple[tuple[int, ...], bool]] = {
    "x": ((2, 4), False),          # 2-D activation
    "w": ((4, 4), True),           # 2-D weight
    "a": ((2, 4, 5, 5), False),    # 4-D activation (N, C, H, W)
    "k": ((4, 4, 3, 3), True),     # 3x3 conv kernel
    "h": ((4, 4, 1, 3), True),     # 1x3 conv kernel
    "v": ((4, 4, 3, 1), True),     # 3x1 conv kernel
    "p": ((4, 4, 1, 1), True),     # 1x1 conv kernel
    "s": ((), True),               # 0-D scalar
    "b": ((2, 3, 4), False),       # 3-D activation (batch, sequence, hidden): transformer MatMuls
}


@dataclass(frozen=True)
class PatternNode:
    op: str
    inputs: tuple[str, ...]
    attrs: Mapping[str, Any]
    n_outputs: int = 1

    def to_json(self) -> dict:
        d = {"op": self.op, "inputs": list(self.inputs), "attrs": _to_json_value(self.attrs)}
        if self.n_outputs != 1:
            d["outputs"] = self.n_outputs
        return d


@dataclass(frozen=True)
class Rule:
    id: str
    name: str
    origin: str                                   # "generated" | "builtin"
    src: tuple[PatternNode, ...]
    dst: tuple[PatternNode, ...]
    outputs: tuple[tuple[str, str], ...]          # (source ref, target ref)
    constraints: Mapping[str, Any] = field(default_factory=dict)
    verified: Mapping[str, Any] = field(default_factory=dict)

    @property
    def variables(self) -> tuple[str, ...]:
        """The source side's variables, in order of first use."""
        seen: dict[str, None] = {}
        for n in self.src:
            for r in n.inputs:
                if not r.startswith("%"):
                    seen.setdefault(r, None)
        return tuple(seen)

    @property
    def const_vars(self) -> frozenset[str]:
        return frozenset(self.constraints.get("const", ()))

    @property
    def no_broadcast(self) -> bool:
        return bool(self.constraints.get("no_broadcast", False))

    @property
    def rank_general_vars(self) -> frozenset[str]:
        """The variables of a generated rule that bind values of any rank from some rank up (``verified.ranks``
        records ``{"min": rank}``)."""
        ranks = self.verified.get("ranks") or {}
        return frozenset(v for v, r in ranks.items() if _is_min_rank(r)) if self.origin == "generated" else frozenset()

    @property
    def min_opset(self) -> int:
        """The lowest ONNX opset a graph must declare for the rule to apply (``constraints.min_opset``; 0: any):
        a target op the standard defines only from that opset on (``Attention``: 23)."""
        return int(self.constraints.get("min_opset", 0))

    def to_json(self) -> dict:
        d = {"id": self.id, "name": self.name, "origin": self.origin,
             "src": [n.to_json() for n in self.src], "dst": [n.to_json() for n in self.dst],
             "outputs": [list(p) for p in self.outputs]}
        if self.constraints:
            d["constraints"] = _to_json_value(self.constraints)
        d["verified"] = _to_json_value(self.verified)
        return d


def _is_min_rank(r: Any) -> bool:
    return isinstance(r, Mapping) and set(r) == {"min"}


def bound_ranks(rule: Rule) -> dict[str, Container[int]]:
    """The ranks the matchers may bind each variable of ``rule`` to: a generated rule's ``verified.ranks`` (a rank, a
    list of ranks, or ``{"min": k}`` for a rank-general variable: rank k and up); a variable not in the result binds
    any rank (every variable of a builtin rule, written and tested for every rank). The one reading of rank
    constraints: the rewrite matcher and eqsat's e-matcher call it."""
    if rule.origin != "generated":
        return {}
    ranks = rule.verified.get("ranks") or {}
    return {v: range(r["min"], 1 << 16) if _is_min_rank(r) else frozenset(r if isinstance(r, list) else [r])
            for v, r in ranks.items()}


def _to_json_value(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _to_json_value(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return [_to_json_value(x) for x in v]
    return v


# ================================================================================================ expressions
def is_param(v: Any) -> bool:
    return isinstance(v, str) and v.startswith("$")


def eval_attr(expr: Any, type_of: Callable[[str], TensorType], params: Mapping[str, Any]) -> Any:
    """The concrete attribute value of ``expr`` given the matched values' types and the bound parameters.
    Lists become tuples (the IR's form)."""
    if is_param(expr):
        return params[expr[1:]]
    if isinstance(expr, Mapping):
        (key, arg), = expr.items()
        if key == "dim":
            shape = type_of(arg[0]).shape
            if not -len(shape) <= arg[1] < len(shape):  # no such axis: the pattern does not fit (a shape failure)
                raise RLFlowError(f"{arg[0]} of rank {len(shape)} has no axis {arg[1]}")
            return int(shape[arg[1]])
        if key == "rank":
            return type_of(arg).rank
        if key == "kernel":
            return tuple(int(d) for d in type_of(arg).shape[2:4])
        if key == "same_pads":
            kh, kw = type_of(arg).shape[2:4]
            return (kh // 2, kw // 2, kh // 2, kw // 2)
        if key == "sum":
            return sum(eval_attr(e, type_of, params) for e in arg)
        if key == "prod":
            return int(np.prod([eval_attr(e, type_of, params) for e in arg], dtype=np.int64))
        raise KeyError(key)
    if isinstance(expr, (list, tuple)):
        return tuple(eval_attr(e, type_of, params) for e in expr)
    return expr


def attr_equal(a: Any, b: Any) -> bool:
    """Attribute equality as the IR's canonical hash sees it (floats at float32 precision, lists as tuples)."""
    t = type(a)
    if t is type(b):                     # the matcher's common cases
        if t is int or t is str or t is bool:
            return a == b                # their canonical form is the value itself
        if t is tuple:                   # equal values have equal canonical forms; else element by element
            return a == b or (len(a) == len(b) and all(attr_equal(x, y) for x, y in zip(a, b)))
    return _canonical(_tuplify(a)) == _canonical(_tuplify(b))


def _tuplify(v: Any) -> Any:
    return tuple(_tuplify(x) for x in v) if isinstance(v, (list, tuple)) else v


# ================================================================================================ parsing
def _parse_node(raw: Any, side: str, k: int, where: str) -> PatternNode:
    if not isinstance(raw, Mapping):
        raise RLFlowError(f"{where}: {side}[{k}] is not an object")
    op = raw.get("op")
    if op == "Constant" and side == "dst":
        attrs = raw.get("attrs", {})
        value = attrs.get("value")
        if raw.get("inputs", []) != [] or not {"value"} <= set(attrs) <= {"value", "shape"} or not (
                is_param(value) or isinstance(value, (int, float))) or not isinstance(attrs.get("shape", []), list):
            raise RLFlowError(f"{where}: {side}[{k}] (Constant) needs no inputs and attrs "
                              f"{{'value': number or $param, 'shape': optional list}}")
        for e in attrs.get("shape", []):
            _check_expr(e, f"{where}: {side}[{k}] (Constant) shape")
        return PatternNode("Constant", (), {"value": value, "shape": _tuplify(attrs.get("shape", []))})
    if op not in OPS:
        raise RLFlowError(f"{where}: {side}[{k}] has unknown op {op!r}")
    inputs = raw.get("inputs")
    if not isinstance(inputs, list) or not all(isinstance(r, str) for r in inputs):
        raise RLFlowError(f"{where}: {side}[{k}] ({op}) needs 'inputs', a list of references")
    attrs = raw.get("attrs", {})
    if not isinstance(attrs, Mapping):
        raise RLFlowError(f"{where}: {side}[{k}] ({op}) 'attrs' must be an object")
    want = set(OPS[op].attrs)
    if set(attrs) != want:
        missing, extra = sorted(want - set(attrs)), sorted(set(attrs) - want)
        raise RLFlowError(f"{where}: {side}[{k}] ({op}) " + (f"lacks attribute '{missing[0]}'" if missing else
                                                            f"has unknown attribute '{extra[0]}'"))
    n_out = raw.get("outputs", 1)
    if not isinstance(n_out, int) or n_out < 1:
        raise RLFlowError(f"{where}: {side}[{k}] ({op}) 'outputs' must be a positive integer")
    unknown = set(raw) - {"op", "inputs", "attrs", "outputs"}
    if unknown:
        raise RLFlowError(f"{where}: {side}[{k}] ({op}) has unknown key '{sorted(unknown)[0]}'")
    for name, v in attrs.items():
        _check_expr(v, f"{where}: {side}[{k}] ({op}) attribute '{name}'")
    return PatternNode(op, tuple(inputs), {a: _tuplify(v) if not isinstance(v, Mapping) else v
                                           for a, v in attrs.items()}, n_out)


def _check_expr(v: Any, where: str) -> None:
    if isinstance(v, Mapping):
        if len(v) != 1 or next(iter(v)) not in _EXPR_KEYS:
            raise RLFlowError(f"{where}: unknown expression {json.dumps(v)} (use one of {sorted(_EXPR_KEYS)})")
        (key, arg), = v.items()
        if key == "dim" and not (isinstance(arg, list) and len(arg) == 2 and isinstance(arg[0], str)
                                 and isinstance(arg[1], int)):
            raise RLFlowError(f"{where}: 'dim' takes [reference, axis]")
        if key in ("rank", "kernel", "same_pads") and not isinstance(arg, str):
            raise RLFlowError(f"{where}: '{key}' takes a reference")
        if key in ("sum", "prod"):
            if not isinstance(arg, list):
                raise RLFlowError(f"{where}: '{key}' takes a list")
            for e in arg:
                _check_expr(e, where)
    elif isinstance(v, list):
        for e in v:
            _check_expr(e, where)
    elif not isinstance(v, (int, float, str, bool)) or v is None:
        raise RLFlowError(f"{where}: value {v!r} is not a literal, parameter or expression")


def expr_refs(v: Any) -> list[str]:
    """The references inside an attribute expression (``dim``, ``rank``, ``kernel``, ``same_pads``, ``sum``,
    ``prod``)."""
    if isinstance(v, Mapping):
        (key, arg), = v.items()
        if key == "dim":
            return [arg[0]]
        if key in ("rank", "kernel", "same_pads"):
            return [arg]
        return [r for e in arg for r in expr_refs(e)]
    if isinstance(v, (list, tuple)):
        return [r for e in v for r in expr_refs(e)]
    return []


def _expr_params(v: Any) -> list[str]:
    if is_param(v):
        return [v[1:]]
    if isinstance(v, Mapping):
        (_, arg), = v.items()
        return _expr_params(arg) if isinstance(arg, list) else []
    if isinstance(v, (list, tuple)):
        return [p for e in v for p in _expr_params(e)]
    return []


def _check_refs(nodes: Sequence[PatternNode], side: str, variables: set[str], where: str) -> None:
    """Every reference names an earlier node's output or a variable (a source-pattern input)."""

    def check(ref: str, k: int, what: str) -> None:
        m = _REF.match(ref)
        if m:
            j, out = int(m.group(1)), int(m.group(2) or 0)
            if j >= k:
                raise RLFlowError(f"{where}: {side}[{k}] {what} '{ref}' refers to a node that is not before it")
            if out >= nodes[j].n_outputs:
                raise RLFlowError(f"{where}: {side}[{k}] {what} '{ref}': {side}[{j}] has {nodes[j].n_outputs} output(s)")
        elif not _VAR.match(ref):
            raise RLFlowError(f"{where}: {side}[{k}] {what} '{ref}' is not a reference (%k, %k.j or a name)")
        elif ref not in variables:
            raise RLFlowError(f"{where}: {side}[{k}] {what} '{ref}' is not a variable of the source pattern")

    for k, n in enumerate(nodes):
        for r in n.inputs:
            check(r, k, "input")
        for a, v in n.attrs.items():
            for r in expr_refs(v):
                check(r, k, f"attribute '{a}' reference")


def rule_from_json(raw: Any, where: str = "rules.json") -> Rule:
    """Parse and validate one rule; errors are one line naming the rule id and the problem."""
    if not isinstance(raw, Mapping):
        raise RLFlowError(f"{where}: a rule is not an object")
    rid = raw.get("id")
    if not isinstance(rid, str) or not rid:
        raise RLFlowError(f"{where}: a rule has no 'id'")
    at = f"{where}: rule '{rid}'"
    for key in ("name", "origin", "src", "dst", "outputs", "verified"):
        if key not in raw:
            raise RLFlowError(f"{at}: missing '{key}'")
    unknown = set(raw) - {"id", "name", "origin", "src", "dst", "outputs", "constraints", "verified"}
    if unknown:
        raise RLFlowError(f"{at}: unknown key '{sorted(unknown)[0]}'")
    if raw["origin"] not in ("generated", "builtin"):
        raise RLFlowError(f"{at}: 'origin' must be 'generated' or 'builtin', not {raw['origin']!r}")
    if not isinstance(raw["src"], list) or not raw["src"] or not isinstance(raw["dst"], list):
        raise RLFlowError(f"{at}: 'src' must be a non-empty list of nodes and 'dst' a list")
    src = tuple(_parse_node(n, "src", k, at) for k, n in enumerate(raw["src"]))
    dst = tuple(_parse_node(n, "dst", k, at) for k, n in enumerate(raw["dst"]))
    variables = {r for n in src for r in n.inputs if not r.startswith("%")}
    _check_refs(src, "src", variables, at)
    _check_refs(dst, "dst", variables, at)
    bound = {p for n in src for v in n.attrs.values() for p in _expr_params(v)}
    for k, n in enumerate(dst):
        for a, v in n.attrs.items():
            for p in _expr_params(v):
                if p not in bound:
                    raise RLFlowError(f"{at}: dst[{k}] ({n.op}) attribute '{a}' uses parameter '${p}', "
                                      f"which the source pattern does not bind")
    outs = raw["outputs"]
    if not isinstance(outs, list) or not outs or not all(isinstance(p, list) and len(p) == 2 for p in outs):
        raise RLFlowError(f"{at}: 'outputs' must be a non-empty list of [source ref, target ref] pairs")
    for s, d in outs:
        for ref, nodes, side in ((s, src, "src"), (d, dst, "dst")):
            m = _REF.match(str(ref))
            if m:
                j, o = int(m.group(1)), int(m.group(2) or 0)
                if j >= len(nodes) or o >= nodes[j].n_outputs:
                    raise RLFlowError(f"{at}: output {side} reference '{ref}' names no {side} node output")
            elif side == "src" or ref not in variables:
                raise RLFlowError(f"{at}: output {side} reference '{ref}' must be a {side} node output"
                                  + ("" if side == "src" else " or a source variable"))
    if len({s for s, _ in outs}) != len(outs):
        raise RLFlowError(f"{at}: a source output is mapped twice")
    constraints = raw.get("constraints", {})
    if not isinstance(constraints, Mapping) or set(constraints) - {"const", "no_broadcast", "min_opset"}:
        raise RLFlowError(f"{at}: 'constraints' may only hold 'const' (a list of variables), 'no_broadcast' "
                          f"(true or false) and 'min_opset' (an integer)")
    if not isinstance(constraints.get("no_broadcast", False), bool):
        raise RLFlowError(f"{at}: constraint no_broadcast must be true or false")
    m_op = constraints.get("min_opset", 0)
    if isinstance(m_op, bool) or not isinstance(m_op, int) or m_op < 0:
        raise RLFlowError(f"{at}: constraint min_opset must be a non-negative integer, not {m_op!r}")
    for v in constraints.get("const", []):
        if v not in variables:
            raise RLFlowError(f"{at}: constraint const names '{v}', which is not a variable")
    verified = raw["verified"]
    if not isinstance(verified, Mapping) or "method" not in verified or "trials" not in verified:
        raise RLFlowError(f"{at}: 'verified' must record at least 'method' and 'trials'")
    return Rule(rid, str(raw["name"]), raw["origin"], src, dst, tuple((str(s), str(d)) for s, d in outs),
                dict(constraints), dict(verified))


# ================================================================================================ files
#: the rule set shipped with the package: what the generate_rules stage makes from config.yaml's rules section,
#: gzipped (``make default-rules`` remakes it; a test checks it equals a fresh generation)
DEFAULT_RULES = Path(__file__).resolve().parent / "data" / "default_rules.json.gz"


def load_rules(path: str | os.PathLike = DEFAULT_RULES) -> list[Rule]:
    """Read a rules file (``rules.json``, or gzipped JSON when the name ends in ``.gz``); without a path, the
    default rule set shipped with the package. A malformed or hand-edited file is a one-line error naming the
    rule and problem."""
    p = Path(path)
    if not p.is_file():
        raise RLFlowError(f"{p}: no such rules file (make one with `rlflow generate-rules`)")
    try:
        text = gzip.decompress(p.read_bytes()).decode() if p.suffix == ".gz" else p.read_text()
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RLFlowError(f"{p}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:  # gzip.BadGzipFile is an OSError
        raise RLFlowError(f"{p}: not a rules file ({e})") from None
    if not isinstance(data, Mapping) or data.get("format") != FORMAT or not isinstance(data.get("rules"), list):
        raise RLFlowError(f"{p}: not a rules file of format {FORMAT} (needs 'format': {FORMAT} and a 'rules' list)")
    rules, seen = [], set()
    for raw in data["rules"]:
        rule = rule_from_json(raw, str(p))
        if rule.id in seen:
            raise RLFlowError(f"{p}: rule '{rule.id}': the id is used twice")
        seen.add(rule.id)
        rules.append(rule)
    return rules


def rules_document(rules: Sequence[Rule], generator: Mapping[str, Any]) -> dict:
    return {"format": FORMAT, "generator": dict(generator), "rules": [r.to_json() for r in rules]}


# ================================================================================================ instances
def broadcasts(op: str, in_types: Sequence[TensorType]) -> bool:
    """Does a node of ``op`` reading ``in_types`` broadcast (an ``OpDef.broadcasting`` op, inputs of different
    shapes)? A rule with ``constraints.no_broadcast`` binds no such node, on either side."""
    return op in OPS and OPS[op].broadcasting and len({t.shape for t in in_types}) > 1


def instantiate(rule: Rule, side: str, var_types: Mapping[str, TensorType], params: Mapping[str, Any] | None = None,
                constants: Mapping[str, Any] | None = None) -> Graph:
    """One side of ``rule`` as a graph over its variables (graph inputs, or constants where ``constants`` gives
    their arrays). Its outputs are the side's mapped values, in the order of ``rule.outputs``. Raises
    RLFlowError (a ShapeError) when the shapes do not fit the pattern."""
    nodes = rule.src if side == "src" else rule.dst
    b = GraphBuilder(f"{rule.id}-{side}")
    refs: dict[str, str] = {}
    for v in rule.variables:
        if constants and v in constants:
            refs[v] = b.const(v, constants[v])
        elif v in var_types:
            refs[v] = b.input(v, var_types[v].shape, var_types[v].dtype)
    type_of = lambda r: b.types[refs[r]]  # noqa: E731
    for k, n in enumerate(nodes):
        attrs = {a: eval_attr(e, type_of, params or {}) for a, e in n.attrs.items()}
        if n.op == "Constant":
            refs[f"%{k}"] = refs[f"%{k}.0"] = b.const(f"{side}{k}", constant_array(attrs))
            continue
        if rule.no_broadcast and broadcasts(n.op, [b.types[refs[r]] for r in n.inputs]):
            raise RLFlowError(f"rule '{rule.id}' {side}[{k}] ({n.op}) would broadcast, and the rule has the "
                              f"no_broadcast constraint")
        outs = b.op(n.op, [refs[r] for r in n.inputs], n_outputs=n.n_outputs, name=f"{side}{k}", **attrs)
        for j, o in enumerate(outs if n.n_outputs > 1 else [outs]):
            refs[f"%{k}.{j}"] = o
            if j == 0:
                refs[f"%{k}"] = o
    return b.build([refs[s if side == "src" else d] for s, d in rule.outputs])


def constant_array(attrs: Mapping[str, Any]) -> np.ndarray:
    """The tensor a target ``Constant`` node makes, from its evaluated attributes."""
    return np.full(tuple(attrs.get("shape", ())), attrs["value"], np.float32)

