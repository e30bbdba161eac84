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
   profiler, summing the group's kernel times per run (no session-call overhead; each kernel time less what the
   profiler itself adds to it, the calibration's ``profiler_overhead_s``), median of ``repeats`` runs; cached in
   the cost cache (``kernels``) per device. A learning graph's kernels are timed inside the whole model the same
   way, each of onnxruntime's kernels traced to the group it came from (:func:`trace_groups`);
4. **adds the per-kernel overhead** of the device's calibration (:mod:`rlflow.cost.calibration`, backend ``ort``)
   to every group; a group not timed yet is estimated from the calibrated roofline (GEMM rate, bandwidth) scaled
   by the median measured/estimate ratio of timed groups of the same op pattern (else of all of them);
5. **adds the layout reorders**: on x86 onnxruntime runs convolutions and pools in a blocked channel layout
   (``com.microsoft.nchwc``) and converts a tensor (``ReorderInput`` / ``ReorderOutput``) where it enters or
   leaves that layout. Which kernel patterns run blocked (Conv+Relu, pools) and which pass a blocked tensor
   through (Concat, Add) is learned from the same optimised models; a candidate graph pays one reorder per value
   that crosses the boundary (its bytes read and written at the calibrated bandwidth, plus the per-kernel
   overhead). A kernel timed on its own leaves its own reorders out of its time, since in the whole model they
   happen only at such boundaries. (This is what makes InceptionV3's merged convolutions slower end to end: the
   Split after a merged Conv leaves the blocked layout and the next Conv must enter it again.)

Value names of the optimised model identify what survives: a blocked node is named ``<value>_nchwc`` after the
value it computes, a blocked pass-through node keeps its name and outputs ``reorder_token_*`` values.

Per node the runtime of a group is reported on its last node (one launch); flops and bytes stay per node.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from rlflow.cost.calibration import Calibration
from rlflow.cost.ort_session import profiled_runs as _profiled_runs, session as _session
from rlflow.cost.model import NodeCost, CostModel, signature
from rlflow.graph.exported import as_exported, preactivation
from rlflow.graph.ir import Constant, Graph, Node
from rlflow.graph.ops import COMMUTATIVE



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
    return _wired_signature([graph.nodes[i] for i in members], graph.types)


def _wired_signature(nodes: list[Node], types: Mapping) -> str:
    """Of a commutative op (Add, Mul) the operands are listed in a canonical order, each type with its wire, so
    that swapping them (a commutativity rewrite) leaves the kernel known by its timings: onnxruntime runs it the
    same, and a search must not take an untimed copy's estimate for a gain."""
    made = {v: f"@{k}.{j}" for k, n in enumerate(nodes) for j, v in enumerate(n.outputs)}
    ext: dict[str, str] = {}
    parts = []
    for n in nodes:
        ins = n.inputs
        if n.op in COMMUTATIVE:  # by type, an operand made inside the kernel first (its wire), then the others
            ins = sorted(ins, key=lambda v: (str(types[v]), made.get(v, "~")))
        wires = ",".join(made.get(v) or ext.setdefault(v, f"${len(ext)}") if v else "-" for v in ins)
        parts.append(f"{signature(n, [types[v] for v in ins if v])}<{wires}>")
    return " ; ".join(parts)


def _fused_relu(graph: Graph, members: list[int]) -> Node | None:
    """The node of a kernel group that is a lone ``Conv[relu]`` (a Conv with a fused ReLU), else None."""
    if len(members) != 1:
        return None
    n = graph.nodes[members[0]]
    return n if n.op == "Conv" and n.attrs.get("activation") == "relu" else None


def kernel_pattern(graph: Graph, members: list[int]) -> str:
    """A kernel's op pattern (``MatMul+Add``); a lone ``Conv[relu]`` is onnxruntime's own ``Conv+Relu``."""
    if _fused_relu(graph, members) is not None:
        return "Conv+Relu"
    return "+".join(label(graph.nodes[i]) for i in members)


def unfused_signature(graph: Graph, members: list[int]) -> str | None:
    """The signature of the kernel group onnxruntime makes of a Conv with a fused ReLU: a lone ``Conv[relu]``
    node is the same kernel as the group Conv + Relu that onnxruntime fuses itself (and the ONNX export writes,
    :func:`rlflow.graph.exported.as_exported`), so it is known by that group's timings. None for any other group."""
    n = _fused_relu(graph, members)
    if n is None:
        return None
    conv, relu = as_exported(n)
    types = {v: graph.types[v] for v in n.inputs if v}
    types[preactivation(n)] = graph.types[n.outputs[0]]
    return _wired_signature([conv, relu], types)


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


NCHWC = "com.microsoft.nchwc"
_TOKEN = "reorder_token_"


def optimised_values(graph: Graph, threads: int = 0) -> tuple[set[str], set[str], set[str]]:
    """What survives of ``graph``'s values in onnxruntime's optimised model (``ORT_LEVEL``): (the value names
    that still exist, the values computed by a blocked-layout node, the values computed by a node that passes
    blocked tensors through). See the module docstring for how the names are read."""
    import onnx

    from rlflow.graph.onnx_io import to_onnx

    onx = to_onnx(graph)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "opt.onnx")
        _session(onx.SerializeToString(), threads, optimized_path=path)
        model = onnx.load(path, load_external_data=False)
    kept = {v for n in model.graph.node for v in (*n.input, *n.output)} | {o.name for o in model.graph.output}
    blocked = {n.name[:-len("_nchwc")] for n in model.graph.node
               if n.domain == NCHWC and n.name.endswith("_nchwc")}
    by_name = {n.name: n for n in onx.graph.node}
    passing = set()
    for n in model.graph.node:
        src = by_name.get(n.name)
        if n.domain != NCHWC and src is not None and src.op_type == n.op_type and n.output and \
                all(v.startswith(_TOKEN) for v in n.output):
            passing.update(src.output)
    return kept | blocked | passing, blocked, passing


def group_layout(graph: Graph, groups: list[list[int]], layout: Mapping[str, str]) -> list[bool]:
    """Per group (in order), whether onnxruntime runs it in the blocked layout: its pattern runs blocked
    (``layout[pattern] == "blocked"``), or passes a blocked tensor through and every tensor it reads is blocked."""
    blocked_value: dict[str, bool] = {}
    out = []
    for members in groups:
        kind = layout.get(kernel_pattern(graph, members))
        if kind == "pass":
            inside = {v for i in members for v in graph.nodes[i].outputs}
            reads = [v for i in members for v in graph.nodes[i].inputs if v and v not in inside]
            flags = [blocked_value[v] for v in reads if v in blocked_value]
            b = bool(flags) and all(flags) and len(flags) == sum(v not in graph.constants for v in reads)
        else:
            b = kind == "blocked"
        for i in members:
            for v in graph.nodes[i].outputs:
                blocked_value[v] = b
        out.append(b)
    return out


def reorders(graph: Graph, groups: list[list[int]], blocked: list[bool], static: set[str]
             ) -> list[tuple[int, str]]:
    """(group index, value) of every layout conversion onnxruntime adds, one per value: a blocked group's value
    that a plain-layout group reads or the graph outputs (charged to the producer), and a non-static plain value
    (a graph input too) that a blocked group reads (charged to its first blocked reader)."""
    where = {v: k for k, members in enumerate(groups) for i in members for v in graph.nodes[i].outputs}
    outs = set(graph.outputs)
    out: list[tuple[int, str]] = []
    done: set[str] = set()
    for k, members in enumerate(groups):
        for i in members:
            for v in graph.nodes[i].inputs:
                src = where.get(v)
                if not v or v in static or v in done or src == k:
                    continue
                src_blocked = src is not None and blocked[src]
                if src_blocked != blocked[k]:
                    done.add(v)
                    out.append((src if src_blocked else k, v))
            if blocked[k]:
                for v in graph.nodes[i].outputs:
                    if v in outs and v not in done:
                        done.add(v)
                        out.append((k, v))
    return out


#: sessions per kernel timing: a lone kernel's time moves by up to 1.8x between sessions on a 2-core CPU
#: (thread placement, buffer alignment; InceptionV3's 96-channel 35x35 Conv: 0.46-0.81 ms, 0.57 ms inside the
#: model), so each session's median is taken and the smallest of them kept
KERNEL_SESSIONS = 3


#: ops whose kernels are GEMM-like (their time is mostly arithmetic, prepacked weights): a pattern never seen keeps
#: the ratios of the patterns of its class (GEMM-like or not) rather than the median over all of them
GEMM_OPS = frozenset({"MatMul", "Gemm", "FusedMatMul", "Conv", "ConvTranspose", "Attention"})


def pattern_class(pattern: str) -> str:
    """``gemm`` for a kernel pattern with a GEMM-like op (``MatMul+Add``, ``Gemm``, ``Conv+Relu``), else ``other``."""
    return "class:gemm" if any(op.split("[")[0] in GEMM_OPS for op in pattern.split("+")) else "class:other"


#: a pattern's own in-model / alone ratio is used from this many kernels on; below, its class's (one kernel of a
#: pattern is too few: the zoo's GPT-2 has one small Gemm that ran 3.8x as long inside the model as alone)
MIN_PATTERN_KERNELS = 3


def _medians(values: Mapping[str, list[float]]) -> dict[str, float]:
    """Per pattern the median of its values, and per :func:`pattern_class` the median of its patterns' values
    (keys ``class:gemm``, ``class:other``): what a pattern never seen falls back to."""
    out = {k: statistics.median(v) for k, v in values.items()}
    by_class: dict[str, list[float]] = {}
    for k, v in values.items():
        by_class.setdefault(pattern_class(k), []).extend(v)
    out.update({k: statistics.median(v) for k, v in by_class.items()})
    return out


def _weighted_ratios(pairs: Mapping[str, list[tuple[float, float]]]) -> dict[str, float]:
    """In-model / alone per pattern from ``(in-model ms, alone ms)`` pairs: total over total (a long kernel counts
    for more than a short one), for patterns of :data:`MIN_PATTERN_KERNELS` kernels or more; and per
    :func:`pattern_class` over all its kernels (keys ``class:gemm``, ``class:other``)."""
    out = {k: sum(a for a, _ in v) / sum(b for _, b in v) for k, v in pairs.items()
           if len(v) >= MIN_PATTERN_KERNELS and sum(b for _, b in v) > 0}
    by_class: dict[str, list[tuple[float, float]]] = {}
    for k, v in pairs.items():
        by_class.setdefault(pattern_class(k), []).extend(v)
    out.update({k: sum(a for a, _ in v) / sum(b for _, b in v) for k, v in by_class.items()
                if sum(b for _, b in v) > 0})
    return out


def _kernel_ms(event: dict, profiler_ms: float) -> float:
    """A profiled kernel's time (ms), less what the profiler adds to each (``profiler_ms``), never below 0."""
    return max(0.0, event["dur"] / 1e3 - profiler_ms)


def time_kernel(kernel: Graph, warmup: int, repeats: int, threads: int = 0, sessions: int = KERNEL_SESSIONS,
                profiler_ms: float = 0.0) -> float:
    """The kernel times of ``kernel`` (ms) from onnxruntime's profiler: per session the median over ``repeats``
    runs (after ``warmup``) of the sum of its kernels' own times (no session call around them, no layout
    reorder; each less ``profiler_ms``, what the profiler adds to a kernel), the smallest over ``sessions``
    fresh sessions."""
    import bisect

    from rlflow.graph.exec import make_inputs
    from rlflow.graph.onnx_io import to_onnx

    feeds = make_inputs(kernel)
    model = to_onnx(kernel).SerializeToString()
    best = float("inf")
    for _ in range(max(1, sessions)):
        events, starts, _ = _profiled_runs(model, feeds, warmup, repeats, threads)
        per_run = [0.0] * len(starts)
        for e in events:  # a reorder of the kernel's own inputs / outputs is charged where the layout changes
            if not str((e.get("args") or {}).get("op_name", "")).startswith("Reorder"):
                k = bisect.bisect_right(starts, e["ts"]) - 1
                if k >= 0:
                    per_run[k] += _kernel_ms(e, profiler_ms)
        timed = per_run[warmup:] or per_run
        if timed:
            best = min(best, float(statistics.median(timed)))
    return best if best < float("inf") else 0.0


def wall_ms(graph: Graph, warmup: int, repeats: int, threads: int = 0) -> float:
    """``graph``'s run time (ms) in one fresh onnxruntime session without the profiler: the median of ``repeats``
    ``run`` calls after ``warmup``."""
    import time

    from rlflow.graph.exec import make_inputs
    from rlflow.graph.onnx_io import to_onnx

    s = _session(to_onnx(graph).SerializeToString(), threads)
    feeds = make_inputs(graph)
    for _ in range(warmup):
        s.run(None, feeds)
    ts = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        s.run(None, feeds)
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(ts))


def _is_reorder(op_type: str) -> bool:
    return op_type.startswith("Reorder")


def trace_groups(optimised, node_group: Mapping[str, int], value_group: Mapping[str, int]) -> dict[str, int]:
    """Which kernel group each node of onnxruntime's optimised model came from (node name -> group index): a node
    that keeps its source node's name, is named after it (``<node>/<Fusion>...``, the longest such prefix) or
    ``<value>_nchwc``, or computes one of the graph's values belongs to that node's / value's group; a node it
    made up (the Reshapes around a Gemm of 3-D inputs, ``gemm_input_reshape*``) to the group of the node that
    reads its output, else of the node that made its input. Layout reorders belong to no group (they are
    charged where the layout changes)."""
    nodes = [n for n in optimised.graph.node if not _is_reorder(n.op_type)]
    out: dict[str, int] = {}
    for n in nodes:
        k = node_group.get(n.name)
        parts = n.name.split("/")
        while k is None and len(parts) > 1:
            parts.pop()
            k = node_group.get("/".join(parts))
        if k is None and n.name.endswith("_nchwc"):
            k = value_group.get(n.name[:-len("_nchwc")])
        if k is None:
            k = next((value_group[v] for v in n.output if v in value_group), None)
        if k is not None:
            out[n.name] = k
    made = {v: n.name for n in nodes for v in n.output}
    readers: dict[str, list[str]] = {}
    for n in nodes:
        for v in n.input:
            readers.setdefault(v, []).append(n.name)
    for n in reversed(nodes):  # made-up nodes: the group of their reader, then of their producer
        if n.name not in out:
            k = next((out[r] for v in n.output for r in readers.get(v, ()) if r in out), None)
            if k is not None:
                out[n.name] = k
    for n in nodes:
        if n.name not in out:
            k = next((out[made[v]] for v in n.input if v in made and made[v] in out), None)
            if k is not None:
                out[n.name] = k
    return out


def profile_in_context(graph: Graph, groups: list[list[int]], warmup: int, repeats: int, threads: int = 0,
                       sessions: int = KERNEL_SESSIONS, profiler_ms: float = 0.0
                       ) -> tuple[list[float], float, tuple[float, float]]:
    """Each kernel group's time inside the whole model (ms): onnxruntime sessions of ``graph`` with the profiler,
    per group the median over ``repeats`` runs (after ``warmup``) of the summed times of the optimised nodes that
    came from its nodes (:func:`trace_groups`, on the session's own optimised model); of ``sessions`` fresh
    sessions the one with the smallest total is kept. Each kernel time is taken less ``profiler_ms``, what the
    profiler adds to it. Returns (per group; the median time per run of the nodes traced to no group and of the
    layout reorders; the reorders' time and output bytes per run)."""
    import bisect

    from rlflow.graph.exec import make_inputs
    from rlflow.graph.onnx_io import to_onnx

    onx = to_onnx(graph)
    model = onx.SerializeToString()
    node_group = {}
    value_group = {}
    for k, members in enumerate(groups):
        for i in members:
            node_group[onx.graph.node[i].name] = k
            for v in graph.nodes[i].outputs:
                value_group[v] = k
    feeds = make_inputs(graph)
    best: tuple[list[float], float, tuple[float, float]] | None = None
    for _ in range(max(1, sessions)):
        events, starts, optimised = _profiled_runs(model, feeds, warmup, repeats, threads, optimized=True)
        traced = trace_groups(optimised, node_group, value_group)
        first = starts[min(warmup, len(starts) - 1)] if starts else 0
        per = [[0.0] * len(starts) for _ in range(len(groups) + 1)]
        reorder = [0.0, 0.0]
        for e in events:
            args = e.get("args") or {}
            if _is_reorder(str(args.get("op_name", ""))) and e["ts"] >= first:
                reorder[0] += _kernel_ms(e, profiler_ms)
                reorder[1] += float(args.get("output_size", 0))
            k = traced.get(str(e["name"])[:-len("_kernel_time")], len(groups))
            r = bisect.bisect_right(starts, e["ts"]) - 1
            if r >= 0:
                per[k][r] += _kernel_ms(e, profiler_ms)
        med = [float(statistics.median(x[warmup:] or x)) if x else 0.0 for x in per]
        runs = max(1, len(starts) - min(warmup, max(len(starts) - 1, 0)))
        if best is None or sum(med) < sum(best[0]) + best[1]:
            best = (med[:-1], med[-1], (reorder[0] / runs, reorder[1] / runs))
    return best


class OrtCpuCost(CostModel):
    """onnxruntime on this CPU: learned fusions, timed kernels, calibrated per-kernel overhead."""

    name = "ort-cpu"
    label = "onnxruntime CPU (kernels timed)"
    additive = False  # a node's cost depends on the kernel it joins and on the layout of its neighbours

    def __init__(self, peak: Mapping[str, float] | None = None, calibration: Calibration | None = None,
                 kernels: Mapping[str, dict] | None = None, fusion: Mapping[str, list] | None = None,
                 warmup: int = 8, repeats: int = 32, hardware: str | None = None, threads: int = 0,
                 layout: Mapping[str, list] | None = None, context: Mapping[str, float] | None = None,
                 reorder: Sequence[float] | None = None):
        from rlflow.cost.model import describe_hardware

        self.calibration = calibration
        super().__init__("cpu", calibration.as_peak() if calibration is not None else peak)
        self.kernels: dict[str, dict] = dict(kernels or {})
        self.fusion: dict[str, list] = {k: list(v) for k, v in (fusion or {}).items()}
        # kernel pattern -> [times run blocked, times passing blocked tensors through, times seen]
        self.layout: dict[str, list] = {k: list(v) for k, v in (layout or {}).items()}
        # kernel signature -> its time inside a learning graph's whole model (ms); reorders seen: [ms, bytes]
        self.context: dict[str, float] = dict(context or {})
        self.reorder = [float(x) for x in (reorder or (0.0, 0.0))]
        self.warmup, self.repeats, self.threads = warmup, repeats, threads
        self.hardware = hardware or describe_hardware("cpu")
        self._groups: dict[tuple[int, ...], tuple[list[Node], float, str]] = {}
        self._parent: _Kernels | None = None  # the last graph changed_kernels scored the children of
        self._refresh()

    # ------------------------------------------------------------------ learned state
    def _refresh(self) -> None:
        self.fusable = frozenset(tuple(k.split(">", 1)) for k, (fused, seen) in self.fusion.items()
                                 if seen and fused * 2 >= seen)
        self.layout_kind = {k: "blocked" if b * 2 >= seen else "pass" for k, (b, ps, seen) in self.layout.items()
                            if seen and max(b, ps) * 2 >= seen}
        ratios: dict[str, list[float]] = {}
        for e in self.kernels.values():
            base = self._estimate(e["flops"], e["bytes"], e.get("gemm", True))
            if base > 0:
                ratios.setdefault(e["pattern"], []).append(e["runtime_ms"] / base)
        self.ratio = _medians(ratios)
        every = [x for v in ratios.values() for x in v]
        self.default_ratio = statistics.median(every) if every else 1.0
        ctx: dict[str, list[tuple[float, float]]] = {}  # a kernel inside the model, on its own; per pattern
        for sig, ms in self.context.items():
            e = self.kernels.get(sig)
            if e is not None and e["runtime_ms"] > 0:
                ctx.setdefault(e["pattern"], []).append((ms, e["runtime_ms"]))
        self.context_ratio = _weighted_ratios(ctx)
        inside, alone = sum(a for v in ctx.values() for a, _ in v), sum(b for v in ctx.values() for _, b in v)
        self.default_context_ratio = inside / alone if alone > 0 else 1.0
        self._groups.clear()
        self._by_node.clear()

    @property
    def overhead_ms(self) -> float:
        return self.peak["launch_us"] * 1e-3

    @property
    def profiler_ms(self) -> float:
        """What onnxruntime's profiler adds to each kernel time it reports (the calibration's), in ms."""
        c = self.calibration
        return (c.profiler_overhead_s or 0.0) * 1e3 if c is not None else 0.0

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
        groups = kernel_groups(graph, self.fusable, flags)
        for members in groups:
            nodes = [graph.nodes[i] for i in members]
            last = members[-1]
            out[last] = (self._kernel(nodes, types, [base[i] for i in members])[0], base[last][1], base[last][2],
                         1.0)
        if self.reorders_layout:
            blocked = group_layout(graph, groups, self.layout_kind)
            for k, v in reorders(graph, groups, blocked, static):
                last = groups[k][-1]
                rt, f, b, n = out[last]
                out[last] = (rt + self.reorder_ms(types[v].nbytes), f, b, n + 1)
        return out

    @property
    def reorders_layout(self) -> bool:
        """Does some kernel run in the blocked layout (then a graph pays layout reorders where it changes)?"""
        return "blocked" in self.layout_kind.values()

    def _kernel(self, nodes: list[Node], types: Mapping, base: list[NodeCost]) -> tuple[float, str]:
        """(runtime ms, signature) of the kernel made of ``nodes``, cached per node objects."""
        key = tuple(map(id, nodes))
        hit = self._groups.get(key)
        if hit is None or any(a is not b for a, b in zip(hit[0], nodes)):
            rt, sig = self._kernel_runtime(nodes, types, base)
            if len(self._groups) > 200_000:
                self._groups.clear()
            hit = (nodes, rt, sig)
            self._groups[key] = hit
        return hit[1], hit[2]

    def changed_kernels(self, parent: Graph, child: Graph, removed: set[str], changed: set[str],
                        around: list[str] | None = None) -> tuple[list[float], list[float]] | None:
        """For a search scoring ``child``, a rewrite of ``parent`` that removed the nodes named ``removed`` and
        added or rewired those named ``changed``: (the runtimes of ``parent``'s kernels the rewrite touched, the
        runtimes of ``child``'s kernels that replace them). Every other kernel is the same nodes joined the same
        way in both graphs, so it costs the same: the child's estimate is the parent's less the first list plus
        the second, exactly :meth:`node_costs`'s. None where that does not hold or is not worked out here: layout
        reorders in play, or a value outside the rewrite changing whether it is weight-only.

        ``around`` (a list) receives the names of the parent's nodes the answer read: the nodes of the touched
        kernels and of the kernels grown in the child, and the readers and makers of their values. Where
        :meth:`surroundings` of those names is the same in another graph, the same rewrite there (placed the same
        way) changes the estimate by the same amount."""
        if self.reorders_layout:
            return None
        pk = self._parent_kernels(parent)
        static = pk.static
        gone = [pk.by_name[x] for x in (*removed, *changed) if x in pk.by_name]  # (rewired: their old nodes)
        pos = {id(n): i for i, n in enumerate(child.nodes)}
        new = [n for n in child.nodes if n.name in changed]
        # weight-only status in the child: the parent's, the new nodes' from their inputs; a value outside the
        # rewrite that changes status changes kernels anywhere: not worked out here
        child_static: dict[str, bool] = {}
        consts = child.constants
        for n in new:
            st = n.op != "Opaque" and bool(n.inputs) and all(
                child_static.get(v, v in static or v in consts) for v in n.inputs if v)
            for v in n.outputs:
                if v in static and not st:
                    return None
                child_static[v] = st
        if any(st and v not in static for v, st in child_static.items()
               if v in pk.readers and any(r.name not in changed and r.name not in removed for r in pk.readers[v])):
            return None
        running_new = [n for n in new if not child_static[n.outputs[0]]]
        # the parent's kernels that hold a removed node, or a node next to one or to a new node
        gone_ids = {id(n) for n in gone}
        touched_values = {v for n in (*gone, *new) for v in (*n.inputs, *n.outputs) if v}
        seeds = {id(x) for v in touched_values for x in (*pk.readers.get(v, ()), *pk.maker(v))}
        old_groups = {pk.group_of[i] for i in seeds | gone_ids if i in pk.group_of}
        before = [pk.kernel_ms[k] for k in sorted(old_groups)]
        # the child's kernels around the same nodes: grown along fusable edges from the seeds
        readers: dict[str, list[Node]] = {}
        for v in touched_values:
            rs = [r for r in pk.readers.get(v, ()) if id(r) not in gone_ids]
            rs += [n for n in running_new for x in n.inputs if x == v]
            readers[v] = rs
        makers = {v: n for n in running_new for v in n.outputs}
        outs = set(child.outputs)

        def reads_of(v: str) -> list[Node]:
            if v not in readers:
                readers[v] = [r for r in pk.readers.get(v, ()) if id(r) not in gone_ids]
            return readers[v]

        def maker_of(v: str) -> Node | None:
            if v in makers:
                return makers[v]
            m = pk.maker(v)
            return m[0] if m and id(m[0]) not in gone_ids and id(m[0]) in pos else None

        new_ids = {id(n) for n in new}

        def is_running(n: Node) -> bool:
            return not child_static[n.outputs[0]] if id(n) in new_ids else id(n) in pk.running

        def fused(p: Node, v: str, c: Node) -> bool:
            return v not in outs and c is not p and (label(p), label(c)) in self.fusable

        start = running_new + [x for x in (pk.node_by_id[i] for i in seeds)
                                            if id(x) not in gone_ids and id(x) in pos and is_running(x)]
        seen: set[int] = set()
        after = []
        grown: list[Node] = []  # the parent's nodes in the child's kernels
        for s0 in start:
            if id(s0) in seen:
                continue
            comp, stack = [], [s0]
            seen.add(id(s0))
            while stack:
                n = stack.pop()
                comp.append(n)
                for v in n.outputs:  # to its one reader
                    rs = reads_of(v)
                    if len(rs) == 1 and is_running(rs[0]) and fused(n, v, rs[0]) and id(rs[0]) not in seen:
                        seen.add(id(rs[0]))
                        stack.append(rs[0])
                for v in n.inputs:  # to the maker of a value it alone reads
                    m = maker_of(v) if v else None
                    if m is not None and is_running(m) and len(reads_of(v)) == 1 and fused(m, v, n) and \
                            id(m) not in seen:
                        seen.add(id(m))
                        stack.append(m)
            comp.sort(key=lambda n: pos[id(n)])
            types = child.types
            after.append(self._kernel(comp, types, [self.node_cost(n, types) for n in comp])[0])
            grown.extend(n for n in comp if id(n) not in new_ids)
        if around is not None:
            core = [pk.node_by_id[i] for i in seeds if i in pk.node_by_id]
            core += [n for k in old_groups for n in pk.members[k]] + gone + grown
            around.extend(sorted({n.name for n in core}, key=pk.pos.__getitem__))
        return before, after

    def surroundings(self, graph: Graph, names: list[str]) -> tuple | None:
        """What :meth:`changed_kernels` reads of ``graph`` around the nodes ``names`` (its ``around`` list, in
        graph order): the node objects and their order, whether each runs, the kernels they sit in, and of each of
        their values the maker and readers (and whether those run), its type, whether it is weight-only and
        whether it is a graph output. None if a node is missing or out of order. Two graphs with equal
        surroundings give a rewrite there the same change of estimate."""
        pk = self._parent_kernels(graph)
        nodes = tuple(pk.by_name.get(x) for x in names)
        if any(n is None for n in nodes):
            return None
        order = [pk.pos[x] for x in names]
        if any(a > b for a, b in zip(order, order[1:])):
            return None
        group_of, members, value = pk.group_of, pk.members, pk.value
        return (nodes, tuple(members[group_of[id(n)]] if id(n) in group_of else None for n in nodes),
                tuple(value(v) for v in sorted({v for n in nodes for v in (*n.inputs, *n.outputs) if v})))

    def _parent_kernels(self, graph: Graph) -> "_Kernels":
        hit = self._parent
        if hit is None or hit.graph is not graph:
            hit = self._parent = _Kernels(self, graph)
        return hit

    def alone_ms(self, node: Node, types: Mapping) -> float:
        """``node`` as a kernel of its own (its in-model or lone timing, else its scaled estimate, plus the
        per-kernel overhead), without layout reorders: what an additive search sums per op."""
        ins = list(dict.fromkeys(v for v in node.inputs if v))
        g = Graph(inputs=ins, outputs=list(node.outputs), nodes=[node],
                  types={v: types[v] for v in (*ins, *node.outputs)})
        return self._group_runtime(g, [0], [self.node_cost(node, types)])[0]

    @property
    def prices_pairs(self) -> bool:
        return bool(self.fusable)

    def fused_ms(self, nodes: Sequence[Node], types: Mapping) -> float | None:
        """``nodes`` as one kernel where onnxruntime fuses every edge between them (each of its kind fusable, and
        the nodes a tree of such edges), with the per-kernel overhead once; None where it does not."""
        edges = [(label(p), label(c)) for p in nodes for c in nodes if p is not c and set(p.outputs) & set(c.inputs)]
        if len(edges) != len(nodes) - 1 or any(e not in self.fusable for e in edges):
            return None
        return self._kernel_runtime(list(nodes), types, [self.node_cost(n, types) for n in nodes])[0]

    def reorder_ms(self, nbytes: float) -> float:
        """One layout reorder of a tensor of ``nbytes``: at the rate the learning graphs' reorders ran, else its
        bytes read and written at the calibrated bandwidth; plus the per-kernel overhead."""
        ms, seen = self.reorder
        rate = ms / seen if seen > 0 else self.roofline_ms(0.0, 2.0)
        return nbytes * rate + self.overhead_ms

    def _group_runtime(self, graph: Graph, members: list[int], base: list[NodeCost]) -> tuple[float, str]:
        """A kernel's time: inside the model where a learning graph ran it, else timed on its own (or its
        roofline estimate) scaled by its pattern's inside/alone ratio; plus the per-kernel overhead."""
        return self._kernel_runtime([graph.nodes[i] for i in members], graph.types, [base[i] for i in members])

    def _kernel_runtime(self, nodes: list[Node], types: Mapping, base: list[NodeCost]) -> tuple[float, str]:
        """:meth:`_group_runtime` of the kernel made of ``nodes`` (in graph order; ``base``: their node costs)."""
        kernel = Graph(inputs=[], outputs=[], nodes=nodes, types=types)
        members = list(range(len(nodes)))
        sig = group_signature(kernel, members)
        pattern = kernel_pattern(kernel, members)
        alt = unfused_signature(kernel, members)  # a fused Conv[relu] is onnxruntime's own Conv + Relu kernel
        keys = ([alt] if alt else []) + [sig]
        scale = self.context_ratio.get(pattern) or self.context_ratio.get(pattern_class(pattern),
                                                                          self.default_context_ratio)
        for key in keys:
            if key in self.context:
                return self.context[key] + self.overhead_ms, sig
        for key in keys:
            e = self.kernels.get(key)
            if e is not None:
                return e["runtime_ms"] * scale + self.overhead_ms, sig
        flops = sum(c[1] for c in base)
        nbytes = sum(c[2] for c in base)
        est = self._estimate(flops, nbytes, True)
        ratio = self.ratio.get(pattern) or self.ratio.get(pattern_class(pattern), self.default_ratio)
        return est * ratio * scale + self.overhead_ms, sig

    # ------------------------------------------------------------------ learning and timing
    def learn(self, graphs: Iterable[Graph]) -> int:
        """Learn the fused edges from onnxruntime's optimised models of ``graphs``; returns how many graphs."""
        seen_graphs = []
        for g in graphs:
            kept, blocked, passing = optimised_values(g, self.threads)
            _, flags = _static(g)
            for p, c, v in single_consumer_edges(g, flags):
                key = f"{label(g.nodes[p])}>{label(g.nodes[c])}"
                fused, seen = self.fusion.get(key, [0, 0])
                self.fusion[key] = [fused + (v not in kept), seen + 1]
            seen_graphs.append((g, flags, blocked, passing))
        self._refresh()
        grouped = []
        for g, flags, blocked, passing in seen_graphs:  # the kernels as now grouped: layout, time in the model
            groups = kernel_groups(g, self.fusable, flags)
            for members in groups:
                outs = {v for i in members for v in g.nodes[i].outputs}
                key = kernel_pattern(g, members)
                b, ps, seen = self.layout.get(key, [0, 0, 0])
                self.layout[key] = [b + bool(outs & blocked), ps + bool(outs & passing), seen + 1]
            grouped.append((g, groups))
        # sessions interleaved over the graphs (one of each, then again): a slow spell of the machine hits them
        # alike, and each graph keeps its fastest session, profiled and not
        best: list = [None] * len(grouped)
        wall = [float("inf")] * len(grouped)
        for _ in range(KERNEL_SESSIONS):
            for j, (g, groups) in enumerate(grouped):
                p = profile_in_context(g, groups, self.warmup, self.repeats, self.threads, sessions=1,
                                       profiler_ms=self.profiler_ms)
                if best[j] is None or sum(p[0]) + p[1] < sum(best[j][0]) + best[j][1]:
                    best[j] = p
                wall[j] = min(wall[j], wall_ms(g, self.warmup, self.repeats, self.threads))
        for (g, groups), (times, rest, (reorder_ms, reorder_bytes)), w in zip(grouped, best, wall):
            # the profiler still inflates kernels beyond the calibrated figure (more on multi-threaded ones: a
            # 2-layer BERT export's kernels, less that figure, summed to 10-25% over its run time): the times are
            # scaled so that the graph's kernels and per-kernel overheads add up to its run time without profiler
            profiled = sum(times) + rest
            scale = (w - len(groups) * self.overhead_ms) / profiled if profiled > 0 and w < float("inf") else 1.0
            scale = max(scale, 0.0)
            for members, ms in zip(groups, times):
                self.context.setdefault(group_signature(g, members), ms * scale)
            self.reorder = [self.reorder[0] + reorder_ms * scale, self.reorder[1] + reorder_bytes]
        self._refresh()
        return len(seen_graphs)

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
            self.kernels[sig] = {"pattern": kernel_pattern(g, members),
                                 "runtime_ms": time_kernel(kernel, self.warmup, self.repeats, self.threads,
                                                           profiler_ms=self.profiler_ms),
                                 "flops": float(flops), "bytes": float(nbytes)}
        if want:
            self._refresh()
        return len(want)

    def set_calibration(self, calibration: Calibration) -> None:
        """Use this device calibration (its GEMM rate, bandwidth and per-kernel overhead) from now on."""
        self.calibration = calibration
        self.peak = calibration.as_peak()
        self._refresh()

    def groups(self, graph: Graph) -> list[list[int]]:
        """``graph``'s nodes grouped into the kernels onnxruntime runs (by the fusions learned so far)."""
        _, flags = _static(graph)
        return kernel_groups(graph, self.fusable, flags)

    def signatures(self, graph: Graph) -> set[str]:
        """The kernel signatures of ``graph``."""
        return {group_signature(graph, m) for m in self.groups(graph)}

    # ------------------------------------------------------------------ the cache
    def sections(self) -> dict:
        """What this target keeps in the cost cache (with the calibration it used)."""
        from rlflow.cost.calibration import to_json

        out = {"device": "cpu", "hardware": self.hardware, "warmup": self.warmup, "repeats": self.repeats,
               "kernels": dict(sorted(self.kernels.items())), "fusion": dict(sorted(self.fusion.items())),
               "layout": dict(sorted(self.layout.items())), "context": dict(sorted(self.context.items())),
               "reorder": list(self.reorder)}
        if self.calibration is not None:
            out["calibration"] = to_json({"ort": self.calibration})
        return out

    def save(self, path) -> None:
        from rlflow.cost.model import write_cache

        write_cache(path, self.sections())

    def describe(self):
        return {**super().describe(), "kernels_timed": len(self.kernels),
                "fusable_edges": sorted(">".join(k) for k in self.fusable),
                "blocked_layout": sorted(k for k, v in self.layout_kind.items() if v == "blocked"),
                "calibrated": self.calibration is not None}


class _Kernels:
    """What :meth:`OrtCpuCost.changed_kernels` keeps of a parent graph: its weight-only values, running nodes,
    readers and makers of each value, node positions, graph outputs, and its kernels (node -> kernel, each
    kernel's nodes and runtime)."""

    def __init__(self, cost: OrtCpuCost, graph: Graph):
        self.graph = graph
        self.static, flags = _static(graph)
        nodes = graph.nodes
        self.running = {id(n) for n, f in zip(nodes, flags) if not f}
        self.by_name = {n.name: n for n in nodes}
        self.node_by_id = {id(n): n for n in nodes}
        self.readers: dict[str, list[Node]] = {}
        self._maker: dict[str, Node] = {}
        for n in nodes:
            for v in n.inputs:
                if v:
                    self.readers.setdefault(v, []).append(n)
            for v in n.outputs:
                self._maker[v] = n
        self.pos = {n.name: i for i, n in enumerate(nodes)}
        self.outs = set(graph.outputs)
        self._values: dict[str, tuple] = {}
        types = graph.types
        self.group_of: dict[int, int] = {}
        self.kernel_ms: list[float] = []
        self.members: list[tuple[Node, ...]] = []
        for k, members in enumerate(kernel_groups(graph, cost.fusable, flags)):
            ks = tuple(nodes[i] for i in members)
            self.members.append(ks)
            self.kernel_ms.append(cost._kernel(list(ks), types, [cost.node_cost(n, types) for n in ks])[0])
            for n in ks:
                self.group_of[id(n)] = k

    def value(self, v: str) -> tuple:
        """What :meth:`OrtCpuCost.surroundings` compares of a value: (name, its maker and readers, whether each
        of them runs, weight-only?, graph output?, type)."""
        hit = self._values.get(v)
        if hit is None:
            near = (*self.maker(v), *self.readers.get(v, ()))
            hit = self._values[v] = (v, near, tuple(id(x) in self.running for x in near), v in self.static,
                                     v in self.outs, self.graph.types.get(v))
        return hit

    def maker(self, v: str) -> tuple[Node, ...]:
        m = self._maker.get(v)
        return (m,) if m is not None else ()
