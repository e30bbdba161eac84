"""The e-graph (egg's egraph.rs): typed e-classes, hash-consed e-nodes, union-find, rebuild and cycle filtering.

**E-graph.** Every value of the graph is an e-class; an e-node is one output of one op application
``(op, attributes, number of outputs, output index, child e-classes)``, so a multi-output op (Split) is one
*instance* with one e-node per output. Graph inputs, weights (merged by content) and the constants a rule makes
are leaf e-nodes. Each e-class carries its :class:`TensorType` (the shape analysis: an e-node's type comes from
the op registry's shape inference, and only classes of equal type are ever merged) and whether it is *static*
(computable from weights only, which the rules' ``const`` constraints ask for). Unions are repaired with the
usual rebuild (congruence closure: e-nodes that become equal after a union merge their classes). Tensat's cycle
filtering (:meth:`EGraph.remove_cycles`, which the runner calls after each iteration) removes the newest e-node
of every cycle among the e-classes for good, so extraction never meets a cycle.
"""

from __future__ import annotations

from typing import Any, Sequence

from rlflow.errors import RLFlowError
from rlflow.graph.ir import Constant, Graph, Node, TensorType
from rlflow.graph.ops import infer_types

#: the ops of leaf e-nodes: a graph input (by name) and a weight or rule-made constant (by content)
INPUT, CONST = "$input", "$const"

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

    @property
    def n_classes(self) -> int:
        """The number of e-classes (``len(self.classes())`` without building the lists)."""
        return len({self.find(c) for c in self.memo.values()})

    # ------------------------------------------------------------------ adding
    def add_input(self, name: str, t: TensorType) -> int:
        key = (INPUT, name, 1, 0, ())
        if key not in self.memo:
            self.memo[key] = self._new_class(t, False)
            self.leaves[key] = ("input", name)
        return self.find(self.memo[key])

    def add_const(self, c: Constant) -> int:
        key = (CONST, c.digest.hex(), 1, 0, ())
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
        # no merge happens here, so the classes, the e-nodes' ages and the class sizes are taken once; the
        # edges lose those of each e-node removed (in order, so every search sees what a fresh one would)
        edges = self._class_edges()
        age = {k: i for i, k in enumerate(self.memo)}
        size: dict[int, int] = {}
        for c in self.memo.values():
            size[self.find(c)] = size.get(self.find(c), 0) + 1
        while True:
            cycles = self._class_cycles(edges)
            if not cycles:
                return removed
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
                            c = self.find(self.memo.pop(k))
                            if c in edges:
                                edges[c] = [e for e in edges[c] if e[0] != k]
                        self.filtered.update(outs)
                        for c, n in lose.items():
                            size[c] -= n
                        removed += len(outs)
                        break
                else:
                    raise RLFlowError("eqsat: a cycle of e-classes that no e-node can be removed from")

    def _class_edges(self) -> dict[int, list[tuple[Key, int]]]:
        """The graph of e-classes: for each class, (e-node, child class) for every distinct child of each of its
        e-nodes, in the e-nodes' order."""
        edges: dict[int, list[tuple[Key, int]]] = {}
        for key, c in self.memo.items():
            for d in set(key[4]):
                if d >= 0:
                    edges.setdefault(self.find(c), []).append((key, self.find(d)))
        return edges

    def _class_cycles(self, edges: dict[int, list[tuple[Key, int]]] | None = None) -> list[list[Key]]:
        """One cycle per back edge of a depth-first search over the e-classes (``edges``, default
        :meth:`_class_edges`), as the e-nodes along it."""
        if edges is None:
            edges = self._class_edges()
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

