"""TASO's substitution generator, written here from the paper's description.

**Enumeration.** Every graph of 1..``max_ops`` operators is built depth-first over a fixed pool of *symbolic
input* variables (TASO's shapes: 2-D activations ``x*`` 2x4, 2-D weights ``w*`` 4x4, 4-D activations ``a*``
2x4x5x5, conv kernels ``k*`` 4x4x3x3, ``h*`` 4x4x1x3, ``v*`` 4x4x3x1, ``p*`` 4x4x1x1, a 0-D scalar ``s*``; and,
beyond TASO, 3-D activations ``b*`` 2x3x4 for transformer MatMuls) and the operator templates of
:data:`TEMPLATES`. Each new operator takes its inputs from the pool and from the outputs of the operators before
it, where the shapes fit; it is kept only when

- its output has at most ``max_elements`` (512) elements;
- it is not a *duplicate op* (same op, attributes and inputs as an earlier one) -- inputs of commutative ops
  (Add, Mul) are put in canonical order first -- and it does not read one value twice (``x + x``, ``concat(x,
  x)``: their identities are scalings or specialisations of the general ones);
- the operator sequence stays in *canonical topological order* (each graph is built in one order only: the
  smallest-key-first topological order, checked incrementally when an op is appended);
- variables of each kind are used in index order (``x0`` before ``x1``): graphs equal up to renaming are built
  once; the pairing step below tries the renamings.

An op whose output duplicates an existing tensor (e.g. the second Transpose of ``transpose(transpose(x))``) ends
its branch: the graph is recorded (as a possible *source* of a substitution whose target is smaller) but never
extended or used as a target. A graph is recorded when it is connected (through shared values) or is two
independent instances of one op (same op and attribute values: the source of a batching merge, ``relu(a),
relu(b) -> split(relu(concat(a, b)))``), has 1 to ``max_outputs`` outputs, and reads at least one activation (a
graph of weights only computes a constant, which constant folding does after a search).

**Fingerprint.** Each tensor is evaluated on random int64 data (numpy, wrapping arithmetic: a ring, so the
polynomial identities that matter hold exactly and unequal polynomials differ with overwhelming probability).
ReLU is modelled by TASO's non-linear integer function ``x*(x+1)+1`` so it never coincides with a linear op;
average pooling by the window sum (its 1/9 scale is the same on both sides of any identity among these
templates); max pooling exactly. A graph's fingerprint is the set of (shape, values) hashes of its outputs: the
tensors no op of the graph consumes (at most ``max_outputs``, TASO's 2). Graphs with equal fingerprints under
some renaming of their variables are *candidate substitutions*, in both directions (a graph and a renaming of
itself too: that is associativity); the empty graph (outputs = variables) is a target too, so
``split(concat(x, y)) -> x, y`` and ``transpose(transpose(x)) -> x`` are found.

**Shape-dependent attributes are expressions** over the pattern's values, never the symbolic sizes: a Split's
sizes are ``[{"dim": [p, axis]}, {"dim": [q, axis]}]`` where ``p``/``q`` are the values the split boundary came
from (a Concat's inputs, tracked through MatMul, Conv, element-wise ops and Transpose as TASO's split trees
are), a Conv's padding is ``{"same_pads": w}`` and an Enlarge's target size ``{"kernel": w'}``. So a rule found
on 2x4 tensors applies to graphs of any size; the verifier (:mod:`rlflow.rewrite.verify`) checks that at other
sizes (each variable at the rank it was found at: ranks are part of a verified rule). A rule that also holds with
its activations at other ranks (all at 2, 3 or 4, one at a time and mixed;
:func:`rlflow.rewrite.verify.verify_rank_general`) is *rank-general*: its activations' ranks are recorded as
``{"min": 2}`` and the matchers bind them at any rank from 2 up, so
the elementwise rule found on 2-D ``x`` also serves 3-D ``b`` and 4-D ``a`` values, and the whole-set pruning drops
its copies found at those ranks.

**Constants.** TASO's identity matrix and identity kernel are left out: the rule format can neither constrain
a source variable to a particular constant nor make a non-filled constant in a target, so ``x -> matmul(x, I)``
cannot be written as data. Its pooling kernel and ones are filled tensors, which a target can make but a source
cannot match; the substitutions TASO uses them for (average pooling as a convolution with the pooling kernel)
are builtin rules (:mod:`rlflow.rewrite.builtin`).

Variables that are weights (``w``, ``k``, ``h``, ``v``, ``p``, ``s``) are listed in ``constraints.const``: such a
rule only matches constant (static) values, as TASO's weight tensors. Ops that model activations (Relu, pooling,
a Conv's data input) only take values that depend on an activation; a Conv's kernel and an Enlarge's input only
take weight-only values; a Concat joins two activations or two weights, not one of each.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from rlflow.rewrite.rule import VARIABLE_KINDS, expr_refs

# ================================================================================================ configuration
KIND_ORDER = {k: i for i, k in enumerate(VARIABLE_KINDS)}

#: operator templates (``Conv`` and ``ConvRelu`` are the IR op Conv with activation none / relu)
TEMPLATES = ("MatMul", "Add", "Mul", "Conv", "ConvRelu", "AveragePool", "MaxPool", "Relu", "Concat", "Split",
             "Transpose", "ScalarMul", "Enlarge")
#: Concat / Split axes by rank: TASO's 0 and 1 for 2-D and 4-D; a 3-D (batch, sequence, hidden) value also
#: on its hidden axis, where merged transformer MatMuls are split
CONCAT_AXES = {2: (0, 1), 3: (0, 1, 2), 4: (0, 1)}

#: four activations per rank: ``concat(x0, x1) + concat(x2, x3) -> concat(x0 + x2, x1 + x3)`` and concatenations
#: re-nested along the other axis need four distinct operands of one rank
DEFAULT_VARIABLES = {"x": 4, "w": 2, "a": 4, "k": 2, "h": 1, "v": 1, "p": 1, "s": 1, "b": 4}


@dataclass
class GeneratorConfig:
    """What the generator enumerates (config keys ``rules.*``)."""

    max_ops: int = 3
    """Largest number of operators in a source or target graph (TASO: 3)."""
    max_outputs: int = 2
    """Most outputs (values no op of the graph consumes) a graph may have: TASO's 2 mapped outputs."""
    max_elements: int = 512
    """Largest tensor (elements) an op may produce on the symbolic inputs (TASO: 512)."""
    ops: tuple[str, ...] = TEMPLATES
    """Operator templates to enumerate (a subset of :data:`TEMPLATES`)."""
    variables: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_VARIABLES))
    """How many variables of each kind (:data:`VARIABLE_KINDS`) the graphs may use."""
    seed: int = 0
    """Seed of the fingerprint data."""

    def to_json(self) -> dict:
        return {"max_ops": self.max_ops, "max_outputs": self.max_outputs, "max_elements": self.max_elements,
                "ops": list(self.ops), "variables": dict(self.variables), "seed": self.seed}


# ================================================================================================ int64 semantics
I64_MIN = np.iinfo(np.int64).min


def _relu_model(x):
    return x * (x + 1) + 1                          # TASO's non-linear integer stand-in for ReLU


def _pad_hw(x, ph: int, pw: int, value=0):
    """x [N, C, H, W] with ph rows and pw columns of ``value`` on each side (np.pad's constant mode, without its
    per-call overhead: the generator pads hundreds of thousands of small tensors)."""
    n, c, h, w = x.shape
    out = np.full((n, c, h + 2 * ph, w + 2 * pw), value, dtype=x.dtype)
    out[:, :, ph:ph + h, pw:pw + w] = x
    return out


def _conv(x, w, relu):
    kh, kw = w.shape[2], w.shape[3]
    xp = _pad_hw(x, kh // 2, kw // 2)
    win = sliding_window_view(xp, (kh, kw), axis=(2, 3))            # N, C, H, W, kh, kw
    y = np.tensordot(win, w, axes=([1, 4, 5], [1, 2, 3])).transpose(0, 3, 1, 2)
    y = np.ascontiguousarray(y)
    return _relu_model(y) if relu else y


def _pool(x, kind):
    if kind == "max":
        xp = _pad_hw(x, 1, 1, I64_MIN)
        return np.ascontiguousarray(sliding_window_view(xp, (3, 3), axis=(2, 3)).max(axis=(-2, -1)))
    xp = _pad_hw(x, 1, 1)
    return np.ascontiguousarray(sliding_window_view(xp, (3, 3), axis=(2, 3)).sum(axis=(-2, -1)))


def _enlarge(w, kernel):
    dh, dw = (kernel[0] - w.shape[2]) // 2, (kernel[1] - w.shape[3]) // 2
    return _pad_hw(w, dh, dw)


def evaluate(op: str, nattrs: Mapping[str, Any], xs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The fingerprint semantics of one op (int64, wrapping)."""
    if op == "MatMul":
        return [np.matmul(xs[0], xs[1])]
    if op == "Add":
        return [xs[0] + xs[1]]
    if op == "Mul" or op == "ScalarMul":
        return [xs[0] * xs[1]]
    if op == "Conv":
        return [_conv(xs[0], xs[1], nattrs["activation"] == "relu")]
    if op == "AveragePool":
        return [_pool(xs[0], "avg")]
    if op == "MaxPool":
        return [_pool(xs[0], "max")]
    if op == "Relu":
        return [_relu_model(xs[0])]
    if op == "Concat":
        return [np.concatenate(xs, axis=nattrs["axis"])]
    if op == "Split":
        n0 = nattrs["split"][0]
        a, b = np.split(xs[0], [n0], axis=nattrs["axis"])
        return [np.ascontiguousarray(a), np.ascontiguousarray(b)]
    if op == "Transpose":
        return [np.ascontiguousarray(xs[0].transpose(nattrs["perm"]))]
    if op == "Enlarge":
        return [_enlarge(xs[0], nattrs["kernel"])]
    raise KeyError(op)


def tensor_hash(a: np.ndarray) -> int:
    """A deterministic 64-bit hash of a tensor's shape and values (the same in every process)."""
    h = hashlib.blake2b(repr(a.shape).encode(), digest_size=8)
    h.update(a.tobytes())
    return int.from_bytes(h.digest(), "little")


# ================================================================================================ graphs
@dataclass(frozen=True, slots=True)
class GOp:
    """One operator of an enumerated graph. ``inputs`` and the references inside ``pattrs`` (the rule-format
    attributes, with expressions) are pattern references: variable names or ``%k`` / ``%k.j``."""

    op: str                      # IR op
    inputs: tuple[str, ...]
    pattrs: tuple[tuple[str, Any], ...]     # sorted (name, JSON-able value)
    nattrs: tuple[tuple[str, Any], ...]     # sorted (name, concrete value at the symbolic shapes)
    n_out: int
    key: tuple

    def pattern(self) -> dict:
        d = {"op": self.op, "inputs": list(self.inputs), "attrs": {k: _jsonable(v) for k, v in self.pattrs}}
        if self.n_out != 1:
            d["outputs"] = self.n_out
        return d


def _jsonable(v):
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


@dataclass(slots=True)
class GGraph:
    """An enumerated graph: ops in canonical order, its outputs (refs, in canonical order) and their hashes."""

    ops: tuple[GOp, ...]
    outputs: tuple[str, ...]
    out_hashes: tuple[int, ...]
    variables: tuple[str, ...]          # input variables, in first-use order
    redundant: bool                     # some op reproduces an existing tensor: a source only, never a target


_REF_CACHE: dict[str, tuple[int, int] | None] = {}


def parse_ref(r: str) -> tuple[int, int] | None:
    """``"%k"`` -> (k, 0), ``"%k.j"`` -> (k, j), a variable name -> None."""
    got = _REF_CACHE.get(r, False)
    if got is not False:
        return got
    if r.startswith("%"):
        k, _, j = r[1:].partition(".")
        got = (int(k), int(j or 0))
    else:
        got = None
    _REF_CACHE[r] = got
    return got


def rename_expr(v: Any, f: Callable[[str], str]) -> Any:
    if isinstance(v, dict):
        (key, arg), = v.items()
        if key == "dim":
            return {"dim": (f(arg[0]), arg[1])}
        if key in ("kernel", "same_pads", "rank"):
            return {key: f(arg)}
        return {key: tuple(rename_expr(e, f) for e in arg)}
    if isinstance(v, (list, tuple)):
        return tuple(rename_expr(e, f) for e in v)
    return v


def run_graph(ops: Sequence[GOp], env: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Evaluate ``ops`` (fingerprint semantics) with ``env`` holding the variables; returns env with every
    ``%k`` / ``%k.j`` added."""
    env = dict(env)
    for k, o in enumerate(ops):
        outs = evaluate(o.op, dict(o.nattrs), [env[r] for r in o.inputs])
        env[f"%{k}"] = outs[0]
        for j, a in enumerate(outs):
            env[f"%{k}.{j}"] = a
    return env


# ================================================================================================ enumeration
class _T:
    """A tensor during enumeration."""

    __slots__ = ("ref", "shape", "val", "h", "act", "split", "okey", "var", "node")

    def __init__(self, ref, shape, val, act, split, okey, var=None, node=-1):
        self.ref, self.shape, self.val, self.act, self.split = ref, shape, val, act, split
        self.h = tensor_hash(val)
        self.okey, self.var, self.node = okey, var, node


def _size(shape) -> int:
    return math.prod(shape)


class Enumerator:
    """Depth-first enumeration of every canonical graph (see the module docstring)."""

    def __init__(self, cfg: GeneratorConfig, progress: Callable[[int], None] | None = None):
        self.cfg = cfg
        self.ops_allowed = frozenset(cfg.ops)
        unknown = self.ops_allowed - set(TEMPLATES)
        if unknown:
            raise ValueError(f"unknown operator template(s) {sorted(unknown)}")
        self.rng = np.random.default_rng(cfg.seed)
        self.pool: list[_T] = []
        self.data: dict[str, np.ndarray] = {}
        self.kind_vars: dict[str, list[_T]] = {}
        for kind, (shape, weight) in VARIABLE_KINDS.items():
            n = int(cfg.variables.get(kind, 0))
            self.kind_vars[kind] = []
            for i in range(n):
                name = f"{kind}{i}"
                val = self.rng.integers(I64_MIN, np.iinfo(np.int64).max, size=shape, dtype=np.int64,
                                        endpoint=True)
                val = np.ascontiguousarray(val)
                t = _T(name, shape, val, not weight, (None,) * len(shape), (0, KIND_ORDER[kind], i), (kind, i))
                self.pool.append(t)
                self.kind_vars[kind].append(t)
                self.data[name] = val
        self.graphs: list[GGraph] = []
        self.visited = 0             # graphs built (every DFS node)
        self.progress = progress

    # -------------------------------------------------------------------------------------------- driving
    def run(self) -> list[GGraph]:
        self.ops: list[GOp] = []
        self.outs: list[list[_T]] = []       # per op, its output tensors
        self.next_var = {k: 0 for k in VARIABLE_KINDS}
        self.used_vars: list[_T] = []
        self._identity_graphs()
        self._dfs()
        return self.graphs

    def _identity_graphs(self) -> None:
        """The empty graphs: one or two variables as outputs (targets like ``split(concat(x, y)) -> x, y``)."""
        for t in self.pool:
            self.graphs.append(GGraph((), (t.ref,), (t.h,), (t.ref,), False))
        if self.cfg.max_outputs >= 2:
            for t, u in itertools.combinations(self.pool, 2):
                self.graphs.append(GGraph((), (t.ref, u.ref), (t.h, u.h), (t.ref, u.ref), False))

    def _available(self) -> list[_T]:
        """Tensors an op may read: used variables, the next two unused ones of each kind, node outputs."""
        avail = list(self.used_vars)
        for kind, vs in self.kind_vars.items():
            i = self.next_var[kind]
            avail.extend(vs[i:i + 2])
        for outs in self.outs:
            avail.extend(outs)
        return avail

    def _dfs(self) -> None:
        depth = len(self.ops)
        for gop, outs in list(self._candidates()):
            # apply
            saved_next = dict(self.next_var)
            n_used = len(self.used_vars)
            for r in list(gop.inputs) + [r for _, v in gop.pattrs for r in expr_refs(v)]:
                if parse_ref(r) is None:
                    kind, i = r[0], int(r[1:])
                    if i == self.next_var[kind]:
                        self.next_var[kind] = i + 1
                        self.used_vars.append(self.kind_vars[kind][i])
            existing = {t.h for t in self.used_vars}
            existing.update(t.h for o in self.outs for t in o)
            redundant = any(t.h in existing for t in outs) or len({t.h for t in outs}) < len(outs)
            self.ops.append(gop)
            self.outs.append(outs)
            self.visited += 1
            if self.progress and self.visited % 2000 == 0:
                self.progress(2000)
            self._record(redundant)
            if not redundant and depth + 1 < self.cfg.max_ops:
                self._dfs()
            # undo
            self.ops.pop()
            self.outs.pop()
            del self.used_vars[n_used:]
            self.next_var = saved_next

    # -------------------------------------------------------------------------------------------- recording
    def _record(self, redundant: bool) -> None:
        ops = self.ops
        consumed: set[str] = set()
        input_vars: list[str] = []
        for o in ops:
            for r in o.inputs:
                p = parse_ref(r)
                if p is None:
                    if r not in input_vars:
                        input_vars.append(r)
                else:
                    consumed.add(f"%{p[0]}.{p[1]}")
        for o in ops:                                 # an expression may only name a variable the graph reads
            for _, v in o.pattrs:
                for r in expr_refs(v):
                    if parse_ref(r) is None and r not in input_vars:
                        return
        outputs, hashes = [], []
        for k, outs in enumerate(self.outs):
            for j, t in enumerate(outs):
                if f"%{k}.{j}" not in consumed:
                    outputs.append(t.ref)
                    hashes.append(t.h)
        if not outputs or len(outputs) > self.cfg.max_outputs:
            return
        if not any(not VARIABLE_KINDS[v[0]][1] for v in input_vars):
            return                                    # weights only: a constant, which folding computes
        if not self._connected() and not self._independent_pair():
            return
        self.graphs.append(GGraph(tuple(ops), tuple(outputs), tuple(hashes), tuple(input_vars), redundant))

    def _connected(self) -> bool:
        n = len(self.ops)
        if n == 1:
            return True
        parent = list(range(n))

        def find(i):
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        seen: dict[str, int] = {}
        for k, o in enumerate(self.ops):
            for r in o.inputs:
                p = parse_ref(r)
                key = r if p is None else f"%{p[0]}"
                if p is not None:
                    parent[find(k)] = find(p[0])
                if key in seen:
                    parent[find(k)] = find(seen[key])
                else:
                    seen[key] = k
        root = find(0)
        return all(find(i) == root for i in range(n))

    def _independent_pair(self) -> bool:
        """Two independent instances of one op (same op and attribute values, no value in common): the source of
        a batching merge such as ``relu(a), relu(b) -> split(relu(concat(a, b)))``. The only disconnected graphs
        recorded: any other pair of unrelated ops has no equivalent graph within ``max_ops``."""
        if len(self.ops) != 2:
            return False
        o, p = self.ops
        return o.op == p.op and o.nattrs == p.nattrs

    # -------------------------------------------------------------------------------------------- candidates
    def _fresh_ok(self, refs: Sequence[_T]) -> bool:
        """Variables must be first used in index order within each kind."""
        nxt = None
        for t in refs:
            if t.var is None:
                continue
            kind, i = t.var
            cur = (nxt or self.next_var)[kind]
            if i > cur:
                return False
            if i == cur:
                if nxt is None:
                    nxt = dict(self.next_var)
                nxt[kind] = i + 1
        return True

    def _candidates(self) -> Iterator[tuple[GOp, list[_T]]]:
        avail = self._available()
        k = len(self.ops)
        existing = {o.key for o in self.ops}
        allowed = self.ops_allowed
        max_el = self.cfg.max_elements
        by_rank: dict[int, list[_T]] = {}
        for t in avail:
            by_rank.setdefault(len(t.shape), []).append(t)
        r2, r3, r4, r0 = by_rank.get(2, []), by_rank.get(3, []), by_rank.get(4, []), by_rank.get(0, [])

        def emit(op, ins, pattrs, nattrs, n_out, out_meta):
            """Build the GOp (canonical checks) and evaluate it. out_meta: list of (shape, act, split)."""
            if not self._fresh_ok(list(ins) + [t for t in _attr_tensors(pattrs, avail)]):
                return None
            for shape, _, _ in out_meta:
                if _size(shape) > max_el:
                    return None
            pa = tuple(sorted(pattrs.items()))
            key = (op, repr(pa), tuple(t.okey for t in ins))
            if key in existing:
                return None
            deps = [t.node for t in ins if t.node >= 0]
            for r in (r for _, v in pa for r in expr_refs(v)):
                p = parse_ref(r)
                if p is not None:
                    deps.append(p[0])
            last = max(deps, default=-1)
            for i in range(last + 1, k):              # canonical (smallest-key-first) topological order
                if not self.ops[i].key < key:
                    return None
            na = tuple(sorted(nattrs.items()))
            vals = evaluate(op, nattrs, [t.val for t in ins])
            outs = []
            for j, (val, (shape, act, split)) in enumerate(zip(vals, out_meta)):
                ref = f"%{k}" if n_out == 1 else f"%{k}.{j}"
                outs.append(_T(ref, shape, val, act, split, (1, k, j), None, k))
            return GOp(op, tuple(t.ref for t in ins), pa, na, n_out, key), outs

        out: list[tuple[GOp, list[_T]]] = []

        def add(res):
            if res is not None:
                out.append(res)

        # ---- MatMul: 2-D @ 2-D, and batched (transformer) 3-D @ 2-D and 3-D @ 3-D with equal batch
        if "MatMul" in allowed:
            for a in r2 + r3:
                for b in r2 + r3:
                    if a is b or a.shape[-1] != b.shape[-2] or (len(b.shape) == 3 and (
                            len(a.shape) != 3 or a.shape[0] != b.shape[0])):
                        continue
                    shape = a.shape[:-1] + (b.shape[-1],)
                    split = a.split[:-1] + (b.split[-1],)      # rows (and batch) from a, columns from b
                    add(emit("MatMul", (a, b), {}, {}, 1, [(shape, a.act or b.act, split)]))
        # ---- element-wise Add / Mul (same shapes; commutative: canonical input order)
        for op in ("Add", "Mul"):
            if op not in allowed:
                continue
            for i, a in enumerate(avail):
                for b in avail[i + 1:]:
                    if a.shape != b.shape or a.shape == ():
                        continue
                    x, y = (a, b) if a.okey <= b.okey else (b, a)
                    split = tuple(sa or sb for sa, sb in zip(x.split, y.split))
                    add(emit(op, (x, y), {}, {}, 1, [(a.shape, a.act or b.act, split)]))
        # ---- Conv (4-D activation, weight-only kernel), same padding, stride 1, with/without fused ReLU
        for tmpl, act_name in (("Conv", "none"), ("ConvRelu", "relu")):
            if tmpl not in allowed:
                continue
            for x in r4:
                if not x.act:
                    continue
                for w in r4:
                    if w.act or w.shape[1] != x.shape[1] or w.shape[2] % 2 == 0 or w.shape[3] % 2 == 0:
                        continue
                    shape = (x.shape[0], w.shape[0], x.shape[2], x.shape[3])
                    pattrs = {"strides": (1, 1), "pads": {"same_pads": w.ref}, "group": 1, "activation": act_name}
                    kh, kw = w.shape[2], w.shape[3]
                    nattrs = {"strides": (1, 1), "pads": (kh // 2, kw // 2, kh // 2, kw // 2), "group": 1,
                              "activation": act_name}
                    add(emit("Conv", (x, w), pattrs, nattrs, 1, [(shape, True, (x.split[0], w.split[0], None, None))]))
        # ---- pooling 3x3, stride 1, same padding; ReLU
        for op in ("AveragePool", "MaxPool", "Relu"):
            if op not in allowed:
                continue
            for x in (r4 if op != "Relu" else avail):
                if not x.act:
                    continue
                if op == "Relu":
                    add(emit("Relu", (x,), {}, {}, 1, [(x.shape, True, x.split)]))
                    continue
                pattrs = {"kernel": (3, 3), "strides": (1, 1), "pads": (1, 1, 1, 1), "ceil_mode": 0}
                if op == "AveragePool":
                    pattrs["count_include_pad"] = 1
                add(emit(op, (x,), pattrs, dict(pattrs), 1, [(x.shape, True, x.split)]))
        # ---- Concat of 2 (axis 0/1; a 3-D value also on its last axis 2)
        if "Concat" in allowed:
            for a in avail:
                if len(a.shape) not in CONCAT_AXES:
                    continue
                for b in by_rank.get(len(a.shape), []):
                    if a is b or a.act != b.act:      # an activation is not concatenated with a weight
                        continue
                    for ax in CONCAT_AXES[len(a.shape)]:
                        if any(da != db for i, (da, db) in enumerate(zip(a.shape, b.shape)) if i != ax):
                            continue
                        shape = a.shape[:ax] + (a.shape[ax] + b.shape[ax],) + a.shape[ax + 1:]
                        split = [None] * len(shape)
                        split[ax] = ({"dim": (a.ref, ax)}, {"dim": (b.ref, ax)}, a.shape[ax], b.shape[ax])
                        add(emit("Concat", (a, b), {"axis": ax}, {"axis": ax}, 1,
                                 [(shape, a.act or b.act, tuple(split))]))
        # ---- Split in 2 at a tracked concat boundary (the Concat axes)
        if "Split" in allowed:
            for x in avail:
                for ax in CONCAT_AXES.get(len(x.shape), ()):
                    if x.split[ax] is None:
                        continue
                    e0, e1, n0, n1 = x.split[ax]
                    s0 = x.shape[:ax] + (n0,) + x.shape[ax + 1:]
                    s1 = x.shape[:ax] + (n1,) + x.shape[ax + 1:]
                    rest = tuple(None if i == ax else s for i, s in enumerate(x.split))
                    add(emit("Split", (x,), {"axis": ax, "split": (e0, e1)}, {"axis": ax, "split": (n0, n1)}, 2,
                             [(s0, x.act, rest), (s1, x.act, rest)]))
        # ---- Transpose: 2-D (1, 0); 3-D (0, 2, 1), the transposed keys of attention
        if "Transpose" in allowed:
            for x in r2 + r3:
                perm = (1, 0) if len(x.shape) == 2 else (0, 2, 1)
                add(emit("Transpose", (x,), {"perm": perm}, {"perm": perm}, 1,
                         [(tuple(x.shape[i] for i in perm), x.act, tuple(x.split[i] for i in perm))]))
        # ---- ScalarMul (x * 0-D scalar variable)
        if "ScalarMul" in allowed:
            for s in r0:
                if s.act:
                    continue
                for x in avail:
                    if x.shape != ():
                        add(emit("ScalarMul", (x, s), {}, {}, 1, [(x.shape, x.act, x.split)]))
        # ---- Enlarge a weight-only kernel to the (larger) kernel size of another 4-D weight value
        if "Enlarge" in allowed:
            for w in r4:
                if w.act:
                    continue
                for t in r4:
                    if t.act or t is w:
                        continue
                    kh, kw = t.shape[2], t.shape[3]
                    dh, dw = kh - w.shape[2], kw - w.shape[3]
                    if dh < 0 or dw < 0 or dh % 2 or dw % 2 or (dh == 0 and dw == 0):
                        continue
                    shape = w.shape[:2] + (kh, kw)
                    add(emit("Enlarge", (w,), {"kernel": {"kernel": t.ref}}, {"kernel": (kh, kw)}, 1,
                             [(shape, False, (w.split[0], w.split[1], None, None))]))
        return iter(out)


def _attr_tensors(pattrs: Mapping[str, Any], avail: Sequence[_T]) -> list[_T]:
    """Variables named inside attribute expressions (they count as uses for the first-use order)."""
    refs = [r for v in pattrs.values() for r in expr_refs(v)]
    if not refs:
        return []
    by_ref = {t.ref: t for t in avail}
    return [by_ref[r] for r in refs if parse_ref(r) is None and r in by_ref]


# ================================================================================================ pairing
@dataclass(frozen=True)
class Candidate:
    """A candidate substitution: ``src`` -> ``dst`` with dst's variables renamed by ``rename``; ``outputs`` maps
    each src output ref to the dst output ref (or variable) with the same fingerprint."""

    src: GGraph
    dst: GGraph
    rename: tuple[tuple[str, str], ...]       # dst variable -> src variable
    outputs: tuple[tuple[str, str], ...]


def renamings(g: GGraph) -> Iterator[dict[str, str]]:
    """Every renaming of ``g``'s variables onto variables of the same kind that ``g`` uses (permutations
    within each kind; the identity first)."""
    by_kind: dict[str, list[str]] = {}
    names = set(g.variables)
    for o in g.ops:
        for _, v in o.pattrs:
            names.update(r for r in expr_refs(v) if parse_ref(r) is None)
    for v in sorted(names, key=lambda n: (KIND_ORDER[n[0]], int(n[1:]))):
        by_kind.setdefault(v[0], []).append(v)
    kinds = list(by_kind.values())
    for perms in itertools.product(*(itertools.permutations(vs) for vs in kinds)):
        m = {}
        for vs, p in zip(kinds, perms):
            m.update(zip(vs, p))
        yield m


def fingerprints(g: GGraph, data: Mapping[str, np.ndarray]) -> Iterator[tuple[tuple[int, ...], dict[str, str],
                                                                           tuple[int, ...]]]:
    """(fingerprint, renaming, output hashes) of ``g`` under each renaming of its variables. The fingerprint
    is the sorted tuple of output hashes (the set of outputs, order-free)."""
    first = True
    for m in renamings(g):
        if first:
            first = False
            hs = g.out_hashes
        else:
            env = {v: data[m[v]] for v in m}       # variable v of g reads the data of m[v]
            env = run_graph(g.ops, env)
            hs = tuple(tensor_hash(env[r]) for r in g.outputs)
        yield tuple(sorted(hs)), m, hs


def pair_candidates(graphs: Sequence[GGraph], data: Mapping[str, np.ndarray],
                    progress: Callable[[int], None] | None = None) -> tuple[list[Candidate], dict]:
    """Group graphs by fingerprint (under every renaming) and pair them: each graph (as built, identity
    renaming) as a source with every other member of its class (under the renaming that makes them equal) as
    a target. Returns the candidates and counts."""
    table: dict[tuple[int, ...], list[tuple[int, dict[str, str], tuple[int, ...]]]] = {}
    own: list[tuple[int, ...]] = []
    for gi, g in enumerate(graphs):
        for n, (fp, m, hs) in enumerate(fingerprints(g, data)):
            if n == 0:
                own.append(fp)
            table.setdefault(fp, []).append((gi, m, hs))
        if progress and gi % 1000 == 999:
            progress(1000)
    cands: list[Candidate] = []
    for si, s in enumerate(graphs):
        if not s.ops:
            continue
        members = table[own[si]]
        if len(members) < 2:
            continue
        svars = set(s.variables)
        for di, m, hs in members:
            # the graph itself under a renaming is a target too (associativity: (x+y)+z -> (y+z)+x); under the
            # identity, or an automorphism (caught by the "trivial" pruning step), it is not
            if graphs[di].redundant or (di == si and all(k == v for k, v in m.items())):
                continue
            d = graphs[di]
            # every variable the target reads (renamed) must be a source variable
            if not {m[v] for v in d.variables} <= svars:
                continue
            # map outputs by hash
            mapping = []
            used = set()
            for r, h in zip(s.outputs, s.out_hashes):
                for j, (dr, dh) in enumerate(zip(d.outputs, hs)):
                    if dh == h and j not in used:
                        used.add(j)
                        mapping.append((r, m.get(dr, dr)))
                        break
            if len(mapping) != len(s.outputs):
                continue
            cands.append(Candidate(s, d, tuple(sorted(m.items())), tuple(mapping)))
    classes = sum(1 for v in table.values() if len({e[0] for e in v}) > 1)
    return cands, {"classes": classes}


# ================================================================================================ rules
def candidate_to_json(c: Candidate, rid: str) -> dict:
    """The rule-format JSON of a candidate (``verified`` left pending)."""
    ren = dict(c.rename)

    def f(r: str) -> str:
        return ren.get(r, r) if parse_ref(r) is None else r

    src = [o.pattern() for o in c.src.ops]
    dst = []
    for o in c.dst.ops:
        d = {"op": o.op, "inputs": [f(r) for r in o.inputs],
             "attrs": {k: _jsonable(rename_expr(v, f)) for k, v in o.pattrs}}
        if o.n_out != 1:
            d["outputs"] = o.n_out
        dst.append(d)
    outputs = [[s, d] for s, d in c.outputs]
    variables = []
    for o in c.src.ops:
        for r in o.inputs:
            if parse_ref(r) is None and r not in variables:
                variables.append(r)
    const = [v for v in variables if VARIABLE_KINDS[v[0]][1]]
    raw = {"id": rid, "name": rule_name(c), "origin": "generated", "src": src, "dst": dst, "outputs": outputs,
           "verified": {"method": "pending", "trials": 0}}
    if const:
        raw["constraints"] = {"const": const}
    return raw


def _op_label(o: GOp) -> str:
    a = dict(o.pattrs)
    if o.op == "Conv":
        return "conv-relu" if a.get("activation") == "relu" else "conv"
    if o.op in ("Concat", "Split"):
        return f"{o.op.lower()}{a['axis']}"
    return o.op.lower()


def rule_name(c: Candidate) -> str:
    s = "+".join(_op_label(o) for o in c.src.ops)
    d = "+".join(_op_label(o) for o in c.dst.ops) or "id"
    return f"{s}->{d}"


def variable_class(v: str) -> str:
    """What tells variables apart once a rule is data: weight (``constraints.const``) or not, and the rank it
    was verified at (see :mod:`rlflow.rewrite.verify`). Sizes are not part of a rule, so ``conv(a, k0)`` and
    ``conv(a, p0)`` (3x3 and 1x1 kernels) are the same rule; renaming-duplicate and specialisation pruning
    compare variables by this class."""
    shape, weight = VARIABLE_KINDS[v[0]]
    return f"{'const' if weight else 'value'}{len(shape)}"


def candidate_values(c: Candidate, data: Mapping[str, np.ndarray]) -> tuple[dict[str, int], dict[str, int]]:
    """Value hashes (on the fingerprint data) of every reference of each side, in the rule's naming (the
    target's variables renamed to the source's)."""
    ren = dict(c.rename)
    senv = run_graph(c.src.ops, {v: data[v] for v in c.src.variables})
    denv = run_graph(c.dst.ops, {v: data[ren.get(v, v)] for v in c.dst.variables})
    sv = {r: tensor_hash(a) for r, a in senv.items() if "." in r or parse_ref(r) is None}
    dv = {(ren.get(r, r) if parse_ref(r) is None else r): tensor_hash(a) for r, a in denv.items()
          if "." in r or parse_ref(r) is None}
    return sv, dv


def candidate_attr_values(c: Candidate) -> tuple[list, list]:
    return [o.nattrs for o in c.src.ops], [o.nattrs for o in c.dst.ops]


# ================================================================================================ the whole run
def _has_broadcasting_op(rule) -> bool:
    from rlflow.graph.ops import OPS

    return any(n.op in OPS and OPS[n.op].broadcasting for n in (*rule.src, *rule.dst))


@dataclass
class Generated:
    """The result of :func:`generate`: the verified, pruned rules (JSON, ids ``g0001``...) and the counts."""

    rules: list[dict]
    stats: dict


def rule_id(n: int, total: int, prefix: str = "g") -> str:
    """The id of the ``n``-th (from 0) of ``total`` generated rules: ``g0001``... (at least four digits)."""
    return f"{prefix}{n + 1:0{max(4, len(str(total)))}d}"


def _bar(progress_factory, desc: str, total: int | None):
    if progress_factory is None:
        return None
    return progress_factory(desc=desc, total=total)


def generate(cfg: GeneratorConfig, trials: int = 5, max_dim: int = 4, verify_seed: int = 0,
             progress_factory: Callable[..., Any] | None = None, id_prefix: str = "g") -> Generated:
    """Enumerate, pair, prune, verify (see the module docstring and :mod:`rlflow.rewrite.prune`,
    :mod:`rlflow.rewrite.verify`). ``progress_factory(desc=..., total=...)`` makes a progress bar (e.g. tqdm)
    with ``update(n)`` and ``close()``; None: silent."""
    import time

    from rlflow.rewrite.prune import prune, prune_specialisations
    from rlflow.rewrite.rule import rule_from_json
    from rlflow.rewrite.rule import MIN_GENERAL_RANK
    from rlflow.rewrite.verify import verify, verify_rank_general

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    bar = _bar(progress_factory, "enumerate graphs", None)
    enum = Enumerator(cfg, progress=bar.update if bar is not None else None)
    graphs = enum.run()
    if bar is not None:
        bar.close()
    bar = _bar(progress_factory, "fingerprint + pair", len(graphs))
    cands, pair_info = pair_candidates(graphs, enum.data, progress=bar.update if bar is not None else None)
    if bar is not None:
        bar.close()
    seconds["enumerate"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    rules = [rule_from_json(candidate_to_json(c, f"c{i}"), "generator") for i, c in enumerate(cands)]
    values = [candidate_values(c, enum.data) for c in cands]
    attr_values = [candidate_attr_values(c) for c in cands]
    bar = _bar(progress_factory, "prune", len(rules))
    keep, counts = prune(rules, values, attr_values, kind_of=variable_class,
                         progress=bar.update if bar is not None else None)
    if bar is not None:
        bar.update(len(rules) - bar.n)
        bar.close()
    seconds["prune"] = time.perf_counter() - t1

    t2 = time.perf_counter()
    bar = _bar(progress_factory, "verify", len(keep))
    verified: list[tuple[int, dict]] = []
    failed = constrained = 0
    for i in keep:
        rec = verify(rules[i], trials=trials, max_dim=max_dim, seed=verify_seed)
        if rec is None and _has_broadcasting_op(rules[i]):
            # the generator's Add and Mul never broadcast: an identity that holds only without broadcasting
            # (conv distributivity) is kept with the constraint that says so, if it verifies with it
            narrowed = replace(rules[i], constraints={**rules[i].constraints, "no_broadcast": True})
            rec = verify(narrowed, trials=trials, max_dim=max_dim, seed=verify_seed)
            if rec is not None:
                rules[i] = narrowed
                constrained += 1
        if rec is None:
            failed += 1
        else:
            verified.append((i, rec))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    seconds["verify"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    ver_rules = [replace(rules[i], verified=rec) for i, rec in verified]  # with the ranks they were verified at
    keep2 = prune_specialisations(ver_rules, variable_class)
    counts_after = dict(counts)
    counts_after["specialisation"] = len(keep2)
    seconds["prune"] += time.perf_counter() - t3

    # rank-general rules: sound with their activations at other ranks too (verify_rank_general); the matchers
    # then bind those at any rank from 2 up, and the final pruning drops the rule's copies at other ranks
    t4 = time.perf_counter()
    out = []
    general = 0
    for n, j in enumerate(keep2):
        i, rec = verified[j]
        ranks = verify_rank_general(ver_rules[j], max_dim=max_dim, seed=verify_seed)
        if ranks is not None:
            general += 1
            rec = {**rec, "ranks": {v: {"min": MIN_GENERAL_RANK} if v not in rules[i].const_vars else r
                                    for v, r in rec["ranks"].items()}, "rank_general": ranks}
        raw = rules[i].to_json()
        raw["id"] = rule_id(n, len(keep2), id_prefix)
        raw["verified"] = rec
        out.append(raw)
    seconds["verify_ranks"] = time.perf_counter() - t4
    stats = {
        "graphs_enumerated": enum.visited,
        "graphs_recorded": len(graphs),
        "fingerprint_classes": pair_info["classes"],
        "candidates": len(cands),
        "after_each_pruning_step": counts_after,
        "verified": len(verified),
        "verified_no_broadcast": constrained,
        "failed_verification": failed,
        "rank_general": general,
        "generated_rules": len(out),
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
    }
    return Generated(out, stats)
