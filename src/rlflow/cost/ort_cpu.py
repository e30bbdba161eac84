"""The ``ort-cpu`` target: what onnxruntime will run on this CPU, without a session per candidate graph.

onnxruntime rewrites a graph before running it (at the level the evaluation uses, ``ORT_ENABLE_ALL``): it fuses
Conv + activation, MatMul + Add into Gemm, Add + LayerNormalization into SkipLayerNormalization, a transpose or
scale into FusedMatMul, and so on. So the kernels it runs are groups of the graph's nodes. This target:

1. **learns which edges onnxruntime fuses** (:meth:`OrtCpuCost.learn`): for a few graphs (the model and some of
   its rewrites), onnxruntime's optimised model is saved; an edge ``producer -> consumer`` (op types, the
   producer's value read by that one consumer only) is *fused* when the value no longer exists in the optimised
   model. An edge kind fused in at least half of the cases seen is fusable; kinds never seen are not.
2. **groups a candidate graph into kernels** by joining the nodes along fusable edges (union-find over the
   graph's edges: a pure-Python pass, no session);
3. **times each kernel signature once** (:meth:`OrtCpuCost.measure`): the group as its own onnxruntime session
   (weights as initializers, as in the real model, so onnxruntime prepacks them the same way), with onnxruntime's
   profiler, summing the group's kernel times per run (no session-call overhead), median of ``repeats`` runs;
   cached in the cost cache (``kernels``) per device;
4. **adds the per-kernel overhead** of the device's calibration (:mod:`rlflow.cost.calibration`, backend ``ort``)
   to every group; a group not timed yet is estimated from the calibrated roofline (GEMM rate, bandwidth) scaled
   by the median measured/estimate ratio of timed groups of the same op pattern (else of all of them).

Per node the runtime of a group is reported on its last node (one launch); flops and bytes stay per node.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from rlflow.cost.calibration import Calibration
from rlflow.cost.model import NodeCost, CostModel, signature
from rlflow.graph.ir import Constant, Graph, Node

#: onnxruntime's optimisation level in the evaluation (the InferenceSession default)
ORT_LEVEL = "ORT_ENABLE_ALL"


def label(node: Node) -> str:
    """A node's kind for fusion: its ONNX op type (a Conv with a fused activation says so)."""
    act = node.attrs.get("activation") if node.op == "Conv" else None
    return f"Conv[{act}]" if act and act != "none" else node.op_type_name()


def _static(graph: Graph) -> tuple[set[str], list[bool]]:
    static = set(graph.constants)
    flags = []
    for n in graph.nodes:
        s = n.op != "Opaque" and bool(n.inputs) and all(v in static for v in n.inputs if v)
        if s:
            static.update(n.outputs)
        flags.append(s)
    return static, flags


def single_consumer_edges(graph: Graph, flags: list[bool]) -> Iterable[tuple[int, int, str]]:
    """(producer index, consumer index, value) of every value a running node makes that exactly one running node
    reads and that is not a graph output."""
    cons = graph.consumers()
    outs = set(graph.outputs)
    nodes = graph.nodes
    for i, n in enumerate(nodes):
        if flags[i]:
            continue
        for v in n.outputs:
            c = cons.get(v)
            if c is not None and len(c) == 1 and v not in outs and not flags[c[0]] and nodes[c[0]] is not n:
                yield i, c[0], v


def kernel_groups(graph: Graph, fusable: frozenset[tuple[str, str]], flags: list[bool]) -> list[list[int]]:
    """The running nodes grouped into kernels (lists of node indices in graph order), in order of their last node."""
    parent = list(range(len(graph.nodes)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    if fusable:
        nodes = graph.nodes
        for p, c, _ in single_consumer_edges(graph, flags):
            if (label(nodes[p]), label(nodes[c])) in fusable:
                a, b = find(p), find(c)
                if a != b:
                    parent[a] = b
    groups: dict[int, list[int]] = {}
    for i in range(len(graph.nodes)):
        if not flags[i]:
            groups.setdefault(find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[-1])


def group_signature(graph: Graph, members: list[int]) -> str:
    """What a kernel's runtime depends on: its nodes' signatures in order and how they are wired (a member's
    input from an earlier member is ``@k.j``, the j-th output of member k; external inputs ``$i`` in order)."""
    nodes = [graph.nodes[i] for i in members]
    made = {v: f"@{k}.{j}" for k, n in enumerate(nodes) for j, v in enumerate(n.outputs)}
    ext: dict[str, str] = {}
    parts = []
    for n in nodes:
        wires = ",".join(made.get(v) or ext.setdefault(v, f"${len(ext)}") if v else "-" for v in n.inputs)
        parts.append(f"{signature(n, [graph.types[v] for v in n.inputs if v])}<{wires}>")
    return " ; ".join(parts)


def group_graph(graph: Graph, members: list[int], static: set[str]) -> Graph:
    """The kernel as a graph of its own: non-static external inputs are inputs, static ones initializers (the
    graph's weights, or random values of a folded weight's type), values read outside the group are outputs."""
    nodes = [graph.nodes[i] for i in members]
    inside = {v for n in nodes for v in n.outputs}
    member_ids = set(members)
    cons = graph.consumers()
    outs = set(graph.outputs)
    outputs = [v for n in nodes for v in n.outputs
               if v in outs or any(c not in member_ids for c in cons.get(v, []))] or [nodes[-1].outputs[0]]
    inputs, constants = [], {}
    rng = np.random.default_rng(0)
    for n in nodes:
        for v in n.inputs:
            if not v or v in inside or v in inputs or v in constants:
                continue
            if v in graph.constants:
                constants[v] = graph.constants[v]
            elif v in static:
                t = graph.types[v]
                arr = rng.standard_normal(t.shape).astype(t.dtype) if t.dtype.startswith("float") else \
                    np.zeros(t.shape, t.dtype)
                constants[v] = Constant(arr)
            else:
                inputs.append(v)
    used = set(inputs) | set(constants) | inside
    return Graph(inputs=inputs, outputs=outputs, nodes=nodes, types={v: graph.types[v] for v in used},
                 constants=constants, name="kernel", opset=graph.opset, extra_opsets=graph.extra_opsets)


def _session(model_bytes: bytes, threads: int, optimized_path: str | None = None, profile_prefix: str | None = None):
    import onnxruntime as ort

    from rlflow.graph.exec.ort_exec import quiet_options

    opts = quiet_options()
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the evaluation's OrtRunner
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, ORT_LEVEL)
    if threads:
        opts.intra_op_num_threads = threads
    if optimized_path:
        opts.optimized_model_filepath = optimized_path
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    return ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])


def optimised_value_names(graph: Graph, threads: int = 0) -> set[str]:
    """The value names left in onnxruntime's optimised model of ``graph`` (``ORT_LEVEL``)."""
    import onnx

    from rlflow.graph.onnx_io import to_onnx

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "opt.onnx")
        _session(to_onnx(graph).SerializeToString(), threads, optimized_path=path)
        model = onnx.load(path, load_external_data=False)
    return {v for n in model.graph.node for v in (*n.input, *n.output)} | {o.name for o in model.graph.output}


def time_kernel(kernel: Graph, warmup: int, repeats: int, threads: int = 0) -> float:
    """Median over ``repeats`` runs of the sum of the onnxruntime kernel times of ``kernel`` (ms), from the
    profiler: the kernels' own time, without the session call around them."""
    from rlflow.graph.exec import make_inputs
    from rlflow.graph.onnx_io import to_onnx

    feeds = make_inputs(kernel)
    with tempfile.TemporaryDirectory() as tmp:
        s = _session(to_onnx(kernel).SerializeToString(), threads, profile_prefix=str(Path(tmp) / "p"))
        for _ in range(warmup + repeats):
            s.run(None, feeds)
        events = json.loads(Path(s.end_profiling()).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    per_run = [0.0] * len(runs)
    starts = [r[0] for r in runs]
    import bisect

    for e in events:
        if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time"):
            k = bisect.bisect_right(starts, e["ts"]) - 1
            if k >= 0:
                per_run[k] += e["dur"] / 1e3
    timed = per_run[warmup:] or per_run
    return float(statistics.median(timed)) if timed else 0.0


class OrtCpuCost(CostModel):
    """onnxruntime on this CPU: learned fusions, timed kernels, calibrated per-kernel overhead."""

    name = "ort-cpu"
    label = "onnxruntime CPU (kernels timed)"

    def __init__(self, peak: Mapping[str, float] | None = None, calibration: Calibration | None = None,
                 kernels: Mapping[str, dict] | None = None, fusion: Mapping[str, list] | None = None,
                 warmup: int = 8, repeats: int = 32, hardware: str | None = None, threads: int = 0):
        from rlflow.cost.model import describe_hardware

        self.calibration = calibration
        super().__init__("cpu", calibration.as_peak() if calibration is not None else peak)
        self.kernels: dict[str, dict] = dict(kernels or {})
        self.fusion: dict[str, list] = {k: list(v) for k, v in (fusion or {}).items()}
        self.warmup, self.repeats, self.threads = warmup, repeats, threads
        self.hardware = hardware or describe_hardware("cpu")
        self._groups: dict[tuple[int, ...], tuple[list[Node], float, str]] = {}
        self._refresh()

    # ------------------------------------------------------------------ learned state
    def _refresh(self) -> None:
        self.fusable = frozenset(tuple(k.split(">", 1)) for k, (fused, seen) in self.fusion.items()
                                 if seen and fused * 2 >= seen)
        ratios: dict[str, list[float]] = {}
        for e in self.kernels.values():
            base = self._estimate(e["flops"], e["bytes"], e.get("gemm", True))
            if base > 0:
                ratios.setdefault(e["pattern"], []).append(e["runtime_ms"] / base)
        self.ratio = {k: statistics.median(v) for k, v in ratios.items()}
        every = [x for v in ratios.values() for x in v]
        self.default_ratio = statistics.median(every) if every else 1.0
        self._groups.clear()
        self._by_node.clear()

    @property
    def overhead_ms(self) -> float:
        return self.peak["launch_us"] * 1e-3

    def _estimate(self, flops: float, nbytes: float, gemm: bool) -> float:
        """Roofline ms of a kernel (calibrated rates), without the overhead."""
        return self.roofline_ms(flops if gemm else 0.0, nbytes)

    def _runtime(self, node, in_types, flops, nbytes):  # a node on its own (used by the base class only)
        return self._estimate(flops, nbytes, True) + self.overhead_ms

    # ------------------------------------------------------------------ per graph
    def node_costs(self, graph: Graph) -> list[NodeCost]:
        static, flags = _static(graph)
        zero = (0.0, 0.0, 0.0, 0.0)
        types = graph.types
        base = [zero if f else self.node_cost(n, types) for n, f in zip(graph.nodes, flags)]
        out = [(0.0, c[1], c[2], 0.0) for c in base]
        for members in kernel_groups(graph, self.fusable, flags):
            key = tuple(id(graph.nodes[i]) for i in members)
            hit = self._groups.get(key)
            if hit is None or any(a is not graph.nodes[i] for a, i in zip(hit[0], members)):
                rt, sig = self._group_runtime(graph, members, base)
                if len(self._groups) > 200_000:
                    self._groups.clear()
                hit = ([graph.nodes[i] for i in members], rt, sig)
                self._groups[key] = hit
            last = members[-1]
            out[last] = (hit[1], base[last][1], base[last][2], 1.0)
        return out

    def _group_runtime(self, graph: Graph, members: list[int], base: list[NodeCost]) -> tuple[float, str]:
        sig = group_signature(graph, members)
        e = self.kernels.get(sig)
        if e is not None:
            return e["runtime_ms"] + self.overhead_ms, sig
        flops = sum(base[i][1] for i in members)
        nbytes = sum(base[i][2] for i in members)
        pattern = "+".join(label(graph.nodes[i]) for i in members)
        est = self._estimate(flops, nbytes, True)
        return est * self.ratio.get(pattern, self.default_ratio) + self.overhead_ms, sig

    # ------------------------------------------------------------------ learning and timing
    def learn(self, graphs: Iterable[Graph]) -> int:
        """Learn the fused edges from onnxruntime's optimised models of ``graphs``; returns how many graphs."""
        count = 0
        for g in graphs:
            kept = optimised_value_names(g, self.threads)
            _, flags = _static(g)
            for p, c, v in single_consumer_edges(g, flags):
                key = f"{label(g.nodes[p])}>{label(g.nodes[c])}"
                fused, seen = self.fusion.get(key, [0, 0])
                self.fusion[key] = [fused + (v not in kept), seen + 1]
            count += 1
        self._refresh()
        return count

    def missing(self, graphs: Iterable[Graph]) -> dict[str, tuple[Graph, list[int]]]:
        """Kernel signatures of ``graphs`` that are not timed yet (first occurrence each)."""
        want: dict[str, tuple[Graph, list[int]]] = {}
        for g in graphs:
            self.node_costs(g)
            _, flags = _static(g)
            for members in kernel_groups(g, self.fusable, flags):
                hit = self._groups.get(tuple(id(g.nodes[i]) for i in members))
                sig = hit[2] if hit is not None else group_signature(g, members)
                if sig not in self.kernels and sig not in want:
                    want[sig] = (g, members)
        return want

    def measure(self, graphs: Iterable[Graph], progress: bool = False) -> int:
        """Time every kernel signature of ``graphs`` not timed yet; returns how many were timed."""
        from rlflow.graph.ops import node_bytes, node_flops

        want = self.missing(graphs)
        items = want.items()
        if progress:
            from tqdm import tqdm

            items = tqdm(items, desc="timing kernels", unit="kernel", file=sys.stderr, leave=False,
                         mininterval=1.0, disable=None)
        for sig, (g, members) in items:
            static, _ = _static(g)
            kernel = group_graph(g, members, static)
            flops = nbytes = 0.0
            for i in members:
                n = g.nodes[i]
                ins, outs = [g.types[v] for v in n.inputs if v], [g.types[v] for v in n.outputs]
                flops += node_flops(n, ins, outs)
                nbytes += node_bytes(n, ins, outs)
            self.kernels[sig] = {"pattern": "+".join(label(g.nodes[i]) for i in members),
                                 "runtime_ms": time_kernel(kernel, self.warmup, self.repeats, self.threads),
                                 "flops": float(flops), "bytes": float(nbytes)}
        if want:
            self._refresh()
        return len(want)

    def set_calibration(self, calibration: Calibration) -> None:
        """Use this device calibration (its GEMM rate, bandwidth and per-kernel overhead) from now on."""
        self.calibration = calibration
        self.peak = calibration.as_peak()
        self._refresh()

    def signatures(self, graph: Graph) -> set[str]:
        """The kernel signatures of ``graph``."""
        _, flags = _static(graph)
        return {group_signature(graph, m) for m in kernel_groups(graph, self.fusable, flags)}

    # ------------------------------------------------------------------ the cache
    def sections(self) -> dict:
        """What this target keeps in the cost cache (with the calibration it used)."""
        from rlflow.cost.calibration import to_json

        out = {"device": "cpu", "hardware": self.hardware, "warmup": self.warmup, "repeats": self.repeats,
               "kernels": dict(sorted(self.kernels.items())), "fusion": dict(sorted(self.fusion.items()))}
        if self.calibration is not None:
            out["calibration"] = to_json({"ort": self.calibration})
        return out

    def save(self, path) -> None:
        from rlflow.cost.model import write_cache

        write_cache(path, self.sections())

    def describe(self):
        return {**super().describe(), "kernels_timed": len(self.kernels),
                "fusable_edges": sorted(">".join(k) for k in self.fusable),
                "calibrated": self.calibration is not None}
