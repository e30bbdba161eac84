"""Cost models: per-op metrics summed over the graph (TASO's cost function: graph cost = sum of op costs).

- :class:`AnalyticCost` -- a roofline estimate per op, ``max(flops / peak, bytes / bandwidth) + launch``, from
  the device's calibration (rlflow.cost.calibration) or, failing that, the peak figures in config. Deterministic: tests and CI use it.
- :class:`MeasuredCost` (targets ``torch-eager``, ``cuda``) -- each distinct op signature (op, attributes, input types) timed once on the device
  (torch; CUDA events on a GPU), as TASO times each operator with cuDNN, and cached in a JSON file reused
  across models and stages. An op the cache lacks is estimated from the roofline scaled by the measured/roofline
  ratio of its op type (so a graph's cost never depends on when its ops happened to be timed);
  :meth:`MeasuredCost.measure` times the missing ones.

Both share :class:`CostModel`: per-node metrics cached per node object (rewrites share unchanged nodes between
graphs, so summing a rewritten graph only computes the new nodes), weight-only nodes free (they are folded).
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
from collections import ChainMap
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from rlflow.cost.metrics import QUANTUM_MS, Metrics, quantize
from rlflow.errors import RLFlowError
from rlflow.jsondoc import read_document
from rlflow.graph.exported import as_exported, preactivation
from rlflow.graph.ir import Graph, Node, TensorType
from rlflow.graph.ops import COMMUTATIVE, OPS, node_bytes, node_flops

COSTS_FORMAT = "rlflow.costs/1"

#: roofline figures used when the config gives none (rough: a 2-core AVX2 CPU; an H100-class GPU, fp32)
DEFAULT_PEAKS = {
    "cpu": {"gflops": 100.0, "gbps": 20.0, "launch_us": 5.0},
    "cuda": {"gflops": 50000.0, "gbps": 2500.0, "launch_us": 5.0},
}

NodeCost = tuple[float, float, float, float]  # runtime_ms, flops, bytes, launches




def signature(node: Node, in_types: Iterable[TensorType]) -> str:
    """What an op's runtime depends on: op, attributes and input types (not names, not weight values)."""
    types = [str(t) for t in in_types]
    if node.op in COMMUTATIVE:  # listed sorted: ``Add(b, x)`` is the measured ``Add(x, b)``, not an estimate
        types.sort()
    return f"{node.op_type_name()}{node.attr_key()}({', '.join(types)})"


#: ops that read only part of their first input (the rows they gather, the slice they take)
PARTIAL_READERS = frozenset({"Gather", "Slice"})


def essential_bytes(graph: Graph) -> int:
    """Bytes any execution of ``graph`` must move at least once: its inputs, its outputs and the weights its
    computing nodes read, each counted once (a weight computed from weights alone is folded first, so it counts as
    the folded value). A weight that only Gather / Slice nodes read, as the tensor they take part of, counts the
    part they take (their outputs), capped at its size: an embedding table is not read whole."""
    weights = set(graph.constants)
    for n in graph.nodes:
        if all(v in weights for v in n.inputs if v):
            weights.update(n.outputs)
    partial: dict[str, int] = {}
    whole: set[str] = set()
    for n in graph.nodes:
        if all(v in weights for v in n.inputs if v):
            continue
        for k, v in enumerate(n.inputs):
            if v not in weights:
                continue
            if k == 0 and n.op in PARTIAL_READERS:
                partial[v] = partial.get(v, 0) + sum(graph.types[o].nbytes for o in n.outputs)
            else:
                whole.add(v)
    values = set(graph.inputs) | set(graph.outputs) | whole
    return sum(graph.types[v].nbytes for v in values) + sum(
        min(b, graph.types[v].nbytes) for v, b in partial.items() if v not in values)


def launches_of(node: Node) -> int:
    return 0 if node.op != "Opaque" and OPS[node.op].view else 1


class CostModel:
    """Base class: subclasses give :meth:`_runtime`; this class caches and sums. ``name`` is the cost target
    (``cost.target``); ``label`` what every printed figure of the target is called (``simulated H100``)."""

    name = "base"
    label = "base"
    #: the graph's estimate is the sum of its nodes' costs, each computed alone (a node's cost does not depend on
    #: its neighbours), so a search may score a rewritten graph as its parent's cost plus the nodes it added minus
    #: those it removed. A target that groups nodes into kernels (ort-cpu) is not: its searches score every
    #: candidate by the whole-graph estimate, so one search compares all its graphs in one currency.
    additive = True

    def __init__(self, device: str, peak: Mapping[str, float] | None = None):
        self.device = device
        self.peak = dict(peak or DEFAULT_PEAKS.get(device, DEFAULT_PEAKS["cpu"]))
        self._by_node: dict[int, tuple[Node, NodeCost]] = {}

    # ------------------------------------------------------------------ per op
    def roofline_ms(self, flops: float, nbytes: float) -> float:
        """Roofline time of ``flops`` and ``nbytes`` at the device's peak figures, in ms (no launch cost)."""
        return max(flops / (self.peak["gflops"] * 1e9), nbytes / (self.peak["gbps"] * 1e9)) * 1e3

    def _runtime(self, node: Node, in_types: list[TensorType], flops: float, nbytes: float) -> float:
        raise NotImplementedError

    def _launches(self, node: Node) -> int:
        """Kernels the node launches (0: it costs nothing)."""
        return launches_of(node)

    def node_cost(self, node: Node, types: Mapping[str, TensorType]) -> NodeCost:
        """(runtime_ms, flops, bytes, launches) of one node (cached per node object), as exported: a node the ONNX
        export writes as several ops (a Conv with a fused ReLU: Conv, Relu) costs the sum of those ops, since
        that is what a user's file runs (:func:`rlflow.graph.exported.as_exported`)."""
        hit = self._by_node.get(id(node))
        if hit is not None and hit[0] is node:
            return hit[1]
        parts = as_exported(node)
        if len(parts) == 1:
            cost = self._op_cost(node, types)
        else:
            # each part's runtime on the searches' integer grid, so the node costs exactly what its parts do
            # written as separate nodes (quantize(a + b) could differ from quantize(a) + quantize(b) by one unit)
            types = ChainMap({preactivation(node): types[node.outputs[0]]}, types)
            costs = [self._op_cost(p, types) for p in parts]
            cost = (sum(quantize(c[0]) for c in costs) * QUANTUM_MS, *(sum(c[i] for c in costs) for i in (1, 2, 3)))
        if len(self._by_node) > 500_000:  # bound the cache on very long runs (it holds the nodes alive)
            self._by_node.clear()
        self._by_node[id(node)] = (node, cost)
        return cost

    def _op_cost(self, node: Node, types: Mapping[str, TensorType]) -> NodeCost:
        ins = [types[v] for v in node.inputs if v]
        outs = [types[v] for v in node.outputs]
        flops, nbytes, launches = (float(node_flops(node, ins, outs)), float(node_bytes(node, ins, outs)),
                                   self._launches(node))
        runtime = self._runtime(node, ins, flops, nbytes) if launches else 0.0
        return (runtime, flops, nbytes, float(launches))

    def changed_kernels(self, parent: Graph, child: Graph, removed: set[str], changed: set[str],
                        around: list[str] | None = None) -> tuple[list[float], list[float]] | None:
        """A non-additive target: the runtimes of the kernels of ``parent`` that a rewrite (which removed the
        nodes named ``removed``, added or rewired those named ``changed``) touched, and of the ``child``'s kernels
        that replace them, so that a search scores the child from its parent exactly; None: score it whole.
        ``around`` (a list) receives the names of the parent's nodes the answer depends on, for
        :meth:`surroundings`."""
        return None

    def surroundings(self, graph: Graph, names: list[str]) -> tuple | None:
        """What :meth:`changed_kernels` read of ``graph`` around the nodes ``names`` (comparable between graphs:
        equal surroundings, equal change of estimate); None: nothing comparable."""
        return None

    #: :meth:`fused_ms` answers for some pairs (eqsat's extraction then prices fusion in its ILP)
    prices_pairs = False

    def fused_ms(self, nodes: Sequence[Node], types: Mapping[str, TensorType]) -> float | None:
        """The runtime (ms) of ``nodes`` (two or three, in graph order, joined by values each read by one of them
        only) run as one kernel, where this target fuses every edge between them; None where it does not (every
        additive target). Extraction prices fusion with it (:func:`rlflow.search.eqsat.extract.ilp_extract`)."""
        return None

    def alone_ms(self, node: Node, types: Mapping[str, TensorType]) -> float:
        """The runtime (ms) of ``node`` computed on its own: what an additive search (eqsat's extraction) sums
        per op. Here the node's own runtime; a target that groups nodes into kernels times it as one kernel."""
        return self.node_cost(node, types)[0]

    # ------------------------------------------------------------------ per graph
    def node_costs(self, graph: Graph) -> list[NodeCost]:
        """Per node, in graph order; weight-only nodes (folded before running) cost nothing."""
        static = set(graph.constants)
        zero = (0.0, 0.0, 0.0, 0.0)
        types = graph.types
        out = []
        for n in graph.nodes:
            if n.op != "Opaque" and n.inputs and all(v in static for v in n.inputs if v):
                static.update(n.outputs)
                out.append(zero)
            else:
                out.append(self.node_cost(n, types))
        return out

    def graph_metrics(self, graph: Graph) -> Metrics:
        rt = fl = by = la = 0.0
        for r, f, b, l in self.node_costs(graph):
            rt += r
            fl += f
            by += b
            la += l
        return Metrics(rt, fl, by, la)

    def roofline_bound_ms(self, graph: Graph) -> float:
        """The graph's roofline lower bound (ms) at this target's peak figures: the larger of its flops at the peak
        rate and the bytes any execution must move (:func:`essential_bytes`) at the peak bandwidth. Intermediate
        tensors count nothing (a runtime that fuses keeps them in cache), so no measured run of the graph, fused or
        not, is below it where the peak figures are the device's sustained ones."""
        return self.roofline_ms(self.graph_metrics(graph).flops, essential_bytes(graph))

    def describe(self) -> dict[str, Any]:
        return {"model": self.name, "target": self.name, "label": self.label, "device": self.device,
                "peak": self.peak}


class AnalyticCost(CostModel):
    """Roofline per op plus a fixed launch overhead per kernel (peaks: the device's calibration when the cost
    cache has one, else the config's ``cost.peak``)."""

    name = "analytic"
    label = "analytic roofline"

    def _runtime(self, node, in_types, flops, nbytes):
        return self.roofline_ms(flops, nbytes) + self.peak["launch_us"] * 1e-3


class MeasuredCost(CostModel):
    """Measured per-signature runtimes (a cache file), roofline x op-type calibration for the rest: the
    ``torch-eager`` target (each op a torch eager call; on a GPU timed with CUDA events, the ``cuda`` target)."""

    name = "torch-eager"
    label = "torch eager (measured per op)"

    def __init__(self, device: str, peak: Mapping[str, float] | None = None, table: Mapping[str, dict] | None = None,
                 warmup: int = 8, repeats: int = 32, hardware: str | None = None):
        super().__init__(device, peak)
        if device == "cuda":
            self.name, self.label = "cuda", "CUDA (measured per op with CUDA events)"
        self.table: dict[str, dict] = dict(table or {})
        self.warmup, self.repeats = warmup, repeats
        self.hardware = hardware or describe_hardware(device)
        self._calibrate()

    # -- calibration: measured / roofline per op type, for signatures not in the table
    def _calibrate(self) -> None:
        ratios: dict[str, list[float]] = {}
        for e in self.table.values():
            base = self.roofline_ms(e["flops"], e["bytes"]) + self.peak["launch_us"] * 1e-3
            if base > 0:  # (zero only for an op moving nothing with launch_us 0)
                ratios.setdefault(e["op"], []).append(e["runtime_ms"] / base)
        self.ratio = {op: statistics.median(r) for op, r in ratios.items()}
        every = [x for r in ratios.values() for x in r]
        self.default_ratio = statistics.median(every) if every else 1.0
        self._by_node.clear()

    def _runtime(self, node, in_types, flops, nbytes):
        e = self.table.get(signature(node, in_types))
        if e is not None:
            return e["runtime_ms"]
        base = self.roofline_ms(flops, nbytes) + self.peak["launch_us"] * 1e-3
        return base * self.ratio.get(node.op_type_name(), self.default_ratio)

    def missing(self, graphs: Iterable[Graph]) -> dict[str, tuple[Graph, Node]]:
        """Signatures of the graphs' non-static, non-view nodes that the table lacks (first occurrence each)."""
        want: dict[str, tuple[Graph, Node]] = {}
        seen: dict[int, Node] = {}  # nodes already looked at (rewritten graphs share most of their nodes)
        for g in graphs:
            for n, c in zip(g.nodes, self.node_costs(g)):
                if not c[3] or seen.get(id(n)) is n:
                    continue
                seen[id(n)] = n
                parts = as_exported(n)
                for part in parts:
                    pg = g if len(parts) == 1 else _alone(g, n, part)
                    if not self._launches(part):
                        continue
                    sig = signature(part, [pg.types[v] for v in part.inputs if v])
                    if sig not in self.table and sig not in want:
                        want[sig] = (pg, part)
        return want

    def measure(self, graphs: Iterable[Graph], progress: bool = False) -> int:
        """Time every missing signature of ``graphs`` on the device; returns how many were measured."""
        from rlflow.cost.measure import time_node

        want = self.missing(graphs)
        items = want.items()
        if progress:
            from tqdm import tqdm

            items = tqdm(items, desc="measuring ops", unit="op", file=sys.stderr, leave=False, mininterval=1.0, disable=None)
        for sig, (g, n) in items:
            ins = [g.types[v] for v in n.inputs if v]
            outs = [g.types[v] for v in n.outputs]
            self.table[sig] = {
                "op": n.op_type_name(),
                "runtime_ms": time_node(g, n, self.device, self.warmup, self.repeats),
                "flops": float(node_flops(n, ins, outs)),
                "bytes": float(node_bytes(n, ins, outs)),
            }
        if want:
            self._calibrate()
        return len(want)

    # -- the cache file
    def to_json(self) -> dict:
        return {"format": COSTS_FORMAT, "device": self.device, "hardware": self.hardware,
                "warmup": self.warmup, "repeats": self.repeats, "peak": self.peak,
                "ops": dict(sorted(self.table.items()))}

    def save(self, path: str | Path) -> None:
        """Write the table into the cache file (its other sections -- calibration, ort-cpu kernels -- kept)."""
        write_cache(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path, device: str, peak: Mapping[str, float] | None = None,
             warmup: int = 8, repeats: int = 32) -> "MeasuredCost":
        """Read a cache file; a missing file gives an empty table. A cache measured on another device kind
        (cpu/cuda) is a one-line error, rather than mixing devices; one measured on other hardware of the same
        kind (another CPU or GPU model) is used, with a one-line warning on stderr."""
        data = read_cache(path, device)
        if data is None:
            return cls(device, peak, warmup=warmup, repeats=repeats)
        return cls(device, peak, data["ops"], warmup, repeats, hardware=data.get("hardware"))


def _alone(g: Graph, node: Node, part: Node) -> Graph:
    """``part`` (one of the ops ``node`` of ``g`` exports as) as a graph of its own, to be timed: its inputs
    typed as in ``g`` (the value before a fused activation typed as the node's output), ``g``'s weights kept."""
    types = {preactivation(node): g.types[node.outputs[0]], **g.types}
    ins = [v for v in dict.fromkeys(part.inputs) if v and v not in g.constants]
    consts = {v: g.constants[v] for v in part.inputs if v in g.constants}
    return Graph(inputs=ins, outputs=list(part.outputs), nodes=[part],
                 types={v: types[v] for v in (*ins, *consts, *part.outputs)}, constants=consts)


def _check_entries(p: Path, section: str, entries, key: str) -> None:
    if not isinstance(entries, dict):
        raise RLFlowError(f"{p}: '{section}' must map signatures to measurements")
    for sig, e in entries.items():
        if not (isinstance(e, dict) and isinstance(e.get(key), str)
                and all(isinstance(e.get(k), (int, float)) and not isinstance(e.get(k), bool) and e[k] >= 0
                        for k in ("runtime_ms", "flops", "bytes"))):
            raise RLFlowError(f"{p}: malformed entry for {section} signature '{sig}' (needs '{key}', and "
                              f"'runtime_ms', 'flops', 'bytes' >= 0)")


def read_cache(path: str | Path, device: str) -> dict | None:
    """A cost cache's content, checked (None when the file does not exist): ``ops`` (torch-eager / cuda op
    table), ``kernels``, ``fusion``, ``layout``,
    ``context`` and ``reorder`` (ort-cpu), ``calibration`` (per backend), each optional."""
    p = Path(path)
    if not p.exists():
        return None
    if p.is_dir():
        raise RLFlowError(f"{p}: is a folder, expected a cost cache (.json)")
    data = read_document(p, COSTS_FORMAT, "a cost cache")
    data.setdefault("ops", {})
    _check_entries(p, "ops", data["ops"], "op")
    _check_entries(p, "kernels", data.setdefault("kernels", {}), "pattern")
    fusion = data.setdefault("fusion", {})
    if not isinstance(fusion, dict) or not all(
            isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and x >= 0 for x in v)
            for v in fusion.values()):
        raise RLFlowError(f"{p}: 'fusion' must map 'Producer>Consumer' to [fused, seen] counts")
    layout = data.setdefault("layout", {})
    if not isinstance(layout, dict) or not all(
            isinstance(v, list) and len(v) == 3 and all(isinstance(x, int) and x >= 0 for x in v)
            for v in layout.values()):
        raise RLFlowError(f"{p}: 'layout' must map a kernel pattern to [blocked, pass-through, seen] counts")
    context = data.setdefault("context", {})
    if not isinstance(context, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in context.values()):
        raise RLFlowError(f"{p}: 'context' must map kernel signatures to times in ms (>= 0)")
    reorder = data.setdefault("reorder", [0.0, 0.0])
    if not (isinstance(reorder, list) and len(reorder) == 2 and
            all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in reorder)):
        raise RLFlowError(f"{p}: 'reorder' must be [ms, bytes] (>= 0) of the layout reorders seen")
    if data.get("device") != device:
        raise RLFlowError(f"{p}: measured on '{data.get('device')}', but the device is '{device}' "
                          f"(re-run `rlflow measure-costs` on this device)")
    here = describe_hardware(device)
    if data.get("hardware") not in (None, here):
        print(f"rlflow: warning: {p} was measured on '{data.get('hardware')}', this machine is '{here}'",
              file=sys.stderr)
    return data


def write_cache(path: str | Path, sections: Mapping[str, Any]) -> None:
    """Write ``sections`` into the cost cache at ``path``, keeping the sections of an existing cache of the same
    device that ``sections`` does not replace."""
    from rlflow.atomic import write_text

    p = Path(path)
    data: dict = {}
    if p.is_file():
        try:
            old = json.loads(p.read_text())
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict) and old.get("format") == COSTS_FORMAT and old.get("device") == sections.get("device"):
            data = old
    data.update(sections)
    data["format"] = COSTS_FORMAT
    write_text(p, json.dumps(data, indent=1) + "\n")


def describe_hardware(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
