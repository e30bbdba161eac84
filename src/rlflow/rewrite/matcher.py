"""Find where rules apply (matches) and apply them; keep all matches of a rule set up to date incrementally.

One generic engine serves every rule:

- :func:`find_matches(graph, rule)` lists the rule's matches in a deterministic order (by the positions of the
  matched nodes in the graph's topological order). A match binds every source pattern node to a distinct graph
  node and every variable to a graph value, such that ops, input wiring, literal attributes, parameters
  (equal wherever used), shape expressions and ``constraints.const`` hold, and:
    * a pattern node of a commutative op (``OpDef.commutative``: Add, Mul) reads its two inputs in either order:
      ``Add(x, relu(y))`` matches ``Add(relu(b), a)``, so no rule that only swaps operands is needed; a node
      whose two inputs are one value is bound once, and a match is listed once however it was found;
    * every value a matched node produces that is read outside the match (or is a graph output) is mapped by
      the rule, and no variable is produced by a matched node;
    * applying it cannot create a cycle (no variable depends on a matched node through outside nodes);
    * the target's shape inference succeeds and each mapped target value has the same type as the source value
      it replaces;
    * with ``constraints.no_broadcast``, no broadcasting op (Add, Mul, ...) of either side reads inputs of two
      shapes;
    * the graph's opset is at least the rule's ``constraints.min_opset`` (a fused op of a newer opset).
- :func:`apply(graph, match)` returns a new, valid graph; the input graph is unchanged.
- :class:`MatchIndex` holds the matches of all rules on one graph; ``index.apply(k, j)`` applies match ``j`` of
  rule ``k`` and returns the new index, re-matching only around the changed region (see ``_region``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence


from rlflow.errors import RLFlowError
from rlflow.graph.fold import static_values
from rlflow.graph.ir import Constant, Graph, Node, TensorType, _canonical
from rlflow.graph.ops import COMMUTATIVE, infer_types
from rlflow.rewrite.rule import Rule, attr_equal, bound_ranks, broadcasts, constant_array, eval_attr, is_param

_REF = re.compile(r"%(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True)
class Match:
    """Where a rule applies: graph node names in source-pattern order, variable bindings, parameter values."""

    rule: Rule
    nodes: tuple[str, ...]
    bindings: tuple[tuple[str, str], ...]     # (variable, graph value)
    params: tuple[tuple[str, Any], ...]


# ============================================================================================ compiled patterns
class _Compiled:
    """A rule's source pattern prepared for matching: for each possible start node, a search order in which
    every later pattern node is reached through an already-bound neighbour where possible."""

    def __init__(self, rule: Rule):
        self.rule = rule
        self.src = rule.src
        self.n = len(rule.src)
        # input refs parsed: ("node", j, out) or ("var", name)
        self.ins: list[list[tuple]] = []
        for pn in rule.src:
            row = []
            for r in pn.inputs:
                m = _REF.match(r)
                row.append(("node", int(m.group(1)), int(m.group(2) or 0)) if m else ("var", r))
            self.ins.append(row)
        self.users: list[list[tuple[int, int, int]]] = [[] for _ in range(self.n)]  # j -> (k, input pos, out)
        for k, row in enumerate(self.ins):
            for pos, ref in enumerate(row):
                if ref[0] == "node":
                    self.users[ref[1]].append((k, pos, ref[2]))
        self.literal_attrs = [{a: v for a, v in pn.attrs.items() if not is_param(v) and not isinstance(v, dict)
                               and not _has_expr(v)} for pn in rule.src]
        self.param_attrs = [{a: v[1:] for a, v in pn.attrs.items() if is_param(v)} for pn in rule.src]
        self.expr_attrs = [{a: v for a, v in pn.attrs.items() if isinstance(v, dict) or _has_expr(v)}
                           for pn in rule.src]
        self.ops = {pn.op for pn in rule.src}
        #: per pattern node: does it read its two inputs in either order
        self.comm = [pn.op in COMMUTATIVE and len(pn.inputs) == 2 for pn in rule.src]
        self.orders = [self._order(s) for s in range(self.n)]
        mapped = set()
        for s, _ in rule.outputs:
            m = _REF.match(s)
            mapped.add((int(m.group(1)), int(m.group(2) or 0)))
        self.mapped = mapped
        self.const_vars = rule.const_vars
        # a generated rule was verified only at its variables' recorded ranks (its symbolic inputs): bind only
        # those (a literal axis may mean something else at another rank), except its rank-general variables;
        # builtins are written for any rank
        self.var_ranks = bound_ranks(rule)
        self.cuts = _cuts_paths(rule)
        #: every pattern node is reached from the others through an edge or a shared variable (each binding then
        #: narrows the next; an unconnected pattern, relu(a) and relu(b), pairs any two nodes of its ops)
        self.connected = self._connected()

    def _connected(self) -> bool:
        near = [{ref[1] for ref in self.ins[k] if ref[0] == "node"} | {u for u, _, _ in self.users[k]}
                | {d for d in range(self.n) for ref in self.ins[k] if ref[0] == "var" and ref in self.ins[d]}
                for k in range(self.n)]
        seen, todo = {0}, [0]
        while todo:
            for j in near[todo.pop()] - seen:
                seen.add(j)
                todo.append(j)
        return len(seen) == self.n

    def _order(self, start: int) -> list[int]:
        order, done = [start], {start}
        while len(order) < self.n:
            best = None
            for k in range(self.n - 1, -1, -1):
                if k in done:
                    continue
                # 2: feeds a bound node (its producer is fixed); 1: reads a bound node or shares a variable
                feeds = any(u in done for u, _, _ in self.users[k])
                reads = any(ref[0] == "node" and ref[1] in done for ref in self.ins[k])
                shares = any(ref[0] == "var" and any(r2 == ref for d in done for r2 in self.ins[d])
                             for ref in self.ins[k])
                score = 2 if feeds else 1 if (reads or shares) else 0
                if best is None or score > best[0]:
                    best = (score, k)
            order.append(best[1])
            done.add(best[1])
        return order


def _has_expr(v: Any) -> bool:
    return isinstance(v, dict) or (isinstance(v, tuple) and any(_has_expr(x) for x in v))


def _input_orders(c: _Compiled, k: int, inputs: tuple) -> tuple[tuple, ...]:
    """The orders in which a node with ``inputs`` may bind pattern node ``k``'s inputs: as they are, and swapped
    for a commutative pattern node with two different inputs."""
    if c.comm[k] and len(inputs) == 2 and inputs[0] != inputs[1]:
        return inputs, (inputs[1], inputs[0])
    return (inputs,)


_CACHE: dict[int, _Compiled] = {}


def _compiled(rule: Rule) -> _Compiled:
    c = _CACHE.get(id(rule))
    if c is None or c.rule is not rule:
        c = _CACHE[id(rule)] = _Compiled(rule)
    return c


# ============================================================================================ graph views
class _View:
    """Lookups over one graph, built once: nodes by name and op, producers, consumers, positions."""

    def __init__(self, g: Graph):
        self.g = g
        self.by_name = {n.name: n for n in g.nodes}
        self.pos = {n.name: i for i, n in enumerate(g.nodes)}
        self.by_op: dict[str, list[Node]] = {}
        for n in g.nodes:
            self.by_op.setdefault(n.op, []).append(n)
        self.producer: dict[str, Node] = {v: n for n in g.nodes for v in n.outputs}
        self.consumers: dict[str, list[Node]] = {}
        for n in g.nodes:
            for v in n.inputs:
                self.consumers.setdefault(v, []).append(n)
        self.graph_outputs = set(g.outputs)
        # static values: constants, and outputs of nodes that read static values only (weights being reshaped,
        # concatenated, enlarged...: computable ahead of time, folded after a search)
        self.static = static_values(g)[0]
        self._ancestors: dict[str, int] | None = None

    @property
    def ancestors(self) -> dict[str, int]:
        """Per node, the set of nodes it depends on (itself included) as a bit mask over positions; built on
        first use (the graph's nodes are in topological order)."""
        if self._ancestors is None:
            anc: dict[str, int] = {}
            for n in self.g.nodes:
                mask = 1 << self.pos[n.name]
                for v in n.inputs:
                    p = self.producer.get(v)
                    if p is not None:
                        mask |= anc[p.name]
                anc[n.name] = mask
            self._ancestors = anc
        return self._ancestors


# ============================================================================================ matching
def _search(view: _View, c: _Compiled, starts: Iterable[tuple[int, Iterable[Node]]], out: dict,
            blocked: dict | None = None) -> None:
    """Backtracking search, for each ``(start, start_nodes)``, with pattern node ``start`` bound to each of
    ``start_nodes``; adds matches to ``out`` (and, given ``blocked``, the ones ruled out only as cycles to it,
    keyed alike)."""
    if view.g.opset < c.rule.min_opset:  # the target needs a newer opset than the graph's
        return
    src = c.src
    bound: list[Node | None] = [None] * c.n
    ins: list[tuple] = [()] * c.n  # the bound nodes' inputs, in pattern order (a commutative node's may be swapped)
    used: set[str] = set()
    vars_: dict[str, str] = {}
    params: dict[str, Any] = {}

    def fits(k: int, node: Node, inputs: tuple) -> list | None:
        """Check node, reading ``inputs`` in that order, for pattern node k; returns the undo list (new var/param
        bindings) or None."""
        if node.name in used or not _node_fits(c, k, node):
            return None
        attrs = node.attrs
        new_vars, new_params = [], []
        for pos, ref in enumerate(c.ins[k]):
            val = inputs[pos]
            if ref[0] == "var":
                have = vars_.get(ref[1])
                if have is None:
                    if ref[1] in c.const_vars and val not in view.static:
                        break
                    if ref[1] in c.var_ranks and view.g.types[val].rank not in c.var_ranks[ref[1]]:
                        break
                    vars_[ref[1]] = val
                    new_vars.append(ref[1])
                elif have != val:
                    break
            else:
                j, o = ref[1], ref[2]
                if bound[j] is not None and bound[j].outputs[o] != val:
                    break
        else:
            for u, pos, o in c.users[k]:  # bound users must read this node's output
                if bound[u] is not None and ins[u][pos] != node.outputs[o]:
                    break
            else:
                for a, p in c.param_attrs[k].items():
                    have = params.get(p, _MISSING)
                    if have is _MISSING:
                        params[p] = attrs[a]
                        new_params.append(p)
                    elif not attr_equal(have, attrs[a]):
                        break
                else:
                    return [new_vars, new_params]
        for v in new_vars:
            del vars_[v]
        for p in new_params:
            del params[p]
        return None

    def candidates(k: int) -> Iterable[Node]:
        for u, pos, o in c.users[k]:  # k produces an input of a bound node: one candidate
            if bound[u] is not None:
                n = view.producer.get(ins[u][pos])
                return [n] if n is not None and o < len(n.outputs) and n.outputs[o] == ins[u][pos] else []
        for pos, ref in enumerate(c.ins[k]):  # k reads a bound value: its consumers (that read it there)
            val = vars_.get(ref[1]) if ref[0] == "var" else (
                bound[ref[1]].outputs[ref[2]] if bound[ref[1]] is not None else None)
            if val is not None:
                # each reader once, in order (Add(v, v) is listed twice among v's consumers)
                readers = {n.name: n for n in view.consumers.get(val, ())}.values()
                if c.comm[k]:
                    return [n for n in readers if len(n.inputs) == 2]
                return [n for n in readers if pos < len(n.inputs) and n.inputs[pos] == val]
        return view.by_op.get(src[k].op, ())

    def rec(order: list[int], i: int, start_nodes: Iterable[Node]) -> None:
        if i == len(order):
            m = _finish(view, c, bound, vars_, params, blocked)
            if m is not None:
                out.setdefault((m.nodes, m.bindings), m)
            return
        k = order[i]
        for node in (start_nodes if i == 0 else candidates(k)):
            for inputs in _input_orders(c, k, node.inputs):
                undo = fits(k, node, inputs)
                if undo is None:
                    continue
                bound[k], ins[k] = node, inputs
                used.add(node.name)
                rec(order, i + 1, start_nodes)
                bound[k] = None
                used.discard(node.name)
                for v in undo[0]:
                    del vars_[v]
                for p in undo[1]:
                    del params[p]

    for start, start_nodes in starts:
        rec(c.orders[start], 0, start_nodes)


_MISSING = object()


def _finish(view: _View, c: _Compiled, bound: list[Node], vars_: dict[str, str], params: dict[str, Any],
            blocked: dict | None = None) -> Match | None:
    """The checks that need the whole match: shape expressions, outside readers, cycles, target types. A match
    that fails only as a cycle goes to ``blocked`` when given (a rewrite elsewhere that removes a path may
    unblock it: :meth:`MatchIndex.apply`)."""
    g = view.g
    rule = c.rule
    refs: dict[str, str] = dict(vars_)
    for k, node in enumerate(bound):
        for j, v in enumerate(node.outputs):
            refs[f"%{k}.{j}"] = v
            if j == 0:
                refs[f"%{k}"] = v
    type_of = lambda r: g.types[refs[r]]  # noqa: E731
    try:
        for k, exprs in enumerate(c.expr_attrs):
            for a, e in exprs.items():
                if not attr_equal(bound[k].attrs[a], eval_attr(e, type_of, params)):
                    return None
    except (IndexError, KeyError, TypeError, ValueError):
        return None
    names = {n.name for n in bound}
    produced = {v for n in bound for v in n.outputs}
    if any(v in produced for v in vars_.values()):
        return None
    for k, node in enumerate(bound):  # values read outside the match must be mapped
        for j, v in enumerate(node.outputs):
            if (k, j) in c.mapped:
                continue
            if v in view.graph_outputs or any(u.name not in names for u in view.consumers.get(v, ())):
                return None
    cyclic = len(bound) > 1 and _creates_cycle(view, names, vars_.values())
    if cyclic and blocked is None:
        return None
    if _target_types(rule, refs, g.types, params) is None:
        return None
    m = Match(rule, tuple(n.name for n in bound), tuple(sorted(vars_.items())), tuple(sorted(params.items())))
    if cyclic:
        blocked.setdefault((m.nodes, m.bindings), m)
        return None
    return m


def _creates_cycle(view: _View, matched: set[str], var_values: Iterable[str]) -> bool:
    """Does some variable depend on a matched node through nodes outside the match? (A variable is never produced
    by a matched node, so that is: some matched node is an ancestor of a variable's producer.)"""
    pos, anc = view.pos, view.ancestors
    mask = 0
    for n in matched:
        mask |= 1 << pos[n]
    for v in var_values:
        p = view.producer.get(v)
        if p is not None and anc[p.name] & mask:
            return True
    return False


def _target_types(rule: Rule, refs: dict[str, str], types: dict[str, TensorType], params: dict[str, Any]
                  ) -> dict[str, TensorType] | None:
    """Types of the target's values (keyed by target ref), or None if its shape inference fails or a mapped
    value's type differs from the source value it replaces."""
    dt: dict[str, TensorType] = {}

    def type_of(r: str) -> TensorType:
        return dt[r] if r.startswith("%") else types[refs[r]]

    if rule.no_broadcast and any(broadcasts(pn.op, [types[refs[r]] for r in pn.inputs]) for pn in rule.src):
        return None
    try:
        for k, pn in enumerate(rule.dst):
            attrs = {a: eval_attr(e, type_of, params) for a, e in pn.attrs.items()}
            if rule.no_broadcast and broadcasts(pn.op, [type_of(r) for r in pn.inputs]):
                return None
            if pn.op == "Constant":
                shape = tuple(attrs.get("shape", ()))
                if any(not isinstance(d, int) or d < 1 for d in shape):
                    return None
                dt[f"%{k}"] = dt[f"%{k}.0"] = TensorType(shape, "float32")
                continue
            outs = infer_types(Node("t", pn.op, tuple(pn.inputs), tuple(f"o{j}" for j in range(pn.n_outputs)),
                                    attrs), [type_of(r) for r in pn.inputs])
            if len(outs) != pn.n_outputs:
                return None
            for j, t in enumerate(outs):
                dt[f"%{k}.{j}"] = t
                if j == 0:
                    dt[f"%{k}"] = t
    except (RLFlowError, IndexError, KeyError, TypeError, ValueError):
        return None
    for s, d in rule.outputs:
        if type_of(d) != types[refs[_norm(s)]]:
            return None
    return dt


def _norm(ref: str) -> str:
    m = _REF.match(ref)
    return f"%{m.group(1)}.{m.group(2) or 0}" if m else ref


def _sorted(view: _View, matches: Iterable[Match]) -> list[Match]:
    return sorted(matches, key=lambda m: (tuple(sorted(view.pos[n] for n in m.nodes)),
                                          tuple(view.pos[n] for n in m.nodes), m.bindings))


def find_matches(graph: Graph, rule: Rule, _view: _View | None = None, _blocked: dict | None = None
                 ) -> list[Match]:
    """Every match of ``rule`` in ``graph``, in a deterministic order (``_blocked``: see :func:`_search`)."""
    view = _view or _View(graph)
    c = _compiled(rule)
    if any(op not in view.by_op for op in c.ops):
        return []
    start = min(range(c.n), key=lambda k: (len(view.by_op[c.src[k].op]), -k))  # the rarest op first
    out: dict = {}
    _search(view, c, [(start, view.by_op[c.src[start].op])], out, _blocked)
    return _sorted(view, out.values())


def _cuts_paths(rule: Rule) -> bool:
    """Whether applying ``rule`` can remove a dependency path of the graph: some output of its target depends
    on fewer of the match's input values than the source output it replaces (unbatching a Concat-op-Split,
    ``split(relu(concat(a, b))) -> relu(a), relu(b)``, makes the first output independent of ``b``). Matches
    anywhere in the graph that a cycle ruled out may then become valid."""
    def deps(side: tuple) -> list[set[str]]:
        out: list[set[str]] = []
        for pn in side:
            s: set[str] = set()
            for r in pn.inputs:
                m = _REF.match(r)
                s |= out[int(m.group(1))] if m else {r}
            out.append(s)
        return out

    def of(d: list[set[str]], ref: str) -> set[str]:
        m = _REF.match(ref)
        return d[int(m.group(1))] if m else {ref}

    src, dst = deps(rule.src), deps(rule.dst)
    return any(of(dst, b) < of(src, a) for a, b in rule.outputs)


# ============================================================================================ applying
def apply(graph: Graph, match: Match) -> Graph:
    """The graph with ``match``'s source nodes replaced by the rule's target; ``graph`` is unchanged."""
    new, _, _ = _apply(graph, match)
    return new


def _apply(graph: Graph, match: Match) -> tuple[Graph, set[str], list[str]]:
    """(new graph, removed node names, changed node names: the added nodes and the readers rewired to a
    replacement value). ``new.next_id`` has advanced."""
    rule = match.rule
    removed = set(match.nodes)
    by_name = {n.name: n for n in graph.nodes}
    refs: dict[str, str] = dict(match.bindings)
    for k, name in enumerate(match.nodes):
        for j, v in enumerate(by_name[name].outputs):
            refs[f"%{k}.{j}"] = v
    params = dict(match.params)
    # which source value each target output replaces: the target node writes the source value's own name, so
    # every outside reader stays as it is
    replaces: dict[str, str] = {}
    rename: dict[str, str] = {}
    for s, d in rule.outputs:
        sv = refs[_norm(s)]
        if _REF.match(d) and _norm(d) not in replaces:
            replaces[_norm(d)] = sv
        else:
            rename[sv] = _norm(d)  # resolved below, once the target's value names exist
    types = dict(graph.types)
    constants = graph.constants
    taken = set(types)
    counter = [graph.next_id]

    def fresh(prefix: str) -> str:
        while True:
            name = f"{prefix}{counter[0]}"
            counter[0] += 1
            if name not in taken and name not in by_name:
                taken.add(name)
                return name

    dst_vals: dict[str, str] = {}
    type_of = lambda r: types[dst_vals[_norm(r)]] if r.startswith("%") else types[refs[r]]  # noqa: E731
    added: list[Node] = []
    for k, pn in enumerate(rule.dst):
        attrs = {a: eval_attr(e, type_of, params) for a, e in pn.attrs.items()}
        if pn.op == "Constant":
            name = fresh("_c")
            if constants is graph.constants:
                constants = dict(constants)
            constants[name] = Constant(constant_array(attrs))
            types[name] = constants[name].type
            dst_vals[f"%{k}.0"] = name
            continue
        ins = tuple(dst_vals[_norm(r)] if r.startswith("%") else refs[r] for r in pn.inputs)
        outs = tuple(replaces.get(f"%{k}.{j}") or fresh("_v") for j in range(pn.n_outputs))
        node = Node(fresh("_n"), pn.op, ins, outs, attrs)
        for v, t in zip(outs, infer_types(node, [types[v] for v in ins])):
            types[v] = t
            dst_vals[f"%{k}.{outs.index(v)}"] = v
        added.append(node)
    for sv, d in list(rename.items()):
        rename[sv] = dst_vals[d] if d.startswith("%") else refs[d]
    added_block = list(added)
    rewired: list[str] = []  # readers whose input now names the replacement value: changed nodes too
    nodes = []
    first = None
    for i, n in enumerate(graph.nodes):
        if n.name in removed:
            if first is None:
                first = len(nodes)
                nodes.extend(added)
            continue
        if rename and any(v in rename for v in n.inputs):
            n = Node(n.name, n.op, tuple(rename.get(v, v) for v in n.inputs), n.outputs, n.attrs)
            rewired.append(n.name)
        nodes.append(n)
    outputs = list(graph.outputs)
    if rename:
        for k, v in enumerate(outputs):
            if v in rename:  # a graph output keeps its name: an Identity carries the replacement value
                ident = Node(fresh("_n"), "Identity", (rename[v],), (v,), {})
                nodes.append(ident)
                added.append(ident)
    for sv in [v for n in graph.nodes if n.name in removed for v in n.outputs]:
        if sv not in replaces.values() and sv not in outputs:
            types.pop(sv, None)
    new = Graph(inputs=graph.inputs, outputs=outputs, nodes=nodes, types=types, constants=constants,
                name=graph.name, opset=graph.opset, extra_opsets=graph.extra_opsets)
    new.next_id = counter[0]
    # the target nodes sit where the first removed node was; a variable made after that point would be read
    # before it is made: then re-sort (deterministically)
    if first is not None:
        defined = {v for n in nodes[first + len(added_block):] for v in n.outputs}
        if any(v in defined for n in added_block for v in n.inputs):
            new = new.toposorted()
            new.next_id = counter[0]
    return new, removed, [n.name for n in added] + rewired


# ============================================================================================ incremental index
class MatchIndex:
    """The matches of every rule of a rule set on one graph.

    ``MatchIndex(graph, rules)`` matches from scratch. ``index.apply(rule_index, match_index)`` returns the index
    of the rewritten graph, computed incrementally: matches that touch the changed region are dropped and searched
    again around it; multi-node matches elsewhere are only re-checked for cycles (merging ops can create new
    dependency paths far from the rewrite).

    Only a rewrite that can remove a dependency path (a rule that cuts paths, :func:`_cuts_paths`) can make a
    match that was a cycle valid, wherever it lies. So the index keeps, per rule with a connected pattern, the
    matches ruled out only as cycles (``blocked``), and such a rewrite re-checks those; rules whose pattern is not
    connected (their candidates are pairs of any two nodes) are matched again from scratch then. (bert, random
    agent: a step with such a rule took 77 ms matching every multi-node rule again, 12 ms with this.)
    """

    def __init__(self, graph: Graph, rules: Sequence[Rule]):
        self.graph = graph
        self.rules = list(rules)
        self.view = _View(graph)
        self._rules = _RuleSet.of(self.rules)
        self.matches: list[list[Match]] = []
        self.blocked: list[list[Match]] = []
        for r, c in zip(self.rules, self._rules.compiled):
            blocked: dict | None = {} if c.connected else None
            self.matches.append(find_matches(graph, r, self.view, blocked))
            self.blocked.append(list(blocked.values()) if blocked else [])

    def counts(self) -> list[int]:
        return [len(m) for m in self.matches]

    def keys(self) -> tuple[list, list]:
        """What the index holds, comparable between indexes: per rule its matches' (nodes, bindings) in order,
        and its blocked ones' sorted (an incrementally updated index equals one matched from scratch)."""
        return ([[(m.nodes, m.bindings) for m in ms] for ms in self.matches],
                [sorted((m.nodes, m.bindings) for m in ms) for ms in self.blocked])

    def apply(self, rule_index: int, match_index: int) -> "MatchIndex":
        match = self.matches[rule_index][match_index]
        new, removed, added = _apply(self.graph, match)
        view = _View(new)
        region = _region(view, self.view, removed, added)
        rs = self._rules
        # per rule to search, per start position, the region nodes that can be bound there at all (op, arity,
        # literal attributes, input ranks: what fits() checks first, looked up per node signature)
        present = view.by_op.keys()
        search: dict[int, dict[int, list[Node]]] = {}
        for name in region:
            n = view.by_name.get(name)
            if n is None:
                continue
            for k, start in rs.starts_for(n, view):
                if rs.opsets[k] <= present:
                    search.setdefault(k, {}).setdefault(start, []).append(n)
        stale = removed | region
        # the kept matches keep their relative order unless the apply had to re-sort the graph's nodes
        seq = [self.view.pos[n.name] for n in new.nodes if n.name in self.view.pos]
        resorted = any(a > b for a, b in zip(seq, seq[1:]))
        # a kept match can only become cyclic through a new path via the added nodes, which needs an added node
        # strictly inside the match's window of topological positions
        added_pos = sorted(view.pos[n] for n in added)
        # only rules with matches or blocked ones (to drop stale ones) and rules that can match a region node (to
        # search) change
        visit = sorted(search.keys() | {k for k, (m, b) in enumerate(zip(self.matches, self.blocked)) if m or b})
        matches, blocked = list(self.matches), list(self.blocked)
        cuts = rs.compiled[rule_index].cuts
        if cuts:  # the unconnected multi-node rules: from scratch
            for k, c in enumerate(rs.compiled):
                if c.n > 1 and not c.connected:
                    matches[k] = find_matches(new, rs.rules[k], view)
            visit = [k for k in visit if rs.compiled[k].n == 1 or rs.compiled[k].connected]
        for k in visit:
            c, old = rs.compiled[k], self.matches[k]
            keep, still = [], ({} if c.connected else None)
            for m in old:
                if not stale.isdisjoint(m.nodes):
                    continue
                if len(m.nodes) > 1 and added_pos:
                    lo, hi = min(view.pos[n] for n in m.nodes), max(view.pos[n] for n in m.nodes)
                    if any(lo < p < hi for p in added_pos) and \
                            _creates_cycle(view, set(m.nodes), dict(m.bindings).values()):
                        if still is not None:
                            still[(m.nodes, m.bindings)] = m
                        continue
                keep.append(m)
            freed = []
            for m in self.blocked[k]:
                if not stale.isdisjoint(m.nodes):
                    continue
                if cuts and not _creates_cycle(view, set(m.nodes), dict(m.bindings).values()):
                    freed.append(m)
                else:
                    still[(m.nodes, m.bindings)] = m
            if k not in search and not freed:
                matches[k] = _sorted(view, keep) if resorted else keep
            else:
                found: dict = {(m.nodes, m.bindings): m for m in keep + freed}
                if k in search:
                    _search(view, c, sorted(search[k].items()), found, still)
                matches[k] = _sorted(view, found.values()) if len(found) != len(keep) or resorted else keep
            if still is not None:
                blocked[k] = list(still.values())
        idx = MatchIndex.__new__(MatchIndex)
        idx.graph, idx.rules, idx.view, idx.matches, idx.blocked, idx._rules = new, self.rules, view, matches, \
            blocked, rs
        return idx


class _RuleSet:
    """A rule list's compiled patterns and, per op, the rules whose source uses it (shared by every index)."""

    _last: "_RuleSet | None" = None

    def __init__(self, rules: list[Rule]):
        self.rules = rules
        self.compiled = [_compiled(r) for r in rules]
        self.opsets = [frozenset(c.ops) for c in self.compiled]
        #: op -> (rule index, pattern position) of every source pattern node with that op
        self.by_op: dict[str, list[tuple[int, int]]] = {}
        for k, c in enumerate(self.compiled):
            for start, pn in enumerate(c.src):
                self.by_op.setdefault(pn.op, []).append((k, start))
        self._starts: dict[tuple, list[tuple[int, int]]] = {}

    def starts_for(self, node: Node, view: _View) -> list[tuple[int, int]]:
        """The (rule index, pattern position) pairs where ``node`` passes :func:`_fits_alone`: the checks of
        :func:`_search` that depend on the node and its neighbours' ops alone. Cached per node signature, so
        each signature is checked against the rules once per rule set."""
        types = view.g.types
        ranks = tuple(types[v].rank if v in types else -1 for v in node.inputs)
        makers = []
        for v in node.inputs:
            p = view.producer.get(v)
            makers.append(None if p is None else (p.op, p.outputs.index(v)))
        readers = tuple(frozenset((u.op, pos) for u in view.consumers.get(v, ()) for pos, w in enumerate(u.inputs)
                                  if w == v) for v in node.outputs)
        key = (node.op, len(node.outputs), ranks, tuple(makers), readers,
               tuple(sorted((a, _canonical(v)) for a, v in node.attrs.items())))
        hit = self._starts.get(key)
        if hit is None:
            hit = self._starts[key] = [(k, start) for k, start in self.by_op.get(node.op, ())
                                       if _fits_alone(self.compiled[k], start, node, ranks, makers, readers)]
        return hit

    @classmethod
    def of(cls, rules: list[Rule]) -> "_RuleSet":
        last = cls._last
        if last is None or len(last.rules) != len(rules) or any(a is not b for a, b in zip(last.rules, rules)):
            last = cls._last = cls(rules)
        return last


def _node_fits(c: _Compiled, k: int, node: Node) -> bool:
    """``node`` has pattern node ``k``'s op, numbers of inputs and outputs, and literal attributes."""
    pn = c.src[k]
    if node.op != pn.op or len(node.inputs) != len(pn.inputs) or len(node.outputs) != pn.n_outputs:
        return False
    attrs = node.attrs
    for a, v in c.literal_attrs[k].items():
        if not attr_equal(attrs[a], v):
            return False
    return True


def _fits_alone(c: _Compiled, k: int, node: Node, ranks: tuple[int, ...], makers: list, readers: tuple) -> bool:
    """The binding-free part of ``fits`` (in :func:`_search`) for pattern node ``k``: :func:`_node_fits`, the
    ranks of the values its variables would bind (a generated rule binds only the ranks it was verified at), and
    one hop out: an input the pattern takes from pattern node ``j`` must come from a node of
    ``j``'s op (that output of it), and an output the pattern feeds to pattern node ``u`` must be read by a
    node of ``u``'s op at that input (at either input for a commutative ``u``; a commutative ``k`` passes if
    either order of its inputs does). ``makers``: per input, the producer's (op, output index) or None;
    ``readers``: per output, the (op, input position) of its readers. A node that fails here fits nowhere as
    pattern node ``k``; one that passes may still fail on bindings."""
    if not _node_fits(c, k, node):
        return False

    def inputs_fit(order: tuple[int, ...]) -> bool:
        for pos, ref in zip(order, c.ins[k]):
            if ref[0] == "var":
                if ref[1] in c.var_ranks and ranks[pos] not in c.var_ranks[ref[1]]:
                    return False
            elif makers[pos] != (c.src[ref[1]].op, ref[2]):
                return False
        return True

    if not any(inputs_fit(order) for order in _input_orders(c, k, tuple(range(len(node.inputs))))):
        return False
    return all(any((c.src[u].op, p) in readers[o] for p in ((0, 1) if c.comm[u] else (pos,)))
               for u, pos, o in c.users[k])


def _region(view: _View, old: _View, removed: set[str], added: list[str]) -> set[str]:
    """Nodes whose matches may have changed: the added nodes, the producers of every value a removed or added
    node read (their outside readers changed), and the readers of the added nodes' outputs."""
    region = set(added)
    for name in list(removed):
        for v in old.by_name[name].inputs:
            p = view.producer.get(v)
            if p is not None:
                region.add(p.name)
    for name in added:
        n = view.by_name[name]
        for v in n.inputs:
            p = view.producer.get(v)
            if p is not None:
                region.add(p.name)
        for v in n.outputs:
            region.update(u.name for u in view.consumers.get(v, ()))
    return region
