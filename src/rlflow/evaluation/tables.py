"""The evaluation's three outputs, made from the measurements: the table (CSV), DVC metrics and the headline row.

``evaluation.csv`` -- one row per (method, backend), method-major (original, taso, greedy, model_free, rlflow),
backends in the configured order; the columns, in this order (:data:`COLUMNS`):

=====================  =========================================================================================
model, method          the zoo model; ``original`` or the method whose optimised graph ran
backend, device        ``ort`` | ``torch`` | ``tf`` | ``tf-xla``; ``cpu`` | ``cuda``: where the runner actually
                       ran (a CPU-only build -- tensorflow-cpu -- runs on the CPU when the config says cuda)
latency_ms_median      median wall-clock latency of one inference (ms); empty if ``unsupported``
latency_ms_iqr         its interquartile range (ms)
peak_memory_mb         peak device memory during a run, as the backend reports it (CUDA: torch, tf); else empty
activation_memory_mb   the liveness estimate of :mod:`rlflow.evaluation.memory` (every row; weights excluded)
nodes                  operators in the graph as it ran (the ONNX file imported)
cost_ms, flops, bytes, launches
                       the cost model's estimate from the method's trace (``final``; the original: ``initial`` of
                       the first method's trace)
optimisation_s         the method's optimisation time (trace ``seconds``); empty for the original
training_s             RL methods: agent training time (trace ``training_seconds``); else empty
real_interactions      RL methods: real-environment steps in all (trace ``real_interactions.total``); else empty
rules_applied          rewrites applied (trace ``steps``); empty for the original
max_rel_diff           largest output difference from the ORIGINAL graph on onnxruntime (CPU), relative to the
                       output's magnitude (``rlflow.graph.exec.max_rel_diff``), same seeded inputs
status                 ``ok`` | ``mismatch`` (the original on a backend that disagrees with onnxruntime) |
                       ``unsupported`` (the backend has no lowering for an op of the graph, known before
                       running; the op is printed)
=====================  =========================================================================================

MB = 2^20 bytes. Numbers are written in full precision for integers and 6 significant digits otherwise.

``metrics.json`` (DVC metrics; only measured values, numbers only; L(m, b) = median latency of method m's
graph on backend b)::

    {"max_rel_diff": <largest over every row: every graph, the original too, on every backend>,
     "latency_ms":  {method: {backend: L(m, b)}},                       original included
     "speedup":     {method: {backend: L(original, b) / L(m, b)}},      optimised methods
     "improvement_vs_tf_pct": {method: {backend: 100 (L(original, tf) - L(m, b)) / L(original, tf)},
                               ...  plus "best": the same at the method's fastest backend},
     "rules_applied": {method: n}, "optimisation_s": {method: s}, "real_interactions": {method: n}}

``improvement_vs_tf_pct`` is the figure of RLFlow's Table 2: how much faster the optimised graph runs than
TensorFlow runs the ORIGINAL graph (the "tf" backend: Grappler on), in percent of the latter (positive = faster).

``results/summary/<model>.json`` -- the model's headline row for the cross-model summary (stage ``summary``);
L(m, b) as above, null where not measured (a backend not configured, or unsupported) or not applicable::

    {"format": "rlflow.evaluation-headline/1", "model": M, "device": "cpu"|"cuda", "backends": [...],
     "tolerance": t, "max_rel_diff": <largest over every row>,
     "methods": {method: {                          original, taso, greedy, model_free, rlflow (those evaluated)
         "best_backend": b,                         the backend where the method's graph ran fastest
         "latency_ms": L(m, b),                     its median latency there
         "speedup_ort": L(original, ort) / L(m, ort),        the graph rewrite alone, on onnxruntime
         "improvement_vs_tf_pct": 100 (L(original, tf) - L(m, b)) / L(original, tf),   RLFlow's Table 2
         "nodes": n, "cost_ms": c,                  the graph's size and the cost model's estimate
         "optimisation_s", "training_s", "real_interactions", "rules_applied"}}}   as in the table
"""

from __future__ import annotations

import csv
import io
import math
from typing import Any, Mapping, Sequence

from rlflow.evaluation.memory import MB
from rlflow.evaluation.runs import Measurement
from rlflow.evaluation.traces import TraceSummary

COLUMNS = ("model", "method", "backend", "device", "latency_ms_median", "latency_ms_iqr", "peak_memory_mb",
           "activation_memory_mb", "nodes", "cost_ms", "flops", "bytes", "launches", "optimisation_s", "training_s",
           "real_interactions", "rules_applied", "max_rel_diff", "status")
#: every method the table may hold, in its row order (the optimised ones are rlflow.pipeline.registry.METHODS)
METHOD_ORDER = ("original", "taso", "greedy", "model_free", "rlflow")
HEADLINE_FORMAT = "rlflow.evaluation-headline/1"


def make_rows(model: str, device: str, measurements: Sequence[Measurement], *, nodes: Mapping[str, int],
              activation_bytes: Mapping[str, int], traces: Mapping[str, TraceSummary]) -> list[dict[str, Any]]:
    """One dict per measurement with every column of :data:`COLUMNS` (None = empty). ``traces`` maps each
    optimised method to its trace; the original's cost is the ``initial`` of the first trace in method order."""
    first = next((traces[m] for m in METHOD_ORDER if m in traces), None)
    rows = []
    for ms in measurements:
        t = traces.get(ms.method)
        cost = (t.final if t is not None else first.initial if first is not None else {})
        rows.append({
            "model": model, "method": ms.method, "backend": ms.backend, "device": ms.device or device,
            "latency_ms_median": ms.median_ms, "latency_ms_iqr": ms.iqr_ms,
            "peak_memory_mb": None if ms.peak_memory_bytes is None else ms.peak_memory_bytes / MB,
            "activation_memory_mb": activation_bytes[ms.method] / MB,
            "nodes": nodes[ms.method],
            "cost_ms": cost.get("runtime_ms"), "flops": cost.get("flops"), "bytes": cost.get("bytes"),
            "launches": cost.get("launches"),
            "optimisation_s": t.optimisation_s if t else None, "training_s": t.training_s if t else None,
            "real_interactions": t.real_interactions if t else None, "rules_applied": t.rules_applied if t else None,
            "max_rel_diff": ms.max_rel_diff, "status": ms.status,
        })
    return rows


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool) or isinstance(v, str):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return repr(v)
        if v.is_integer() and abs(v) < 1e18:
            return str(int(v))
        return format(v, ".6g")
    return str(v)


def to_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows:
        w.writerow([_cell(r[c]) for c in COLUMNS])
    return buf.getvalue()


# ============================================================================================== derived figures
def _latency(rows) -> dict[str, dict[str, float]]:
    """method -> backend -> median latency, rows with status ok only (and the original's mismatching rows are
    left out too: a backend that computes the original wrongly gives no baseline)."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if r["status"] == "ok" and r["latency_ms_median"] is not None:
            out.setdefault(r["method"], {})[r["backend"]] = r["latency_ms_median"]
    return out


def _finite(values) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _best(lat: Mapping[str, float]) -> tuple[str | None, float | None]:
    if not lat:
        return None, None
    b = min(lat, key=lambda k: (lat[k], k))
    return b, lat[b]


def _improvement(base_tf: float | None, latency: float | None) -> float | None:
    if base_tf is None or latency is None:
        return None
    return 100.0 * (base_tf - latency) / base_tf


def metrics(rows: Sequence[Mapping[str, Any]]) -> dict:
    """``metrics.json`` (see the module docstring)."""
    lat = _latency(rows)
    orig = lat.get("original", {})
    base_tf = orig.get("tf")
    methods = [m for m in METHOD_ORDER if any(r["method"] == m for r in rows)]
    diffs = _finite(r["max_rel_diff"] for r in rows)
    doc: dict[str, Any] = {"max_rel_diff": max(diffs, default=0.0), "latency_ms": lat, "speedup": {},
                           "improvement_vs_tf_pct": {}}
    for m in methods:
        ml = lat.get(m, {})
        if m != "original":
            sp = {b: orig[b] / v for b, v in ml.items() if b in orig and v > 0}
            if sp:
                doc["speedup"][m] = sp
        if base_tf is not None and ml:
            imp = {b: _improvement(base_tf, v) for b, v in ml.items()}
            imp["best"] = _improvement(base_tf, _best(ml)[1])
            doc["improvement_vs_tf_pct"][m] = imp
    by_method = {r["method"]: r for r in rows}
    for key in ("rules_applied", "optimisation_s", "real_interactions"):
        vals = {m: by_method[m][key] for m in methods if by_method[m][key] is not None}
        if vals:
            doc[key] = vals
    return doc


def headline(model: str, device: str, backends: Sequence[str], tolerance: float,
             rows: Sequence[Mapping[str, Any]]) -> dict:
    """The model's row of the cross-model summary (``results/summary/<model>.json``; see the module docstring)."""
    lat = _latency(rows)
    orig = lat.get("original", {})
    by_method: dict[str, Mapping[str, Any]] = {}
    for r in rows:
        by_method.setdefault(r["method"], r)
    diffs = _finite(r["max_rel_diff"] for r in rows)
    out: dict[str, Any] = {"format": HEADLINE_FORMAT, "model": model, "device": device, "backends": list(backends),
                           "tolerance": tolerance, "max_rel_diff": max(diffs, default=0.0), "methods": {}}
    for m in METHOD_ORDER:
        if m not in by_method:
            continue
        r, ml = by_method[m], lat.get(m, {})
        best, best_ms = _best(ml)
        out["methods"][m] = {
            "best_backend": best, "latency_ms": best_ms,
            "speedup_ort": orig["ort"] / ml["ort"] if "ort" in orig and ml.get("ort") else None,
            "improvement_vs_tf_pct": _improvement(orig.get("tf"), best_ms),
            "nodes": r["nodes"], "cost_ms": r["cost_ms"],
            **{k: r[k] for k in ("optimisation_s", "training_s", "real_interactions", "rules_applied")},
        }
    return out


def summary_lines(rows: Sequence[Mapping[str, Any]], backends: Sequence[str]) -> list[str]:
    """A compact text table for the log: median latency (ms) per method and backend, and the speedup."""
    lat = _latency(rows)
    orig = lat.get("original", {})
    head = f"{'method':<11}" + "".join(f"{b:>20}" for b in backends)
    lines = [head]
    for m in METHOD_ORDER:
        if not any(r["method"] == m for r in rows):
            continue
        cells = []
        for b in backends:
            r = next(r for r in rows if r["method"] == m and r["backend"] == b)
            if r["latency_ms_median"] is None:
                cells.append(f"{r['status']:>20}")
            else:
                sp = f" ({orig[b] / r['latency_ms_median']:.3f}x)" if b in orig and m != "original" else ""
                cells.append(f"{r['latency_ms_median']:>10.3f}{sp:>10}")
        lines.append(f"{m:<11}" + "".join(cells))
    return lines
