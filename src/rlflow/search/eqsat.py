"""Equality saturation over the rule set (Tensat: Yang et al., MLSys 2021), with ILP extraction.

    result = eqsat_search(graph, rules, cost_model, node_limit=50_000, iter_limit=15, time_limit_s=60)

**E-graph.** Every value of the graph is an e-class; an e-node is one output of one op application
``(op, attributes, number of outputs, output index, child e-classes)``, so a multi-output op (Split) is one
*instance* with one e-node per output. Graph inputs, weights (merged by content) and the constants a rule makes
are leaf e-nodes. Each e-class carries its :class:`TensorType` (the shape analysis: an e-node's type comes from
the op registry's shape inference, and only classes of equal type are ever merged) and whether it is *static*
(computable from weights only, which the rules' ``const`` constraints ask for). Unions are repaired with the
usual rebuild (congruence closure: e-nodes that become equal after a union merge their classes).

**Rules are data.** One generic e-matcher serves every rule: a rule's source pattern is matched top-down from its
*roots* (the pattern nodes no other pattern node reads); a pattern with several roots (TASO's two-output rules,
e.g. merging two MatMuls that share an input; Tensat's multi-patterns) joins its roots through their shared
variables (a rule whose roots share no variable, such as two independent Relus batched into one, is left out:
its matches are the cross product of the e-nodes of its ops). A match is checked exactly as the graph matcher
checks one (literal attributes, parameters, shape expressions, ``const`` variables, a generated rule's verified
ranks, ``no_broadcast``, and the target's shape inference giving each mapped value the source value's type); its
target is then added and each mapped source class merged with its target class. Matches of an iteration are found first, then applied (as egg does), then the e-graph rebuilt.
Multi-pattern rules run only in the first ``multi_iterations`` iterations (as Tensat limits them: their matches
grow with the square of the graph), and egg's backoff scheduler bans a rule for a while when it matches too often
(``RULE_MATCH_LIMIT``; multi-pattern rules are exempt: a ban would outlast their iterations). Matching is
semi-naive: a single-root rule that saw every match last iteration only looks for matches rooted within its
pattern's depth above what changed since (identical results, about 3x faster on BERT). After each iteration,
Tensat's cycle filtering removes the newest e-node of every cycle among the e-classes (for good; see
:meth:`EGraph.remove_cycles`), so extraction never meets a cycle. Saturation stops at a fixpoint (nothing
changed, no rule banned) or at the node, iteration or time limit.

**Extraction.** The cheapest graph the e-graph represents under the cost model every search uses: each op
instance costs its ``cost_model.alone_ms`` (weight-only instances are free, as the searches count them), paid
once however many of its outputs are used. An integer linear program (HiGHS through ``scipy.optimize.milp``)
chooses op instances: each output class has a chosen one, and so has every class a chosen one reads. Classes
holding a graph input or a weight, and weight-only classes (folded after extraction anyway), are left out of it
(see :func:`ilp_extract`). If the ILP is not solved to optimality within ``ilp_time_limit_s`` its best feasible
answer is used, and if it has none, a greedy extraction (Knuth's generalisation of Dijkstra: acyclic by
construction) is. The result is folded; if it costs more than the input under the cost model (extraction sums
per-op costs; a target's graph-level fusions can differ) the input is returned instead, so eqsat never returns a
costlier graph.
"""

from __future__ import annotations

import heapq
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from rlflow.cost.model import CostModel
from rlflow.errors import RLFlowError
from rlflow.graph.ir import Constant, Graph, Node, TensorType
from rlflow.graph.ops import infer_types
from rlflow.rewrite.matcher import _target_types
from rlflow.rewrite.rule import Rule, attr_equal, constant_array, eval_attr, is_param
from rlflow.search.common import finish
from rlflow.search.result import SearchResult

_REF = re.compile(r"%(\d+)(?:\.(\d+))?$")
_INPUT, _CONST = "$input", "$const"
#: the rule scheduler (egg's backoff scheduler): a rule with more than RULE_MATCH_LIMIT << n new matches in one
#: iteration, n its bans so far, applies none of them and is banned for BAN_LENGTH << n iterations. Without it,
#: add associativity and commutativity filled ViT's e-graph to the 50,000-node limit in 4 iterations (17,645 and
#: 4,002 applications) and its ILP found no answer in time.
RULE_MATCH_LIMIT = 1_000
BAN_LENGTH = 5

# an e-node key: (op, attribute key, number of outputs, output index, child classes); a leaf's children are ()
Key = tuple


class _Filtered(Exception):
    """A rule's target needs an e-node that cycle filtering removed (EGraph.remove_cycles)."""


class EGraph:
    """Typed e-graph of one IR graph (see the module docstring)."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.memo: dict[Key, int] = {}
        self.type: list[TensorType] = []
        self.static: list[bool] = []
        self.attrs: dict[tuple[str, str], dict] = {}
        self.leaves: dict[Key, tuple[str, Any]] = {}   # leaf key -> ("input", name) | ("const", Constant)
        self.pending: list[tuple[int, int]] = []
        self.filtered: set[Key] = set()  # e-nodes removed by remove_cycles: never added again

    # ------------------------------------------------------------------ union-find
    def find(self, c: int) -> int:
        p = self.parent
        root = c
        while p[root] != root:
            root = p[root]
        while p[c] != root:
            p[c], c = root, p[c]
        return root

    def _new_class(self, t: TensorType, static: bool) -> int:
        self.parent.append(len(self.parent))
        self.type.append(t)
        self.static.append(static)
        return len(self.parent) - 1

    @property
    def n_nodes(self) -> int:
        return len(self.memo)

    # ------------------------------------------------------------------ adding
    def add_input(self, name: str, t: TensorType) -> int:
        key = (_INPUT, name, 1, 0, ())
        if key not in self.memo:
            self.memo[key] = self._new_class(t, False)
            self.leaves[key] = ("input", name)
        return self.find(self.memo[key])

    def add_const(self, c: Constant) -> int:
        key = (_CONST, c.digest.hex(), 1, 0, ())
        if key not in self.memo:
            self.memo[key] = self._new_class(c.type, True)
            self.leaves[key] = ("const", c)
        return self.find(self.memo[key])

    def add_op(self, op: str, attrs: dict, children: Sequence[int], types: Sequence[TensorType] | None = None
               ) -> list[int]:
        """The classes of the outputs of ``op(children)``; ``types`` (else inferred) are the output types.
        Raises RLFlowError (a ShapeError) if shape inference fails."""
        kids = tuple(self.find(c) if c >= 0 else -1 for c in children)
        akey = Node("n", op, (), (), attrs).attr_key()
        self.attrs.setdefault((op, akey), dict(attrs))
        if types is None:
            types = infer_types(Node("n", op, tuple(f"c{c}" for c in kids), ("o",), attrs),
                                [self.type[c] for c in kids if c >= 0])
        n = len(types)
        if self.filtered and (op, akey, n, 0, kids) not in self.memo and (op, akey, n, 0, kids) in self.filtered:
            raise _Filtered
        static = op != "Opaque" and bool(kids) and all(c < 0 or self.static[c] for c in kids)
        out = []
        for j, t in enumerate(types):
            key = (op, akey, n, j, kids)
            c = self.memo.get(key)
            if c is None:
                c = self.memo[key] = self._new_class(t, static)
            out.append(self.find(c))
        return out

    def union(self, a: int, b: int) -> bool:
        a, b = self.find(a), self.find(b)
        if a == b:
            return False
        if self.type[a] != self.type[b]:
            raise RLFlowError(f"eqsat: merging e-classes of types {self.type[a]} and {self.type[b]}")
        if b < a:
            a, b = b, a
        self.parent[b] = a
        self.static[a] = self.static[a] or self.static[b]
        return True

    def rebuild(self) -> None:
        """Congruence closure: re-canonicalise every e-node; e-nodes that became equal merge their classes.
        Then propagate the static flags to a fixpoint."""
        while True:
            memo: dict[Key, int] = {}
            merged = False
            for key, c in self.memo.items():
                kids = key[4]
                if kids:
                    key = key[:4] + (tuple(self.find(k) if k >= 0 else -1 for k in kids),)
                c = self.find(c)
                have = memo.get(key)
                if have is None:
                    memo[key] = c
                elif have != c:
                    merged |= self.union(have, c)
                    memo[key] = self.find(c)
            self.memo = memo
            self.filtered = {k[:4] + (tuple(self.find(d) if d >= 0 else -1 for d in k[4]),) for k in self.filtered}
            if not merged:
                break
        changed = True
        while changed:
            changed = False
            for key, c in self.memo.items():
                c = self.find(c)
                if not self.static[c] and key[4] and key[0] != "Opaque" and \
                        all(k < 0 or self.static[self.find(k)] for k in key[4]):
                    self.static[c] = changed = True

    def remove_cycles(self) -> int:
        """Tensat's cycle filtering, done after each iteration's rebuild: while the graph of e-classes (an edge
        from each class to the children of each of its e-nodes) has a cycle, the newest op instance on it is
        removed from the e-graph (all its outputs; never one whose class would be left empty) and never added
        again (a rule whose target needs it is not applied: else the same rule adds it back each iteration).
        The merge that made the cycle stays: the classes remain equal, only the cyclic way of computing one is
        gone. Keeps extraction free of cycles, and the ILP's relaxation tight. Returns the number of e-nodes
        removed."""
        removed = 0
        while True:
            cycles = self._class_cycles()
            if not cycles:
                return removed
            age = {k: i for i, k in enumerate(self.memo)}
            size: dict[int, int] = {}
            for c in self.memo.values():
                size[self.find(c)] = size.get(self.find(c), 0) + 1
            for cycle in cycles:
                if any(k not in self.memo for k in cycle):
                    continue  # an earlier removal broke it
                for victim in sorted(cycle, key=age.__getitem__, reverse=True):
                    outs = [victim[:3] + (j,) + victim[4:] for j in range(victim[2])]
                    lose: dict[int, int] = {}
                    for k in outs:
                        c = self.find(self.memo[k])
                        lose[c] = lose.get(c, 0) + 1
                    if all(size[c] > n for c, n in lose.items()):
                        for k in outs:
                            del self.memo[k]
                        self.filtered.update(outs)
                        for c, n in lose.items():
                            size[c] -= n
                        removed += len(outs)
                        break
                else:
                    raise RLFlowError("eqsat: a cycle of e-classes that no e-node can be removed from")

    def _class_cycles(self) -> list[list[Key]]:
        """One cycle per back edge of a depth-first search over the e-classes, as the e-nodes along it."""
        edges: dict[int, list[tuple[Key, int]]] = {}
        for key, c in self.memo.items():
            for d in set(key[4]):
                if d >= 0:
                    edges.setdefault(self.find(c), []).append((key, self.find(d)))
        state: dict[int, int] = {}  # 1: on the stack, 2: done
        cycles: list[list[Key]] = []
        for r in sorted(edges):
            if state.get(r):
                continue
            state[r] = 1
            stack: list[list] = [[r, iter(edges[r]), None]]  # class, its edges left, the e-node descended by
            where = {r: 0}
            while stack:
                frame = stack[-1]
                nxt = next(frame[1], None)
                if nxt is None:
                    state[frame[0]] = 2
                    del where[frame[0]]
                    stack.pop()
                    continue
                key, d = nxt
                if state.get(d) == 1:
                    cycles.append([f[2] for f in stack[where[d]:-1]] + [key])
                elif not state.get(d):
                    frame[2] = key
                    state[d] = 1
                    where[d] = len(stack)
                    stack.append([d, iter(edges.get(d, ())), None])
        return cycles

    def classes(self) -> dict[int, list[Key]]:
        out: dict[int, list[Key]] = {}
        for key, c in self.memo.items():
            out.setdefault(self.find(c), []).append(key)
        return out


def graph_to_egraph(graph: Graph) -> tuple[EGraph, list[int]]:
    """The e-graph of ``graph`` and the classes of its outputs."""
    eg = EGraph()
    cls: dict[str, int] = {"": -1}
    for v in graph.inputs:
        cls[v] = eg.add_input(v, graph.types[v])
    for v, c in graph.constants.items():
        cls[v] = eg.add_const(c)
    for n in graph.nodes:
        outs = eg.add_op(n.op, dict(n.attrs), [cls[v] for v in n.inputs], [graph.types[v] for v in n.outputs])
        for v, c in zip(n.outputs, outs):
            cls[v] = c
    eg.rebuild()  # (identical subexpressions of the input merge here)
    return eg, [eg.find(cls[v]) for v in graph.outputs]


# ============================================================================================ rules as patterns
class _Pattern:
    """A rule's source pattern prepared for e-matching."""

    def __init__(self, rule: Rule):
        self.rule = rule
        self.src = rule.src
        self.ins = [[("node", int(m.group(1)), int(m.group(2) or 0)) if (m := _REF.match(r)) else ("var", r)
                     for r in pn.inputs] for pn in rule.src]
        used = {ref[1] for row in self.ins for ref in row if ref[0] == "node"}
        self.roots = [k for k in range(len(rule.src)) if k not in used]
        self.multi = len(self.roots) > 1
        depth = {k: 0 for k in self.roots}  # the longest chain of pattern nodes below a root
        for k in sorted(depth):
            todo = [k]
            while todo:
                m = todo.pop()
                for ref in self.ins[m]:
                    if ref[0] == "node" and depth.get(ref[1], -1) < depth[m] + 1:
                        depth[ref[1]] = depth[m] + 1
                        todo.append(ref[1])
        self.depth = max(depth.values())
        # the roots are joined when the variables each root's pattern reads link them all (Tensat's multi-patterns
        # share a variable); unjoined roots (relu(a), relu(b) -> ...) match the cross product of their e-nodes
        groups = [_pattern_vars(self.ins, k) for k in self.roots]
        joined = groups[0]
        rest = groups[1:]
        while rest:
            linked = [g for g in rest if g & joined]
            if not linked:
                break
            for g in linked:
                joined |= g
            rest = [g for g in rest if not g & joined]
        self.joined = not rest
        self.literal = [{a: v for a, v in pn.attrs.items() if not is_param(v) and not _has_expr(v)}
                        for pn in rule.src]
        self.param = [{a: v[1:] for a, v in pn.attrs.items() if is_param(v)} for pn in rule.src]
        self.expr = [{a: v for a, v in pn.attrs.items() if _has_expr(v)} for pn in rule.src]
        self.literal_ok: dict[tuple[int, str], bool] = {}  # (pattern node, attribute key) -> literals match
        ranks = rule.verified.get("ranks") if rule.origin == "generated" else None
        self.var_ranks = {v: set(r) if isinstance(r, list) else {r} for v, r in (ranks or {}).items()}
        self.const_vars = rule.const_vars


def _has_expr(v: Any) -> bool:
    return isinstance(v, dict) or (isinstance(v, (tuple, list)) and any(_has_expr(x) for x in v))


def _pattern_vars(ins: list[list[tuple]], k: int) -> set[str]:
    """The variables pattern node ``k`` and the pattern nodes below it read."""
    out: set[str] = set()
    todo = [k]
    while todo:
        for ref in ins[todo.pop()]:
            if ref[0] == "var":
                out.add(ref[1])
            else:
                todo.append(ref[1])
    return out


@dataclass
class _State:
    nodes: dict[int, tuple]          # pattern node -> instance (op, akey, n, kids)
    vars: dict[str, int]             # variable -> class
    params: dict[str, Any]


class _Index:
    """Per iteration: op instances by op, e-nodes by class, and instances by (op, input position, class)."""

    def __init__(self, eg: EGraph):
        self.by_op: dict[str, dict[str, list[tuple]]] = {}  # op -> attribute key -> instances
        self.in_class: dict[int, list[Key]] = {}
        self.uses: dict[tuple[str, int, int], list[tuple]] = {}
        self.cls: dict[Key, int] = {}
        self.parents: dict[int, set[int]] = {}
        for key, c in eg.memo.items():
            self.in_class.setdefault(c, []).append(key)
            self.cls[key] = c
            for k in key[4]:
                if k >= 0:
                    self.parents.setdefault(k, set()).add(c)
            if key[3] == 0 and key[0] not in (_INPUT, _CONST):
                inst = (key[0], key[1], key[2], key[4])
                self.by_op.setdefault(key[0], {}).setdefault(key[1], []).append(inst)
                for pos, k in enumerate(key[4]):
                    self.uses.setdefault((key[0], pos, k), []).append(inst)

    def out_class(self, inst: tuple, j: int) -> int:
        return self.cls[(inst[0], inst[1], inst[2], j, inst[3])]

    def near(self, changed: set[int], depth: int) -> list[dict[str, dict[str, list[tuple]]]]:
        """Per depth d <= ``depth``: by op and attribute key, the op instances with an output class within d parent steps of a
        class in ``changed``."""
        out = []
        ring, seen = set(changed), set(changed)
        for d in range(depth + 1):
            if d:
                ring = {q for c in ring for q in self.parents.get(c, ()) if q not in seen}
                seen |= ring
            insts = {(k[0], k[1], k[2], k[4]) for c in seen for k in self.in_class.get(c, ()) if k[4]}
            ops = {inst[0] for inst in insts}  # (in by_op's order: matches are applied in the same order)
            out.append({op: {a: kept for a, group in self.by_op[op].items()
                             if (kept := [inst for inst in group if inst in insts])} for op in ops})
        return out


def _matches(eg: EGraph, ix: _Index, p: _Pattern, first: dict[str, dict[str, list[tuple]]] | None = None
             ) -> Iterator[_State]:
    """Every binding of ``p``'s source pattern to op instances of the e-graph (before the whole-match checks);
    ``first``, if given, holds (as ``ix.by_op``) the only instances the first root may bind."""
    src = p.src

    def literal_ok(k: int, op: str, akey: str) -> bool:
        ok = p.literal_ok.get((k, akey))
        if ok is None:  # an attribute key's attributes never change: checked once per pattern node
            attrs = eg.attrs[(op, akey)]
            ok = p.literal_ok[(k, akey)] = all(attr_equal(attrs[a], v) for a, v in p.literal[k].items())
        return ok

    def fit(k: int, inst: tuple, st: _State) -> _State | None:
        pn = src[k]
        if inst[0] != pn.op or inst[2] != pn.n_outputs or len(inst[3]) != len(pn.inputs) or inst in st.nodes.values():
            return None
        if not literal_ok(k, inst[0], inst[1]):
            return None
        attrs = eg.attrs[(inst[0], inst[1])]
        params = st.params
        for a, name in p.param[k].items():
            if name in params:
                if not attr_equal(params[name], attrs[a]):
                    return None
            else:
                params = dict(params) if params is st.params else params
                params[name] = attrs[a]
        vars_ = st.vars
        for ref, c in zip(p.ins[k], inst[3]):
            if ref[0] != "var":
                continue
            have = vars_.get(ref[1])
            if have is None:
                if c < 0 or (ref[1] in p.const_vars and not eg.static[c]) or \
                        (p.var_ranks and eg.type[c].rank not in p.var_ranks.get(ref[1], ())):
                    return None
                vars_ = dict(vars_) if vars_ is st.vars else vars_
                vars_[ref[1]] = c
            elif have != c:
                return None
        return _State({**st.nodes, k: inst}, vars_, params)

    def below(k: int, st: _State) -> Iterator[_State]:
        """Match the pattern nodes that node k (bound) reads."""
        todo = [(ref, c) for ref, c in zip(p.ins[k], st.nodes[k][3]) if ref[0] == "node"]
        yield from chain(todo, 0, st)

    def chain(todo: list, i: int, st: _State) -> Iterator[_State]:
        if i == len(todo):
            yield st
            return
        (_, m, j), c = todo[i]
        if m in st.nodes:
            if ix.out_class(st.nodes[m], j) == c:
                yield from chain(todo, i + 1, st)
            return
        for key in ix.in_class.get(c, ()):
            if key[0] != src[m].op or key[3] != j:
                continue
            s2 = fit(m, (key[0], key[1], key[2], key[4]), st)
            if s2 is not None:
                for s3 in below(m, s2):
                    yield from chain(todo, i + 1, s3)

    def roots(i: int, st: _State) -> Iterator[_State]:
        if i == len(p.roots):
            yield st
            return
        k = p.roots[i]
        cands = None
        for pos, ref in enumerate(p.ins[k]):  # a variable already bound: only the instances that read it there
            if ref[0] == "var" and ref[1] in st.vars:
                cands = ix.uses.get((src[k].op, pos, st.vars[ref[1]]), ())
                break
        if cands is None:  # every instance of the op whose literal attributes match
            op = src[k].op
            groups = (first if i == 0 and first is not None else ix.by_op).get(op, {})
            cands = [inst for akey, group in groups.items() if literal_ok(k, op, akey) for inst in group]
        for inst in cands:
            s2 = fit(k, inst, st)
            if s2 is not None:
                for s3 in below(k, s2):
                    yield from roots(i + 1, s3)

    yield from roots(0, _State({}, {}, {}))


def _check(eg: EGraph, ix: _Index, p: _Pattern, st: _State) -> tuple[dict, dict] | None:
    """The whole-match checks; returns (refs: pattern ref -> class name, target types) or None."""
    refs: dict[str, str] = {v: f"c{c}" for v, c in st.vars.items()}
    for k, inst in st.nodes.items():
        for j in range(inst[2]):
            refs[f"%{k}.{j}"] = f"c{ix.out_class(inst, j)}"
            if j == 0:
                refs[f"%{k}"] = refs[f"%{k}.0"]
    types = {f"c{c}": eg.type[c] for c in [*st.vars.values(), *(int(v[1:]) for v in refs.values())]}
    type_of = lambda r: types[refs[r]]  # noqa: E731
    try:
        for k, exprs in enumerate(p.expr):
            attrs = eg.attrs[(st.nodes[k][0], st.nodes[k][1])]
            for a, e in exprs.items():
                if not attr_equal(attrs[a], eval_attr(e, type_of, st.params)):
                    return None
    except (IndexError, KeyError, TypeError, ValueError):
        return None
    dt = _target_types(p.rule, refs, types, st.params)
    return None if dt is None else (refs, dt)


def _apply(eg: EGraph, p: _Pattern, st: _State, refs: dict, dt: dict) -> int | None:
    """Add the rule's target for this match and merge each mapped source class with its target class; returns
    the number of merges that changed the e-graph, or None if the target needs a filtered e-node (then nothing
    is merged; target nodes added before that one stay, unused)."""
    rule = p.rule
    cls: dict[str, int] = {v: c for v, c in st.vars.items()}
    type_of = lambda r: dt[r] if r.startswith("%") else eg.type[cls[r]]  # noqa: E731
    for k, pn in enumerate(rule.dst):
        attrs = {a: eval_attr(e, type_of, st.params) for a, e in pn.attrs.items()}
        if pn.op == "Constant":
            cls[f"%{k}"] = cls[f"%{k}.0"] = eg.add_const(Constant(constant_array(attrs)))
            continue
        try:
            outs = eg.add_op(pn.op, attrs, [cls[_norm(r)] for r in pn.inputs],
                             [dt[f"%{k}.{j}"] for j in range(pn.n_outputs)])
        except _Filtered:
            return None
        for j, c in enumerate(outs):
            cls[f"%{k}.{j}"] = c
            if j == 0:
                cls[f"%{k}"] = c
    merged = 0
    for s, d in rule.outputs:
        merged += eg.union(int(refs[_norm(s)][1:]), cls[_norm(d)])
    return merged


def _norm(ref: str) -> str:
    m = _REF.match(ref)
    return f"%{m.group(1)}.{m.group(2) or 0}" if m else ref


def saturate(eg: EGraph, rules: Sequence[Rule], node_limit: int, iter_limit: int, deadline: float,
             multi_iterations: int, semi_naive: bool = True) -> dict[str, Any]:
    """Run the rules on ``eg`` until a fixpoint or a limit; returns the saturation statistics. ``semi_naive``
    False matches every rule against the whole e-graph in every iteration (the same result, slower: tests)."""
    # a rule whose source is unconnected ops sharing no variable (two independent Relus, two convs on different
    # inputs) is left out: it matches every pair of e-nodes of its ops, and its targets make new e-nodes of those
    # ops that pair again (on a tiny squeezenet the two Relu batchings filled the e-graph to the node limit in
    # two iterations and the ILP found no optimum in 60 s); the graph searches and the agents use them
    patterns = [p for p in map(_Pattern, rules) if p.joined]
    seen: set = set()
    bans: dict[str, tuple[int, int]] = {}  # rule id -> (times banned, first iteration allowed again)
    stats: dict[str, Any] = {"iterations": 0, "stop": "saturated", "matches": 0, "applied": 0, "merges": 0,
                             "match_cap_hits": 0, "cycle_enodes_removed": 0, "filtered": 0,
                             "rules_fired": {}}
    prev: dict[Key, int] = {}        # the e-graph's e-nodes when the last iteration began
    complete: dict[str, int] = {}    # rule id -> the last iteration in which the rule ran on every match
    max_depth = max((p.depth for p in patterns), default=0)
    for it in range(iter_limit):
        ix = _Index(eg)
        size = (eg.n_nodes, len(eg.parent))
        # semi-naive matching: a match of a single-root rule that ran on every match last iteration is new only
        # if one of its op instances was added or changed class since then, so its root lies within the
        # pattern's depth above such an instance's class
        near = ix.near({c for key, c in eg.memo.items() if prev.get(key) != c}, max_depth) \
            if prev and semi_naive else None
        prev = dict(eg.memo)
        todo = []
        banned = False
        for p in patterns:
            if p.multi and it >= multi_iterations:
                continue
            n_bans, until = bans.get(p.rule.id, (0, 0))
            if it < until:
                banned = True
                continue
            # multi-pattern rules are limited by multi_iterations instead: a ban would outlast them
            limit = float("inf") if p.multi else RULE_MATCH_LIMIT << n_bans
            found = []
            first = near[p.depth] if near is not None and not p.multi and complete.get(p.rule.id) == it - 1 \
                else None
            for st in _matches(eg, ix, p, first):
                key = (p.rule.id, tuple(sorted(st.nodes.items())), tuple(sorted(st.vars.items())))
                if key not in seen:
                    found.append((key, st))
                    if len(found) > limit:
                        break
            if len(found) > limit:  # banned: these matches stay unseen, to be found again later
                bans[p.rule.id] = (n_bans + 1, it + 1 + (BAN_LENGTH << n_bans))
                stats["match_cap_hits"] += 1
                banned = True
                continue
            complete[p.rule.id] = it
            for key, st in found:
                seen.add(key)
                checked = _check(eg, ix, p, st)
                if checked is not None:
                    todo.append((p, st, checked))
            if time.perf_counter() > deadline:
                break
        stats["matches"] += len(todo)
        merges = 0
        stop = None
        for p, st, (refs, dt) in todo:
            if eg.n_nodes >= node_limit:
                stop = "node_limit"
                break
            m = _apply(eg, p, st, refs, dt)
            if m is None:
                stats["filtered"] += 1
                continue
            merges += m
            stats["applied"] += 1
            if m:
                stats["rules_fired"][p.rule.name] = stats["rules_fired"].get(p.rule.name, 0) + 1
        eg.rebuild()
        stats["cycle_enodes_removed"] += eg.remove_cycles()
        stats["iterations"] = it + 1
        stats["merges"] += merges
        if stop is None and time.perf_counter() > deadline:
            stop = "time_limit"
        if stop is None and eg.n_nodes >= node_limit:
            stop = "node_limit"
        if stop is not None:
            stats["stop"] = stop
            break
        if not merges and (eg.n_nodes, len(eg.parent)) == size:  # nothing changed (no match, or none new)
            if not banned:
                break
            bans = {r: (n, 0) for r, (n, _) in bans.items()}  # nothing else to do: the banned rules run next
    else:
        stats["stop"] = "iteration_limit"
    return stats


# ============================================================================================ extraction
class _Costs:
    """Per op instance: its cost (ms) under the cost model (``alone_ms``: a kernel of its own on a target that
    groups nodes into kernels), or its cost inside a graph already seen (``context``, see
    :func:`eqsat_search`); weight-only instances are free."""

    def __init__(self, eg: EGraph, cost: CostModel):
        self.eg, self.cost = eg, cost
        self._memo: dict[tuple, float] = {}
        self.context: dict[tuple, float] = {}

    def seen_in(self, graph: Graph) -> None:
        """Cost each op instance of ``graph`` (whose ops the e-graph holds) as it costs inside that graph."""
        for inst, c in zip(graph_instances(self.eg, graph), self.cost.node_costs(graph)):
            if inst is not None:
                self.context[inst] = float(c[0])

    def of(self, inst: tuple) -> float:
        hit = self.context.get(inst)
        if hit is None:
            hit = self._memo.get(inst)
        if hit is not None:
            return hit
        op, akey, n, kids = inst
        eg = self.eg
        if op != "Opaque" and kids and all(k < 0 or eg.static[k] for k in kids):
            c = 0.0
        else:
            outs = tuple(f"o{j}" for j in range(n))
            node = Node("n", op, tuple(f"c{k}" if k >= 0 else "" for k in kids), outs, eg.attrs[(op, akey)])
            types = {f"c{k}": eg.type[k] for k in kids if k >= 0}
            for j in range(n):
                types[f"o{j}"] = eg.type[eg.memo[(op, akey, n, j, kids)]]
            c = float(self.cost.alone_ms(node, types))
        self._memo[inst] = c
        return c


def _inst(key: Key) -> tuple:
    return (key[0], key[1], key[2], key[4])


def graph_instances(eg: EGraph, graph: Graph) -> list[tuple | None]:
    """Per node of ``graph`` (the input, or a graph extracted from ``eg``), its op instance in the e-graph as it
    is now; None where the e-graph no longer holds it (cycle filtering)."""
    cls: dict[str, int | None] = {"": -1}
    for v in graph.inputs:
        c = eg.memo.get((_INPUT, v, 1, 0, ()))
        cls[v] = None if c is None else eg.find(c)
    for v, k in graph.constants.items():
        c = eg.memo.get((_CONST, k.digest.hex(), 1, 0, ()))
        cls[v] = None if c is None else eg.find(c)
    out: list[tuple | None] = []
    for n in graph.nodes:
        kids = tuple(cls.get(v) for v in n.inputs)
        inst = None
        if None not in kids:
            inst = (n.op, Node("n", n.op, (), (), n.attrs).attr_key(), len(n.outputs), kids)
            outs = [eg.memo.get(inst[:3] + (j, kids)) for j in range(len(n.outputs))]
            inst = None if None in outs else inst
        for j, v in enumerate(n.outputs):
            cls[v] = None if inst is None else eg.find(eg.memo[inst[:3] + (j, kids)])
        out.append(inst)
    return out


def greedy_extract(eg: EGraph, costs: _Costs) -> dict[int, Key]:
    """Cheapest tree cost per class (Knuth's generalisation of Dijkstra): a class is settled only from e-nodes
    whose children are all settled, so the choice is acyclic. Returns class -> chosen e-node."""
    classes = eg.classes()
    waiting: dict[Key, int] = {}
    parents: dict[int, list[Key]] = {}
    heap: list = []
    for c, keys in classes.items():
        for key in keys:
            kids = {k for k in key[4] if k >= 0}
            waiting[key] = len(kids)
            for k in kids:
                parents.setdefault(k, []).append(key)
            if not kids:
                heapq.heappush(heap, (0.0 if key in eg.leaves else costs.of(_inst(key)), len(heap), key, c))
    best: dict[int, float] = {}
    choice: dict[int, Key] = {}
    while heap:
        total, _, key, c = heapq.heappop(heap)
        if c in choice:
            continue
        choice[c], best[c] = key, total
        for pkey in parents.get(c, ()):
            waiting[pkey] -= 1
            if waiting[pkey] == 0:
                pc = eg.find(eg.memo[pkey])
                if pc not in choice:
                    t = costs.of(_inst(pkey)) + sum(best[k] for k in set(pkey[4]) if k >= 0)
                    heapq.heappush(heap, (t, len(heap) + len(choice), pkey, pc))
    return choice


#: the ILP's cost of an op instance the cost model calls free (weight-only ops; data movement on a simulated
#: GPU): a free instance would tie with its class's leaf, and the ILP could pick free cycles such as
#: Transpose(Transpose(x)) at no cost; 1e-6 ms breaks the tie towards fewer ops without moving any real choice
TIE_COST_MS = 1e-6
#: extractions at most on a target that fuses kernels (see eqsat_search)
EXTRACTION_ROUNDS = 4


def find_cycles(eg: EGraph, roots: Sequence[int], choice: dict[int, Key]) -> list[list[Key]]:
    """Cycles among the choices reachable from ``roots`` (following each class's chosen e-node to its children):
    one per back edge of an iterative depth-first search, as the list of its e-nodes; empty when the choice is
    acyclic."""
    state: dict[int, int] = {}  # 1: on the stack, 2: done
    cycles: list[list[Key]] = []
    for r in sorted(set(roots)):
        if state.get(r):
            continue
        stack = [(r, iter(sorted({k for k in choice[r][4] if k >= 0})))]
        path = [r]
        state[r] = 1
        while stack:
            c, kids = stack[-1]
            d = next(kids, None)
            if d is None:
                state[c] = 2
                stack.pop()
                path.pop()
            elif state.get(d) == 1:
                cycles.append([choice[x] for x in path[path.index(d):]])
            elif not state.get(d):
                state[d] = 1
                path.append(d)
                stack.append((d, iter(sorted({k for k in choice[d][4] if k >= 0}))))
    return cycles


def free_choice(eg: EGraph) -> dict[int, Key]:
    """The classes extraction gets for free, each with the e-node it uses: a class holding a leaf (a graph
    input, a weight) uses it; a *static* class (computable from weights only, so folded to a weight after
    extraction) uses an e-node whose children are all static, settled bottom-up from the leaves, so acyclic."""
    classes = eg.classes()
    choice = {c: next(k for k in keys if k in eg.leaves) for c, keys in classes.items()
              if any(k in eg.leaves for k in keys)}
    todo = [c for c in classes if eg.static[c] and c not in choice]
    while todo:
        left = []
        for c in todo:
            k = next((k for k in classes[c] if k[0] != "Opaque" and all(d < 0 or d in choice for d in k[4])), None)
            if k is None:
                left.append(c)
            else:
                choice[c] = k
        if len(left) == len(todo):
            break  # (only an e-graph with cycles among its static classes leaves some unsettled)
        todo = left
    return choice


def ilp_candidates(eg: EGraph, roots: Sequence[int], costs: _Costs, free: dict[int, Key]
                   ) -> dict[int, list[Key]]:
    """Per class the ILP decides (reachable from ``roots`` and not ``free``), the e-nodes an optimal answer may
    use. Dropped, each without changing the optimum: e-nodes that close a cycle through one of their children
    (the child class is the node's own, or every e-node of the child reads the node's class); and a
    single-output e-node B *dominated* by an e-node A of its class, i.e. A's instance costs no more and A reads
    a subset of B's non-free classes (switching B for A never costs more, never adds a cycle; of equals, one
    is kept: add commutativity makes Add(a, b) and Add(b, a) such pairs)."""
    classes = eg.classes()
    needs = {d: set.intersection(*({k for k in key[4] if k >= 0} for key in keys)) for d, keys in classes.items()}
    reach, todo = set(), [c for c in set(roots) if c not in free]
    cand: dict[int, list[Key]] = {}
    while todo:
        c = todo.pop()
        if c in reach:
            continue
        reach.add(c)
        ok = [k for k in classes[c] if not any(d == c or c in needs[d] for d in k[4] if d >= 0)]
        info = sorted(((max(costs.of(_inst(k)), TIE_COST_MS), frozenset(d for d in k[4] if d >= 0 and d not in free),
                        repr(k), k) for k in ok), key=lambda t: (t[0], len(t[1]), t[2]))
        kept: list[tuple] = []
        for cost, kids, _, k in info:
            if k[2] == 1 and any(kc <= cost and kk <= kids for kc, kk, _ in kept):
                continue
            kept.append((cost, kids, k))
        cand[c] = [t[2] for t in kept]
        todo.extend(d for t in kept for d in t[1] if d not in reach)
    return {c: cand[c] for c in sorted(cand)}


def ilp_extract(eg: EGraph, roots: Sequence[int], costs: _Costs, time_limit_s: float
                ) -> tuple[dict[int, Key] | None, dict[str, Any]]:
    """Tensat's ILP over :func:`ilp_candidates`, the :func:`free_choice` classes left out. One binary variable
    per single-output e-node and one per multi-output op instance (its outputs' e-nodes share it), each paying
    its instance's cost; each output class has a chosen variable (one of its e-nodes', or an instance's with
    an output in it), and so does every non-free class a chosen variable reads. Solved by HiGHS to optimality
    or until ``time_limit_s`` is up (its best answer is then used). Cycles: saturation's cycle filtering (:meth:`EGraph.remove_cycles`) leaves none among the classes;
    for any other e-graph acyclicity is enforced lazily: while the answer has cycles, a cut per cycle forbids
    its variables together (their sum <= length - 1) and the ILP is solved again, within ``time_limit_s`` in
    all. (Tensat's own big-M order variables per class made HiGHS miss optimality in 30 s on 553-e-node
    e-graphs; their LP relaxation is weak.) Returns (class -> chosen e-node, or None if no feasible acyclic
    answer in time; statistics)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    t0 = time.perf_counter()
    free = free_choice(eg)
    classes = ilp_candidates(eg, roots, costs, free)
    var: dict[Key, int] = {}       # e-node -> its variable
    inst_var: dict[tuple, int] = {}
    insts: list[tuple] = []        # variable -> op instance
    for keys in classes.values():
        for k in keys:
            v = inst_var.get(_inst(k))
            if v is None:
                v = inst_var[_inst(k)] = len(insts)
                insts.append(_inst(k))
            var[k] = v
    nv = len(insts)
    of_class = {c: sorted({var[k] for k in keys}) for c, keys in classes.items()}
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        r = len(lo)
        for col, v in entries:
            rows.append(r)
            cols.append(col)
            vals.append(v)
        lo.append(lb)
        hi.append(ub)

    for c in sorted(set(roots)):  # every output class has a chosen variable
        if c not in free:
            row([(v, 1.0) for v in of_class[c]], 1.0, np.inf)
    cvec = np.zeros(nv)
    for v, s in enumerate(insts):
        cvec[v] = max(costs.of(s), TIE_COST_MS)
        for d in sorted({d for d in s[3] if d >= 0 and d not in free}):  # so has each class it reads
            row([(u, 1.0) for u in of_class[d] if u != v] + [(v, -1.0)], 0.0, np.inf)
    stats: dict[str, Any] = {"ilp_variables": nv, "ilp_enodes": sum(map(len, classes.values())),
                             "ilp_free_classes": len(free), "ilp_cycle_cuts": 0, "ilp_solves": 0}
    choice: dict[int, Key] | None = None
    while True:
        left = time_limit_s - (time.perf_counter() - t0)
        a = coo_array((vals, (rows, cols)), shape=(len(lo), nv)).tocsr()
        with warnings.catch_warnings():  # scipy warns that it passes mip_detect_symmetry to HiGHS verbatim
            warnings.simplefilter("ignore", RuntimeWarning)
            res = milp(cvec, constraints=LinearConstraint(a, lo, hi), integrality=np.ones(nv),
                       bounds=Bounds(np.zeros(nv), np.ones(nv)),
                       options={"time_limit": max(left, 0.1), "disp": False, "mip_detect_symmetry": False})
        stats.update(ilp_constraints=len(lo), ilp_status=int(res.status), ilp_message=str(res.message),
                     ilp_optimal=res.status == 0, ilp_solves=stats["ilp_solves"] + 1,
                     ilp_objective=None if res.x is None else float(res.fun),
                     ilp_gap=None if res.x is None else float(getattr(res, "mip_gap", 0.0) or 0.0))
        if res.x is None:
            choice = None
            break
        choice = dict(free)
        for c, keys in classes.items():
            picked = [k for k in keys if res.x[var[k]] > 0.5]
            if picked:
                choice[c] = picked[0]
        cycles = find_cycles(eg, roots, choice)
        if not cycles:
            break
        for cycle in cycles:
            stats["ilp_cycle_cuts"] += 1
            vs = sorted({var[k] for k in cycle if k in var})
            row([(v, 1.0) for v in vs], 0.0, len(vs) - 1.0)
        if time.perf_counter() - t0 >= time_limit_s:
            choice = None
            stats.update(ilp_optimal=False, ilp_message="time limit reached with a cyclic answer")
            break
    stats["ilp_seconds"] = time.perf_counter() - t0
    return choice, stats


def to_graph(eg: EGraph, roots: Sequence[int], choice: dict[int, Key], original: Graph) -> Graph:
    """The IR graph of the chosen e-nodes (each op instance once), outputs named as the original's."""
    nodes: list[Node] = []
    types: dict[str, TensorType] = {}
    constants: dict[str, Constant] = {}
    value: dict[int, str] = {}
    made: dict[tuple, tuple[str, ...]] = {}
    out_names = set(original.outputs)
    counter = [0]

    def fresh(prefix: str) -> str:
        while True:
            counter[0] += 1
            name = f"{prefix}{counter[0]}"
            if name not in types and name not in out_names and name not in original.types:
                return name

    const_names = {c.digest: v for v, c in original.constants.items()}
    on_path: set[int] = set()

    def visit(c: int) -> str:
        c = eg.find(c)
        if c in value:
            return value[c]
        key = choice.get(c)
        if key is None:
            raise RLFlowError(f"eqsat: extraction chose no e-node for class {c}")
        if c in on_path:
            raise RLFlowError("eqsat: the extraction has a cycle")
        on_path.add(c)
        if key in eg.leaves:
            kind, what = eg.leaves[key]
            if kind == "input":
                name = what
            else:
                name = const_names.get(what.digest) or fresh("_eqc")
                constants[name] = what
            types[name] = eg.type[c]
        else:
            inst = _inst(key)
            if inst not in made:
                ins = tuple(visit(k) if k >= 0 else "" for k in key[4])
                outs = tuple(fresh("_eqv") for _ in range(key[2]))
                for j, o in enumerate(outs):
                    types[o] = eg.type[eg.find(eg.memo[(key[0], key[1], key[2], j, key[4])])]
                nodes.append(Node(fresh("_eqn"), key[0], ins, outs, eg.attrs[(key[0], key[1])]))
                made[inst] = outs
            name = made[inst][key[3]]
        on_path.discard(c)
        value[c] = name
        return name

    outputs: list[str] = []
    rename: dict[str, str] = {}
    for want, c in zip(original.outputs, roots):
        v = visit(c)
        if v in original.inputs or v in constants or v in rename or v in outputs:
            ident = Node(fresh("_eqn"), "Identity", (v,), (want,), {})  # v is renamed below, with every input
            nodes.append(ident)
            types[want] = types[rename.get(v, v)]  # an earlier output of the same class already took v's type
        else:
            rename[v] = want
            types[want] = types.pop(v)
        outputs.append(want)
    if rename:
        nodes = [Node(n.name, n.op, tuple(rename.get(v, v) for v in n.inputs),
                      tuple(rename.get(v, v) for v in n.outputs), n.attrs) for n in nodes]
    g = Graph(inputs=original.inputs, outputs=outputs, nodes=nodes, types=types, constants=constants,
              name=original.name, opset=original.opset, extra_opsets=original.extra_opsets)
    g.validate()
    return g


# ============================================================================================ the search
def eqsat_search(graph: Graph, rules: Sequence[Rule], cost_model: CostModel, node_limit: int = 50_000,
                 iter_limit: int = 15, time_limit_s: float = 60.0, ilp_time_limit_s: float = 60.0,
                 multi_iterations: int = 2, extraction: str = "ilp") -> SearchResult:
    """Equality saturation then extraction; see the module docstring. Deterministic for given inputs (unless a
    time limit cuts saturation or the ILP)."""
    if node_limit < 1 or iter_limit < 0 or time_limit_s < 0 or ilp_time_limit_s < 0 or multi_iterations < 0 \
            or extraction not in ("ilp", "greedy"):
        raise ValueError("eqsat_search: need node_limit >= 1, iter_limit, time limits, multi_iterations >= 0 and "
                         "extraction ilp | greedy")
    t0 = time.perf_counter()
    initial = cost_model.graph_metrics(graph)
    eg, roots = graph_to_egraph(graph)
    nodes0, classes0 = eg.n_nodes, len(eg.classes())
    deadline = t0 + time_limit_s if time_limit_s else float("inf")
    # a rule whose target needs a newer opset than the graph's (constraints.min_opset) does not run
    sat = saturate(eg, [r for r in rules if r.min_opset <= graph.opset], node_limit, iter_limit, deadline,
                   multi_iterations)
    t_sat = time.perf_counter() - t0
    roots = [eg.find(c) for c in roots]
    costs = _Costs(eg, cost_model)
    # a target that groups nodes into kernels (ort-cpu) is not additive: an op costs less fused with its
    # neighbours. After the first extraction (each op on its own, as Tensat), the ILP costs the input's ops as
    # they cost inside the input and extracts again; then, in turn, the ops of each graph extracted since as
    # they cost inside it; EXTRACTION_ROUNDS extractions at most; the graph cheapest on the target is kept.
    fuses = not cost_model.additive
    ext: dict[str, Any] = {"extraction": extraction, "extraction_rounds": 0}
    extracted, extracted_ms, tried = None, float("inf"), set()
    t_ilp = time.perf_counter()
    while True:
        choice = None
        if extraction == "ilp":
            choice, ilp = ilp_extract(eg, roots, costs, max(ilp_time_limit_s - (time.perf_counter() - t_ilp), 0.1))
            if extracted is None or choice is not None:
                ext.update(ilp)
            if choice is None and extracted is None:
                ext["extraction"] = "greedy (the ILP found no solution in its time limit)"
        if choice is None and extracted is None:
            choice = greedy_extract(eg, costs)
        ext["extraction_rounds"] += 1
        if choice is None:
            break
        g = to_graph(eg, roots, choice, graph)
        ms = cost_model.graph_metrics(g).runtime_ms
        if ms < extracted_ms:
            extracted, extracted_ms = g, ms
        key = frozenset(choice.items())
        if not fuses or key in tried or ext["extraction_rounds"] >= EXTRACTION_ROUNDS or \
                time.perf_counter() - t_ilp >= ilp_time_limit_s:
            break
        tried.add(key)
        costs.seen_in(graph if ext["extraction_rounds"] == 1 else g)
    t_ext = time.perf_counter() - t0 - t_sat
    final_graph, final = finish(extracted, cost_model)
    kept_input = False
    if final.runtime_ms > initial.runtime_ms:
        (final_graph, final), kept_input = finish(graph, cost_model), True
    usable = [p for p in map(_Pattern, rules) if p.joined]
    multi = sum(p.multi for p in usable)
    stats = {"egraph_nodes_initial": nodes0, "egraph_classes_initial": classes0, "egraph_nodes": eg.n_nodes,
             "egraph_classes": len(eg.classes()), "saturation_seconds": t_sat, "extraction_seconds": t_ext,
             "rules": len(rules), "rules_translated": len(usable), "multi_pattern_rules": multi,
             "rules_skipped": len(rules) - len(usable), **{k: v for k, v in sat.items() if k != "stop"}, **ext,
             "extracted_cost_ms": extracted_ms, "kept_input": kept_input}
    return SearchResult(
        method="eqsat", graph=final_graph, initial=initial, final=final, trace=[], expansions=sat["iterations"],
        seconds=time.perf_counter() - t0, generated=sat["matches"], kept=sat["applied"], stop_reason=sat["stop"],
        nodes_before=len(graph.nodes), nodes_after=len(final_graph.nodes),
        settings={"node_limit": node_limit, "iter_limit": iter_limit, "time_limit_s": time_limit_s,
                  "ilp_time_limit_s": ilp_time_limit_s, "multi_iterations": multi_iterations,
                  "extraction": extraction},
        stats=stats)
