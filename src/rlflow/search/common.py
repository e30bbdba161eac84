"""What both searches share: making every child of a graph (one per rule and location) and scoring it quickly.

Cost: every graph of a search is scored in one currency, its target's whole-graph estimate
(``CostModel.node_costs``). On an additive target (``CostModel.additive``: each node costs the same whatever its
neighbours) a child differs from its parent only around the match, so its cost is the parent's plus the cost of
the nodes the rewrite added minus those it removed (weight-only nodes cost nothing and are tracked exactly); this
equals the whole-graph sum exactly, since costs are integers in units of QUANTUM_MS. Only a rewrite that changes
whether a value outside the match is weight-only (then nodes far from it can become free, or stop being free) has
its child summed from scratch. On a target that groups nodes into kernels (ort-cpu) a node alone costs something
else than inside its kernel, so a child's cost is its parent's less the kernels the rewrite touched plus the
kernels that replace them (``changed_kernels``: the same whole-graph estimate, kernel by kernel; where the target
cannot work that out locally, the whole-graph estimate of the child).

Identity: :class:`GraphHasher` is ``Graph.structural_hash`` (names ignored; inputs by position and type, weights
by content, nodes by op, attributes and inputs) as a 64-bit integer, each node's op-and-attributes part cached;
a child is hashed from its parent's value hashes, from its first changed node on.
"""

from __future__ import annotations

import hashlib
import time
from typing import Iterator

from rlflow.cost.metrics import QUANTUM_MS, Metrics, quantize  # noqa: F401 -- (QUANTUM_MS: the searches')
from rlflow.cost.model import CostModel
from rlflow.graph.fold import fold_constants
from rlflow.graph.ir import Graph, Node
from rlflow.rewrite.matcher import Match, MatchIndex, _apply

_CACHE_LIMIT = 300_000


def _key(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class GraphHasher:
    """Structural hash of a graph as an int (equal graphs, whatever their node and value names, hash equal).

    :meth:`values` hashes every value of a graph; :meth:`child` hashes a rewritten graph from its parent's value
    hashes, recomputing only the nodes from the first one that differs."""

    def __init__(self) -> None:
        self._node: dict[int, tuple[Node, int]] = {}
        self._const: dict[int, tuple[object, int]] = {}

    def _local(self, n: Node) -> int:
        k = _key(f"{n.op}|{n.attr_key()}|{len(n.outputs)}")
        if len(self._node) > _CACHE_LIMIT:
            self._node.clear()
        self._node[id(n)] = (n, k)
        return k

    def _constant(self, c) -> int:
        hit = self._const.get(id(c))
        if hit is not None and hit[0] is c:
            return hit[1]
        k = int.from_bytes(c.digest[:8], "little")
        if len(self._const) > _CACHE_LIMIT:
            self._const.clear()
        self._const[id(c)] = (c, k)
        return k

    def values(self, g: Graph) -> dict[str, int]:
        """Hash of every value of ``g`` (inputs, constants, node outputs; "" for an absent optional input)."""
        vh: dict[str, int] = {"": 0}
        for k, name in enumerate(g.inputs):
            vh[name] = _key(f"in{k}:{g.types[name]}")
        for name, c in g.constants.items():
            vh[name] = self._constant(c)
        self._nodes(g, g.nodes, vh)
        return vh

    def _nodes(self, g: Graph, nodes, vh: dict[str, int]) -> None:
        cache = self._node
        consts = g.constants
        get = vh.__getitem__
        for n in nodes:
            hit = cache.get(id(n))
            lk = hit[1] if hit is not None and hit[0] is n else self._local(n)
            try:
                base = hash((lk, *map(get, n.inputs)))
            except KeyError:  # a constant the rewrite added
                for v in n.inputs:
                    if v not in vh:
                        vh[v] = self._constant(consts[v])
                base = hash((lk, *map(get, n.inputs)))
            outs = n.outputs
            if len(outs) == 1:
                vh[outs[0]] = base
            else:
                for k, o in enumerate(outs):
                    vh[o] = hash((base, k))

    @staticmethod
    def digest(g: Graph, vh: dict[str, int]) -> int:
        return hash(tuple(vh[v] for v in g.outputs))

    def __call__(self, g: Graph) -> int:
        return self.digest(g, self.values(g))

    def child(self, parent: Graph, parent_values: dict[str, int], first: int, g: Graph) -> int:
        """Hash of ``g``, a rewrite of ``parent`` whose first ``first`` nodes are unchanged (checked)."""
        if parent.inputs != g.inputs or g.nodes[:first] != parent.nodes[:first]:
            return self(g)
        vh = dict(parent_values)  # the prefix's values are the parent's; every later node is recomputed
        self._nodes(g, g.nodes[first:] if first else g.nodes, vh)
        return self.digest(g, vh)


class Scorer:
    """Children of a graph with their (integer) costs and hashes::

        cost = scorer.graph_cost(index.graph)
        for k, j, match, child, child_cost, first in scorer.children(index, cost):
            h = scorer.child_hash(index.graph, child, first)   # only for the children worth hashing
    """

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.hasher = GraphHasher()
        self._parent: tuple[Graph, dict[str, int]] | None = None
        self.full_sums = 0  # children summed from scratch (a weight-only status changed)
        self.delta_sums = 0
        self.reused = 0  # children's costs reused from the previous graph (child_costs)
        self._memo: dict[int, tuple] = {}

    def graph_cost(self, g: Graph) -> int:
        """The graph's estimated runtime in QUANTUM_MS units: the sum of its nodes' quantized runtimes (on a
        kernel-grouping target, its kernels' runtimes, each reported on the kernel's last node)."""
        return sum(quantize(c[0]) for c in self.cost.node_costs(g))

    def children(self, index: MatchIndex, cost: int, deadline: float = 0.0
                 ) -> Iterator[tuple[int, int, Match, Graph, int, int]]:
        """Every (rule, location) of ``index`` applied to its graph (whose cost is ``cost``), in rule order then
        location order, with the child's cost and the position of its first changed node. Stops early (between
        rules) once ``time.perf_counter()`` passes ``deadline`` (0: never)."""
        g = index.graph
        view = index.view
        static = view.static
        pos = view.pos
        additive = self.cost.additive
        for k, j, m in _locations(index, deadline):
            new, removed, changed = _apply(g, m)
            first = min(pos[x] for x in m.nodes)
            if additive:
                c = self.child_cost(g, view, static, cost, m, new, first, changed)
            else:
                c = self.kernel_child_cost(g, cost, new, removed, changed)
            yield k, j, m, new, c, first

    def child_costs(self, index: MatchIndex, cost: int, deadline: float = 0.0
                    ) -> Iterator[tuple[int, int, Match, int]]:
        """:meth:`children`'s (rule, location, match, child's cost), without the child graphs: for a search that
        keeps only the best child of each graph (greedy), whose graphs differ step to step only around the last
        rewrite. On a kernel-grouping target each child's change of cost is kept with what its estimate read of
        the parent (``CostModel.surroundings``); a match still present in the next graph, in surroundings equal
        there, reuses it without building its child. The costs are exactly :meth:`children`'s."""
        if self.cost.additive:
            for k, j, m, _child, c, _first in self.children(index, cost, deadline):
                yield k, j, m, c
            return
        g, view = index.graph, index.view
        surroundings = self.cost.surroundings
        memo, self._memo = self._memo, {}
        for k, j, m in _locations(index, deadline):
            hit = memo.get(id(m))
            if hit is not None and hit[0] is m and _in_place(view, m) and surroundings(g, hit[1]) == hit[2]:
                self._memo[id(m)] = hit
                self.reused += 1
                yield k, j, m, cost + hit[3]
                continue
            new, removed, changed = _apply(g, m)
            around: list[str] = []
            parts = self.cost.changed_kernels(g, new, removed, set(changed), around)
            if parts is None:
                self.full_sums += 1
                yield k, j, m, self.graph_cost(new)
                continue
            self.delta_sums += 1
            delta = sum(map(quantize, parts[1])) - sum(map(quantize, parts[0]))
            if _in_place(view, m):  # (a child whose nodes were re-sorted has its order from the whole graph)
                here = surroundings(g, around)
                if here is not None:
                    self._memo[id(m)] = (m, around, here, delta)
            yield k, j, m, cost + delta

    def graph_hash(self, g: Graph) -> int:
        return self.hasher(g)

    def child_hash(self, parent: Graph, child: Graph, first: int) -> int:
        """Structural hash of ``child`` (yielded by :meth:`children` for ``parent``)."""
        if self._parent is None or self._parent[0] is not parent:
            self._parent = (parent, self.hasher.values(parent))
        return self.hasher.child(parent, self._parent[1], first, child)

    def child_cost(self, g: Graph, view, static: set[str], cost: int, m: Match, new: Graph, first: int,
                   changed: list[str]) -> int:
        """The cost of ``new`` (``g``, of cost ``cost``, rewritten at ``m``) from the nodes that changed: exact on
        an additive target only (:meth:`children` uses it there)."""
        by_name = view.by_name
        node_cost = self.cost.node_cost
        delta = 0
        for name in m.nodes:
            n = by_name[name]
            if n.outputs[0] not in static:
                delta -= quantize(node_cost(n, g.types)[0])
        added = self._added_nodes(new, first, [x for x in changed if x not in by_name])
        consts = new.constants
        flag: dict[str, bool] = {}
        for n in added:
            st = n.op != "Opaque" and bool(n.inputs) and all(
                flag[v] if v in flag else (v in static or v in consts) for v in n.inputs if v)
            for v in n.outputs:
                flag[v] = st
            if not st:
                delta += quantize(node_cost(n, new.types)[0])
        if not self._static_kept(g, view, static, m, flag):
            self.full_sums += 1
            return self.graph_cost(new)
        self.delta_sums += 1
        return cost + delta

    def kernel_child_cost(self, g: Graph, cost: int, new: Graph, removed: set[str], changed: list[str]) -> int:
        """The cost of ``new`` on a target that groups nodes into kernels: ``g``'s less the kernels the rewrite
        touched plus those that replace them (``CostModel.changed_kernels``), else its whole-graph estimate."""
        parts = self.cost.changed_kernels(g, new, removed, set(changed))
        if parts is None:
            self.full_sums += 1
            return self.graph_cost(new)
        self.delta_sums += 1
        before, after = parts
        return cost - sum(map(quantize, before)) + sum(map(quantize, after))

    @staticmethod
    def _added_nodes(new: Graph, first: int, names: list[str]) -> list[Node]:
        """The added nodes of ``new``, in its order (usually one block where the first removed node was)."""
        block = new.nodes[first:first + len(names)]
        want = set(names)
        if len(block) == len(names) and all(n.name in want for n in block):
            return block
        return [n for n in new.nodes if n.name in want]

    @staticmethod
    def _static_kept(g: Graph, view, static: set[str], m: Match, flag: dict[str, bool]) -> bool:
        """Does every value read outside the match keep its weight-only status? (Then no other node's does.)"""
        for v, st in flag.items():
            if v in g.types and (v in static) != st:  # a source value the target recomputes under its own name
                return False
        rule = m.rule
        if len(rule.outputs) <= 1 and all(d.startswith("%") for _, d in rule.outputs):
            return True
        bound = dict(m.bindings)
        first_for: dict[str, str] = {}
        for s, d in rule.outputs:
            sv = _source_value(view, m, s)
            if d.startswith("%"):
                d = _norm(d)
                if d not in first_for:
                    first_for[d] = sv
                    continue
                other = first_for[d]  # a second source value replaced by the same target value
            else:
                other = bound[d]      # a source value replaced by a variable: its readers now read that value
            if (sv in static) != (other in static):
                return False
        return True


def _locations(index: MatchIndex, deadline: float) -> Iterator[tuple[int, int, Match]]:
    """(rule index, location, match) of every match of ``index``, in rule order then location order; stops
    (between rules) once ``time.perf_counter()`` passes ``deadline`` (0: never)."""
    for k, ms in enumerate(index.matches):
        if not ms:
            continue
        if deadline and time.perf_counter() > deadline:
            return
        for j, m in enumerate(ms):
            yield k, j, m


def _in_place(view, m: Match) -> bool:
    """Does the rewrite at ``m`` put its new nodes where the first matched node was, leaving every other node
    where it is? (It re-sorts the graph where a new node reads a value made after that place.)"""
    first = min(view.pos[x] for x in m.nodes)
    for _, v in m.bindings:
        p = view.producer.get(v)
        if p is not None and view.pos[p.name] > first and p.name not in m.nodes:
            return False
    return True


def _norm(ref: str) -> str:
    head, _, out = ref.partition(".")
    return f"{head}.{out or 0}"


def _source_value(view, m: Match, ref: str) -> str:
    head, _, out = ref.partition(".")
    return view.by_name[m.nodes[int(head[1:])]].outputs[int(out or 0)]


def finish(graph: Graph, cost: CostModel) -> tuple[Graph, Metrics]:
    """The result graph as written: weight-only nodes folded into constants (as TASO folds after its search)."""
    folded = fold_constants(graph)
    return folded, cost.graph_metrics(folded)


def progress_bar(enabled: bool, total: int | None, desc: str):
    """A tqdm bar on stderr, or None."""
    if not enabled:
        return None
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="graph", file=sys.stderr, leave=False, mininterval=1.0, disable=None,
                dynamic_ncols=True)
