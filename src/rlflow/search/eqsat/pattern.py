"""Rules as patterns (egg's pattern.rs): e-matching a rule's source, the whole-match checks, and applying a match.

**Rules are data.** One generic e-matcher serves every rule: a rule's source pattern is matched top-down from its
*roots* (the pattern nodes no other pattern node reads); a pattern with several roots (TASO's two-output rules,
e.g. merging two MatMuls that share an input; Tensat's multi-patterns) joins its roots through their shared
variables (a rule whose roots share no variable, such as two independent Relus batched into one, is left out by
the runner: its matches are the cross product of the e-nodes of its ops; see :attr:`Pattern.joined`). A match is
checked exactly as the graph matcher checks one (literal attributes, parameters, shape expressions, ``const``
variables, a generated rule's verified ranks, ``no_broadcast``, and the target's shape inference giving each
mapped value the source value's type). As in the graph matcher, a pattern node of a commutative op
(``OpDef.commutative``: Add, Mul) reads its two child classes in either order, and an op instance whose two
children are one class is bound once, so no binding is found twice. Its target is then added and each mapped
source class merged with its target class. Which rules are matched when, and what is applied, is the runner's
business (:mod:`rlflow.search.eqsat.runner`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from rlflow.graph.ir import Constant
from rlflow.graph.ops import COMMUTATIVE
from rlflow.rewrite.matcher import _target_types
from rlflow.rewrite.rule import Rule, attr_equal, bound_ranks, constant_array, eval_attr, is_param
from rlflow.search.eqsat.egraph import CONST, INPUT, EGraph, Key, _Filtered

_REF = re.compile(r"%(\d+)(?:\.(\d+))?$")


class Pattern:
    """A rule's source pattern prepared for e-matching."""

    def __init__(self, rule: Rule):
        self.rule = rule
        self.src = rule.src
        self.ins = [[("node", int(m.group(1)), int(m.group(2) or 0)) if (m := _REF.match(r)) else ("var", r)
                     for r in pn.inputs] for pn in rule.src]
        used = {ref[1] for row in self.ins for ref in row if ref[0] == "node"}
        self.roots = [k for k in range(len(rule.src)) if k not in used]
        # per pattern node, the pattern nodes it reads: (input position, their op, which output)
        self.reads = [tuple((pos, rule.src[ref[1]].op, ref[2]) for pos, ref in enumerate(row) if ref[0] == "node")
                      for row in self.ins]
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
        self.comm = [pn.op in COMMUTATIVE and len(pn.inputs) == 2 for pn in rule.src]
        self.literal = [{a: v for a, v in pn.attrs.items() if not is_param(v) and not _has_expr(v)}
                        for pn in rule.src]
        self.param = [{a: v[1:] for a, v in pn.attrs.items() if is_param(v)} for pn in rule.src]
        self.expr = [{a: v for a, v in pn.attrs.items() if _has_expr(v)} for pn in rule.src]
        self.literal_ok: dict[tuple[int, str], bool] = {}  # (pattern node, attribute key) -> literals match
        self.var_ranks = bound_ranks(rule)  # variable -> the ranks it may bind (absent: any rank)
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
class Binding:
    """A match of a pattern: its pattern nodes bound to op instances, its variables to e-classes."""

    nodes: dict[int, tuple]          # pattern node -> instance (op, akey, n, kids)
    vars: dict[str, int]             # variable -> class
    params: dict[str, Any]
    kids: dict[int, tuple]           # pattern node -> its instance's kids in pattern order (a commutative op's
                                     # may be swapped)

    def key(self, rule_id: str) -> tuple:
        """The match's identity: a match is applied once, however often it is found again."""
        return (rule_id, tuple(sorted(self.nodes.items())), tuple(sorted(self.vars.items())))


class Index:
    """Per iteration: op instances by op, e-nodes by class, the instances with an output in a class by (class, op,
    output), and instances by (op, input position, class)."""

    def __init__(self, eg: EGraph):
        self.by_op: dict[str, dict[str, list[tuple]]] = {}  # op -> attribute key -> instances
        self.in_class: dict[int, list[Key]] = {}
        self.members: dict[tuple[int, str, int], list[tuple]] = {}  # (class, op, output j) -> instances
        self.uses: dict[tuple[str, int, int], list[tuple]] = {}
        self.cls: dict[Key, int] = {}
        self.parents: dict[int, set[int]] = {}
        self._viable: dict[tuple, tuple] = {}
        for key, c in eg.memo.items():
            self.in_class.setdefault(c, []).append(key)
            self.cls[key] = c
            for k in key[4]:
                if k >= 0:
                    self.parents.setdefault(k, set()).add(c)
            if key[0] in (INPUT, CONST):
                continue
            inst = (key[0], key[1], key[2], key[4])
            self.members.setdefault((c, key[0], key[3]), []).append(inst)
            if key[3] == 0:
                self.by_op.setdefault(key[0], {}).setdefault(key[1], []).append(inst)
                for pos, k in enumerate(key[4]):
                    self.uses.setdefault((key[0], pos, k), []).append(inst)

    def out_class(self, inst: tuple, j: int) -> int:
        return self.cls[(inst[0], inst[1], inst[2], j, inst[3])]

    def viable(self, groups: dict[str, list[tuple]], reads: tuple) -> dict[str, list[tuple]]:
        """``groups`` (attribute key -> instances, e.g. ``by_op[op]``) less the instances whose kids at ``reads``'
        positions (position, op, output) are classes holding no such e-node; cached: many rules share a root's
        op and what it reads."""
        key = (id(groups), reads)
        hit = self._viable.get(key)
        if hit is None:
            members = self.members
            kept = {a: insts for a, group in groups.items()
                    if (insts := [inst for inst in group
                                  if all((inst[3][pos], op, j) in members for pos, op, j in reads)])}
            hit = self._viable[key] = (groups, kept)  # groups is kept alive with its id
        return hit[1]

    def near(self, changed: set[int], depth: int) -> list[dict[str, dict[str, list[tuple]]]]:
        """Per depth d <= ``depth``: by op and attribute key, the op instances with an output class within d parent
        steps of a class in ``changed``."""
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


def find_bindings(eg: EGraph, ix: Index, p: Pattern, first: dict[str, dict[str, list[tuple]]] | None = None
                  ) -> Iterator[Binding]:
    """Every binding of ``p``'s source pattern to op instances of the e-graph (before the whole-match checks);
    ``first``, if given, holds (as ``ix.by_op``) the only instances the first root may bind."""
    src = p.src

    def literal_ok(k: int, op: str, akey: str) -> bool:
        ok = p.literal_ok.get((k, akey))
        if ok is None:  # an attribute key's attributes never change: checked once per pattern node
            attrs = eg.attrs[(op, akey)]
            ok = p.literal_ok[(k, akey)] = all(attr_equal(attrs[a], v) for a, v in p.literal[k].items())
        return ok

    members, comm, reads = ix.members, p.comm, p.reads

    def orders(k: int, kids: tuple) -> Sequence[tuple]:
        """The orders in which an instance with ``kids`` may bind pattern node ``k``'s inputs (a commutative op's
        two distinct kids: either), less those where a kid's class holds no e-node of the op the pattern reads
        there (:func:`chain` would bind nothing below it: the hot path of e-matching, checked first)."""
        out = (kids, (kids[1], kids[0])) if comm[k] and len(kids) == 2 and kids[0] != kids[1] else (kids,)
        rk = reads[k]
        if not rk:
            return out
        return [o for o in out if all((o[pos], op, j) in members for pos, op, j in rk)]

    def fit(k: int, inst: tuple, kids: tuple, st: Binding) -> Binding | None:
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
        for ref, c in zip(p.ins[k], kids):
            if ref[0] != "var":
                continue
            have = vars_.get(ref[1])
            if have is None:
                if c < 0 or (ref[1] in p.const_vars and not eg.static[c]) or \
                        (ref[1] in p.var_ranks and eg.type[c].rank not in p.var_ranks[ref[1]]):
                    return None
                vars_ = dict(vars_) if vars_ is st.vars else vars_
                vars_[ref[1]] = c
            elif have != c:
                return None
        return Binding({**st.nodes, k: inst}, vars_, params, {**st.kids, k: kids})

    def below(k: int, st: Binding) -> Iterator[Binding]:
        """Match the pattern nodes that node k (bound) reads."""
        todo = [(ref, c) for ref, c in zip(p.ins[k], st.kids[k]) if ref[0] == "node"]
        yield from chain(todo, 0, st)

    def chain(todo: list, i: int, st: Binding) -> Iterator[Binding]:
        if i == len(todo):
            yield st
            return
        (_, m, j), c = todo[i]
        if m in st.nodes:
            if ix.out_class(st.nodes[m], j) == c:
                yield from chain(todo, i + 1, st)
            return
        for inst in members.get((c, src[m].op, j), ()):
            for kids in orders(m, inst[3]):
                if (s2 := fit(m, inst, kids, st)) is not None:
                    for s3 in below(m, s2):
                        yield from chain(todo, i + 1, s3)

    def roots(i: int, st: Binding) -> Iterator[Binding]:
        if i == len(p.roots):
            yield st
            return
        k = p.roots[i]
        cands = None
        for pos, ref in enumerate(p.ins[k]):  # a variable already bound: only the instances that read it there
            if ref[0] == "var" and ref[1] in st.vars:
                c = st.vars[ref[1]]
                if p.comm[k]:  # at either input, each instance once
                    op = src[k].op
                    cands = list(dict.fromkeys([*ix.uses.get((op, 0, c), ()), *ix.uses.get((op, 1, c), ())]))
                else:
                    cands = ix.uses.get((src[k].op, pos, c), ())
                break
        checked = False
        if cands is None:  # every instance of the op whose literal attributes match
            op = src[k].op
            groups = (first if i == 0 and first is not None else ix.by_op).get(op, {})
            if reads[k] and not comm[k]:  # and whose kids hold what the pattern reads: orders() is then done
                groups, checked = ix.viable(groups, reads[k]), True
            cands = [inst for akey, group in groups.items() if literal_ok(k, op, akey) for inst in group]
        for inst in cands:
            for kids in (inst[3],) if checked else orders(k, inst[3]):
                if (s2 := fit(k, inst, kids, st)) is not None:
                    for s3 in below(k, s2):
                        yield from roots(i + 1, s3)

    yield from roots(0, Binding({}, {}, {}, {}))


def check(eg: EGraph, ix: Index, p: Pattern, st: Binding) -> tuple[dict, dict] | None:
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


def apply_match(eg: EGraph, p: Pattern, st: Binding, refs: dict, dt: dict) -> int | None:
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

