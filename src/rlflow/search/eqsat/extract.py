"""Extraction (egg's extract.rs): the cheapest graph an e-graph represents, by ILP (with its cycle cuts) or greedily.

**Extraction.** The cheapest graph the e-graph represents under the cost model every search uses: each op
instance costs its ``cost_model.alone_ms`` (weight-only instances are free, as the searches count them), paid
once however many of its outputs are used. An integer linear program (HiGHS, through its own interface highspy)
chooses op instances: each output class has a chosen one, and so has every class a chosen one reads. Classes
holding a graph input or a weight, and weight-only classes (folded after extraction anyway), are left out of it
(see :func:`ilp_extract`). If the ILP is not solved to optimality within its limits (time, branch-and-bound
nodes) its best feasible answer is used, and if it has none, a greedy extraction (:func:`greedy_extract`:
Knuth's generalisation of Dijkstra, acyclic by construction) is. :func:`to_graph` turns a choice into an IR graph.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from rlflow.cost.model import CostModel
from rlflow.errors import RLFlowError
from rlflow.graph.ir import Constant, Graph, Node, TensorType
from rlflow.search.eqsat.egraph import CONST, INPUT, EGraph, Key

#: the ILP's cost of an op instance the cost model calls free (weight-only ops; data movement on a simulated
#: GPU): a free instance would tie with its class's leaf, and the ILP could pick free cycles such as
#: Transpose(Transpose(x)) at no cost; 1e-6 ms breaks the tie towards fewer ops without moving any real choice
TIE_COST_MS = 1e-6


class _Costs:
    """Per op instance: its cost (ms) under the cost model (``alone_ms``: a kernel of its own on a target that
    groups nodes into kernels), or its cost inside a graph already seen (``context``, see
    :func:`rlflow.search.eqsat.eqsat_search`); weight-only instances are free."""

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
        return self.alone(inst) if hit is None else hit

    def alone(self, inst: tuple) -> float:
        """The instance as a kernel of its own (0: weight-only)."""
        hit = self._memo.get(inst)
        if hit is None:
            op, _, _, kids = inst
            if op != "Opaque" and kids and all(k < 0 or self.eg.static[k] for k in kids):
                hit = 0.0
            else:
                types: dict[str, TensorType] = {}
                hit = float(self.cost.alone_ms(self._node(inst, types, wired=False), types))
            self._memo[inst] = hit
        return hit

    def _node(self, inst: tuple, types: dict, wired: bool) -> Node:
        """The instance as an IR node, its values' types added to ``types``: inputs named after their classes
        (``c<class>``), outputs too if ``wired`` (so that two nodes read each other), else ``o<j>``."""
        op, akey, n, kids = inst
        eg = self.eg
        keys = [(op, akey, n, j, kids) for j in range(n)]
        outs = tuple(f"c{eg.find(eg.memo[k])}" if wired else f"o{j}" for j, k in enumerate(keys))
        types.update({f"c{k}": eg.type[k] for k in kids if k >= 0})
        types.update({o: eg.type[eg.memo[k]] for o, k in zip(outs, keys)})
        return Node("n", op, tuple(f"c{k}" if k >= 0 else "" for k in kids), outs, eg.attrs[(op, akey)])

    def fused(self, insts: Sequence[tuple]) -> float | None:
        """The instances (in the order :func:`to_graph` writes them) as one kernel on the target
        (:meth:`CostModel.fused_ms`); None where the target does not fuse them."""
        types: dict[str, TensorType] = {}
        return self.cost.fused_ms([self._node(i, types, wired=True) for i in insts], types)

    def fusion_saving(self, producer: tuple, consumer: tuple) -> float:
        """What the target saves running ``consumer`` (which reads an output of ``producer``, as its only reader)
        in one kernel with ``producer`` rather than each alone; negative where the kernel costs more; 0 where the
        target does not fuse them. At most the producer's own cost less TIE_COST_MS, so that no instance ever
        costs the ILP nothing or less."""
        a, b = self.alone(producer), self.alone(consumer)
        if a <= TIE_COST_MS or b <= 0.0:
            return 0.0
        fused = self.fused((producer, consumer))
        return 0.0 if fused is None else min(a + b - fused, a - TIE_COST_MS)


def _inst(key: Key) -> tuple:
    return (key[0], key[1], key[2], key[4])


def graph_instances(eg: EGraph, graph: Graph) -> list[tuple | None]:
    """Per node of ``graph`` (the input, or a graph extracted from ``eg``), its op instance in the e-graph as it
    is now; None where the e-graph no longer holds it (cycle filtering)."""
    cls: dict[str, int | None] = {"": -1}
    for v in graph.inputs:
        c = eg.memo.get((INPUT, v, 1, 0, ()))
        cls[v] = None if c is None else eg.find(c)
    for v, k in graph.constants.items():
        c = eg.memo.get((CONST, k.digest.hex(), 1, 0, ()))
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


def _seconds_left(limit_s: float, t0: float) -> float:
    """What is left of a ``limit_s`` seconds clock started at ``t0`` (:func:`time.perf_counter`), 0.1 s at least;
    0 if ``limit_s`` is 0 (no clock), as every time limit here is given."""
    return max(limit_s - (time.perf_counter() - t0), 0.1) if limit_s else 0.0


def _clock_spent(limit_s: float, t0: float) -> bool:
    """True once a ``limit_s`` seconds clock started at ``t0`` has run out (never if ``limit_s`` is 0)."""
    return bool(limit_s) and time.perf_counter() - t0 >= limit_s


def ilp_extract(eg: EGraph, roots: Sequence[int], costs: _Costs, time_limit_s: float, node_limit: int = 0,
                fusion: bool = False) -> tuple[dict[int, Key] | None, dict[str, Any]]:
    """Tensat's ILP over :func:`ilp_candidates`, the :func:`free_choice` classes left out. One binary variable
    per single-output e-node and one per multi-output op instance (its outputs' e-nodes share it), each paying
    its instance's cost; each output class has a chosen variable (one of its e-nodes', or an instance's with
    an output in it), and so does every non-free class a chosen variable reads. With ``fusion``, on a target
    that runs some producer -> consumer pairs as one kernel (:meth:`CostModel.fused_ms`), one more variable per
    such pair of candidates (:func:`fusion_pairs`) adds what fusing them changes: it is 1 only if both are chosen
    and no other chosen variable reads the value (the target fuses a value's only reader), and must be 1 then
    where the kernel costs more than the two alone. One variable per two such pairs that make a three-node
    kernel (:func:`fusion_triples`) adds what the kernel costs beyond the pairs' terms. The chosen variables are
    then held to the ops of one graph: at most one per class, and each read by a chosen one or an output (else
    a spare reader would make a fused value look read twice, dodging a penalty). So a graph whose kernels have
    at most three nodes costs the ILP exactly its cost on the target. Solved by HiGHS to optimality
    or until ``time_limit_s`` is up or a solve has explored ``node_limit`` branch-and-bound nodes (its best
    answer is then used; 0: no such limit; only the node limit makes the answer independent of the machine's
    speed and load). Cycles: saturation's cycle filtering
    (:meth:`EGraph.remove_cycles`) leaves none among the classes; for any other e-graph acyclicity is enforced
    lazily: while the answer has cycles, a cut per cycle forbids its variables together (their sum <= length - 1)
    and the ILP is solved again, within ``time_limit_s`` in all. (Tensat's own big-M order variables per class
    made HiGHS miss optimality in 30 s on 553-e-node e-graphs; their LP relaxation is weak.) Returns (class ->
    chosen e-node, or None if no feasible acyclic answer in time; statistics)."""
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
    read_by = _readers(insts, free)
    if fusion:  # the chosen variables are then exactly the extracted graph's ops: no fusion term counts an op
        # the graph lacks (a second op of a class, or one nothing reads, would make a value's reader look
        # single, or its producer fused, where it is not)
        outputs = set(roots)
        out_classes: dict[int, set[int]] = {}
        for c, vs in of_class.items():
            if len(vs) > 1:  # one op per class
                row([(v, 1.0) for v in vs], -np.inf, 1.0)
            for v in vs:
                out_classes.setdefault(v, set()).add(c)
        for v in range(nv):  # each op read by a chosen op, or an output
            if not out_classes[v] & outputs:
                us = sorted(set().union(*(read_by.get(c, ()) for c in out_classes[v])) - {v})
                row([(v, 1.0)] + [(u, -1.0) for u in us], -np.inf, 0.0)
    pairs = fusion_pairs(roots, costs, insts, of_class, read_by) if fusion else []
    triples = fusion_triples(pairs, insts, costs)
    # a pair's variable is bounded on each side where the ILP could gain by moving it: above where it saves or a
    # three-node kernel saves through it (else a triple's saving would count a pair the target does not fuse),
    # below where it costs or a kernel's penalty needs it (1 whenever fused, so a penalty holds)
    at_most = {k for i, j, extra in triples if extra <= 0 for k in (i, j)}
    at_least = {k for i, j, extra in triples if extra > 0 for k in (i, j)}
    fused_from: dict[int, list[int]] = {}
    for i, (p, q, _, readers, saving) in enumerate(pairs):
        y = nv + i
        if saving > 0 or i in at_most:  # y <= x_p, y <= x_q, y + x_r <= 1 for every other reader r
            row([(y, 1.0), (p, -1.0)], -np.inf, 0.0)
            row([(y, 1.0), (q, -1.0)], -np.inf, 0.0)
            for r in readers:
                row([(y, 1.0), (r, 1.0)], -np.inf, 1.0)
            if saving > 0:
                fused_from.setdefault(p, []).append(y)
        if saving <= 0 or i in at_least:  # y >= x_p + x_q - 1 - (the other readers)
            row([(y, 1.0), (p, -1.0), (q, -1.0)] + [(r, 1.0) for r in readers], -1.0, np.inf)
    for ys in fused_from.values():  # a multi-output producer saves once at most (its saving < its cost)
        if len(ys) > 1:
            row([(y, 1.0) for y in ys], -np.inf, 1.0)
    for t, (i, j, extra) in enumerate(triples):
        z, yi, yj = nv + len(pairs) + t, nv + i, nv + j
        if extra > 0:  # z >= y_i + y_j - 1
            row([(z, 1.0), (yi, -1.0), (yj, -1.0)], -1.0, np.inf)
        else:  # z <= y_i, z <= y_j
            row([(z, 1.0), (yi, -1.0)], -np.inf, 0.0)
            row([(z, 1.0), (yj, -1.0)], -np.inf, 0.0)
    cvec = np.concatenate([cvec, [-saving for *_, saving in pairs], [extra for *_, extra in triples]])
    nv += len(pairs) + len(triples)
    stats: dict[str, Any] = {"ilp_variables": nv, "ilp_fusion_pairs": len(pairs), "ilp_fusion_triples": len(triples),
                             "ilp_enodes": sum(map(len, classes.values())), "ilp_free_classes": len(free),
                             "ilp_cycle_cuts": 0, "ilp_solves": 0, "ilp_nodes": 0}
    choice: dict[int, Key] | None = None
    while True:
        options: dict[str, Any] = {}  # no time_limit, node_limit: none
        if time_limit_s:
            options["time_limit"] = _seconds_left(time_limit_s, t0)
        if node_limit:
            options["node_limit"] = node_limit
        res = solve_ilp(cvec, coo_array((vals, (rows, cols)), shape=(len(lo), nv)), np.array(lo),
                        np.array(hi), options)
        stats.update(ilp_constraints=len(lo), ilp_status=res.status, ilp_message=res.message,
                     ilp_optimal=res.optimal, ilp_node_limit_reached=res.at_node_limit,
                     ilp_nodes=stats["ilp_nodes"] + res.nodes, ilp_solves=stats["ilp_solves"] + 1,
                     ilp_objective=res.objective, ilp_gap=res.gap)
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
        if _clock_spent(time_limit_s, t0):
            choice = None
            stats.update(ilp_optimal=False, ilp_message="time limit reached with a cyclic answer")
            break
    stats["ilp_seconds"] = time.perf_counter() - t0
    return choice, stats


@dataclass
class Solved:
    """One solve of a 0-1 ILP (:func:`solve_ilp`)."""

    x: np.ndarray | None      #: the best answer found (None: none within the limits)
    objective: float | None
    optimal: bool
    status: int               #: HiGHS's model status (7: optimal, 13: time limit, 16: node limit)
    message: str
    nodes: int                #: branch-and-bound nodes explored
    gap: float | None         #: relative gap of the answer to HiGHS's bound
    at_node_limit: bool


def _new_highs(highspy):
    """A HiGHS instance. HiGHS writes its banner to the C-level standard output once per process, whatever its
    options: that write goes to /dev/null, so that commands print only their own lines."""
    import os
    import sys

    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def solve_ilp(c: np.ndarray, a, lo: np.ndarray, hi: np.ndarray, options: dict[str, Any]) -> Solved:
    """Minimise ``c @ x`` over binary ``x`` with ``lo <= a @ x <= hi`` (``a``: a scipy sparse matrix) by HiGHS's
    own Python interface (highspy), single-threaded, quiet; ``options``: ``time_limit`` (s), ``node_limit``
    (branch-and-bound nodes), each absent for none. (scipy.optimize.milp drives an older HiGHS: on paper-size
    vit's fusion-priced ILP it explored 2 nodes in 60 s, where highspy 1.16 proves the optimum in 17 s.)"""
    import highspy

    h = _new_highs(highspy)
    for key, value in (("output_flag", False), ("threads", 1), ("random_seed", 0)):
        h.setOptionValue(key, value)
    if "time_limit" in options:
        h.setOptionValue("time_limit", float(options["time_limit"]))
    if "node_limit" in options:
        h.setOptionValue("mip_max_nodes", int(options["node_limit"]))
    a = a.tocsc()
    n = len(c)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, a.shape[0]
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = np.asarray(c, dtype=float), np.zeros(n), np.ones(n)
    lp.row_lower_ = np.where(np.isinf(lo), -highspy.kHighsInf, lo)
    lp.row_upper_ = np.where(np.isinf(hi), highspy.kHighsInf, hi)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = a.indptr, a.indices, a.data
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n
    h.passModel(lp)
    h.run()
    status, info = h.getModelStatus(), h.getInfo()
    found = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    nodes = int(info.mip_node_count)
    at_node_limit = status == highspy.HighsModelStatus.kSolutionLimit and "node_limit" in options
    words = h.modelStatusToString(status)
    message = (f"Node limit reached. (HiGHS status {int(status)}: {words})" if at_node_limit
               else f"{words} (HiGHS status {int(status)})")
    return Solved(x=np.array(h.getSolution().col_value) if found else None,
                  objective=float(info.objective_function_value) if found else None,
                  optimal=status == highspy.HighsModelStatus.kOptimal, status=int(status), message=message,
                  nodes=max(nodes, 0), gap=float(info.mip_gap) if found else None, at_node_limit=at_node_limit)


def fusion_pairs(roots: Sequence[int], costs: _Costs, insts: list[tuple], of_class: dict[int, list[int]],
                 readers: dict[int, list[int]]) -> list[tuple[int, int, int, list[int], float]]:
    """The ILP's fusion terms for pairs (see :func:`ilp_extract`): per candidate producer -> consumer pair that
    the target runs as one kernel (:meth:`_Costs.fusion_saving` not 0), where the consumer reads the value once
    and the value is not a graph output (:func:`rlflow.cost.ort_cpu.single_consumer_edges`): (producer variable,
    consumer variable, the value's class, the other variables reading the value, saving in ms). ``readers``: per
    class, the variables reading it (:func:`_readers`)."""
    if costs.cost.additive:
        return []
    outputs = set(roots)
    pairs = []
    for d, rs in sorted(readers.items()):
        if d in outputs:
            continue
        for q in rs:
            if insts[q][3].count(d) != 1:
                continue
            for p in of_class.get(d, ()):
                saving = 0.0 if p == q else costs.fusion_saving(insts[p], insts[q])
                if abs(saving) > TIE_COST_MS:
                    pairs.append((p, q, d, [r for r in rs if r != q], saving))
    return pairs


def _readers(insts: list[tuple], free: dict[int, Key]) -> dict[int, list[int]]:
    """Per class the ILP decides, the variables (in order) of the op instances that read it."""
    readers: dict[int, list[int]] = {}
    for v, inst in enumerate(insts):
        for d in sorted({d for d in inst[3] if d >= 0 and d not in free}):
            readers.setdefault(d, []).append(v)
    return readers


def fusion_triples(pairs: list[tuple[int, int, int, list[int], float]], insts: list[tuple], costs: _Costs
                   ) -> list[tuple[int, int, float]]:
    """The ILP's fusion terms for three-node kernels (see :func:`ilp_extract`): per two fused pairs
    (:func:`fusion_pairs`) that make one kernel, a chain p -> q -> r or two producers read by one consumer
    (single-output producers only), what the target charges for the kernel beyond the three instances alone less
    the two pairs' savings: (pair, pair, that difference in ms; positive where the pairs' terms underprice the
    kernel)."""
    by_producer: dict[int, list[int]] = {}
    by_consumer: dict[int, list[int]] = {}
    for i, (p, q, *_) in enumerate(pairs):
        if insts[p][2] == 1:
            by_producer.setdefault(p, []).append(i)
            by_consumer.setdefault(q, []).append(i)
    out = []
    for i, (p, q, d, _, saving) in enumerate(pairs):
        if insts[p][2] != 1:
            continue
        kernels = [(j, (p, q, pairs[j][1])) for j in by_producer.get(q, ()) if pairs[j][1] != p]  # p -> q -> r
        for j in by_consumer[q]:  # p, p2 -> q, the producers in the order of q's inputs (to_graph's order)
            d2 = pairs[j][2]
            if j > i and d2 != d:
                first = insts[q][3].index(d) < insts[q][3].index(d2)
                kernels.append((j, (p, pairs[j][0], q) if first else (pairs[j][0], p, q)))
        for j, three in kernels:
            fused = costs.fused([insts[v] for v in three])
            if fused is None:
                continue
            terms = sum(costs.alone(insts[v]) for v in three) - saving - pairs[j][4]
            extra = max(fused, 3 * TIE_COST_MS) - terms
            if abs(extra) > TIE_COST_MS:
                out.append((i, j, extra))
    return out


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



#: extractions at most on a target that fuses kernels and does not price pairs (see :func:`extract_best`)
EXTRACTION_ROUNDS = 4


def extract_best(eg: EGraph, roots: Sequence[int], original: Graph, cost_model: CostModel, extraction: str,
                 ilp_time_limit_s: float, ilp_node_limit: int = 0) -> tuple[Graph | None, float, dict[str, Any]]:
    """The graph extracted from ``eg`` (by ``extraction``: ilp | greedy, greedy if the ILP finds no answer within
    ``ilp_time_limit_s`` in all and ``ilp_node_limit`` branch-and-bound nodes per solve; 0: no such limit) that is
    cheapest on ``cost_model``; its cost; the extraction's statistics.

    A target that groups nodes into kernels (ort-cpu) is not additive: an op costs less (or more) fused with its
    neighbours. The first extraction costs each op on its own, as Tensat. Where the target prices fused pairs
    (:meth:`CostModel.fused_ms`), a second ILP adds them (:func:`ilp_extract` with ``fusion``), with a clock of its
    own (``ilp_time_limit_s`` again). Otherwise the ILP costs the input's ops as they cost inside the input and
    extracts again; then, in turn, the ops of each graph extracted since as they cost inside it;
    EXTRACTION_ROUNDS extractions at most, fewer if the ILP's clock runs out. The graph cheapest on the target is
    kept."""
    costs = _Costs(eg, cost_model)
    fuses = not cost_model.additive
    priced = fuses and cost_model.prices_pairs and extraction == "ilp"  # a fusion-priced ILP follows the first
    ext: dict[str, Any] = {"extraction": extraction, "extraction_rounds": 0}
    extracted, extracted_ms, tried = None, float("inf"), set()
    t_ilp = time.perf_counter()
    while True:
        choice = None
        rounds = ext["extraction_rounds"]
        if extraction == "ilp":
            if priced and rounds == 1:
                t_ilp = time.perf_counter()  # the fusion-priced ILP has a clock of its own
            choice, ilp = ilp_extract(eg, roots, costs, _seconds_left(ilp_time_limit_s, t_ilp), ilp_node_limit,
                                      fusion=priced and rounds == 1)
            if extracted is None or choice is not None:
                ext.update(ilp)
            if choice is None and extracted is None:
                ext["extraction"] = "greedy (the ILP found no solution within its limits)"
        if choice is None and extracted is None:
            choice = greedy_extract(eg, costs)
        ext["extraction_rounds"] = rounds = rounds + 1
        if choice is None:
            break
        g = to_graph(eg, roots, choice, original)
        ms = cost_model.graph_metrics(g).runtime_ms
        if ms < extracted_ms:
            extracted, extracted_ms = g, ms
            ext["extraction_cheapest_round"] = rounds
        if priced and rounds == 1:
            continue  # then the fusion-priced ILP
        key = frozenset(choice.items())
        if priced or not fuses or key in tried or rounds >= EXTRACTION_ROUNDS or \
                _clock_spent(ilp_time_limit_s, t_ilp):
            break
        tried.add(key)
        costs.seen_in(original if rounds == 1 else g)
    return extracted, extracted_ms, ext
