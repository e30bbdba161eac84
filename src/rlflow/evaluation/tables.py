"""The evaluation's three outputs, made from the measurements with pandas: the table (CSV), DVC metrics and the
headline row.

``evaluation.csv`` -- one row per (method, backend), method-major (original, original-aa, taso, greedy,
eqsat, eqsat_rl, model_free, rlflow), backends in the configured order; the columns, in this order (:data:`COLUMNS`):

=====================  =========================================================================================
model, method          the zoo model; ``original``, ``original-aa`` (the A/A control: the original exported and
                       imported again, timed as a graph of its own) or the method whose optimised graph ran
backend, device        ``ort`` | ``torch`` | ``tf`` | ``tf-xla``; ``cpu`` | ``cuda``: where the runner actually
                       ran (a CPU-only build -- tensorflow-cpu -- runs on the CPU when the config says cuda)
device_note            why the runner ran elsewhere than the configured device (``no CUDA provider in this
                       onnxruntime``, ``TensorFlow ... sees no GPU``); else empty
latency_ms_median      median wall-clock latency of one inference over all timed calls (ms); empty if not timed
latency_ms_iqr         its interquartile range (ms)
ratio                  latency / the original's on the same backend under the measurement protocol
                       (:mod:`rlflow.evaluation.protocol`; < 1: faster); 1 for the original
ci_low, ci_high        its 95% interval (paired by round; Student's t over sessions); empty for the original
verdict                ``faster`` | ``slower`` | ``no detectable difference`` (the interval below / above / around
                       1); ``reference`` for the original
detectable_effect      the smallest relative change the comparison could detect (80% power; 0.02 = 2%)
sessions, runs         independently built runners and timed calls behind the row
too_noisy              ``True`` on every row of a backend whose A/A control's interval excludes 1.0: no verdict
                       of that backend is a finding (:func:`finding`)
roofline_ms            the graph's roofline lower bound at the device's calibrated GEMM rate and bandwidth
                       (:mod:`rlflow.evaluation.roofline`; the same for every backend); empty on a device without
                       calibration (a GPU)
headroom               1 - roofline_ms / latency_ms_median: the share of the latency any rewrite could still win
peak_memory_mb         peak device memory during a run, as the backend reports it (CUDA: torch, tf); else empty
activation_memory_mb   the liveness estimate of :mod:`rlflow.evaluation.memory` (every row; weights excluded)
nodes                  operators in the graph as it ran (the ONNX file imported)
cost_ms, flops, bytes, launches
                       the cost model's estimate from the method's trace (``final``; the original and its A/A
                       control: ``initial`` of the first method's trace)
optimisation_s         the method's optimisation time (trace ``seconds``); empty for the original
training_s             RL methods: agent training time (trace ``training_seconds``); else empty
real_interactions      RL methods: real-environment steps in all (trace ``real_interactions.total``); else empty
rules_applied          rewrites applied (trace ``steps``); empty for the original and for eqsat and eqsat_rl (they
                       rewrite an e-graph, not the graph one step at a time)
speed_check            the method stage's never-slower check (trace ``speed_check``): ``kept optimised`` |
                       ``kept original`` (its graph was not significantly faster on the check backend, so the
                       method delivers the original) | empty (not checked)
max_rel_diff           largest output difference from the ORIGINAL graph on onnxruntime (CPU), relative to the
                       output's magnitude (``rlflow.graph.exec.max_rel_diff``), same seeded inputs
same_as_original       ``True`` when the graph that ran is the original's (equal ``Graph.structural_hash``: the
                       method found nothing, or its stage kept the original); its figures are then the A/A
                       control's comparison, not a finding of its own. ``True`` for the original and its A/A control
status                 ``ok`` | ``mismatch`` (the original on a backend that disagrees with onnxruntime) |
                       ``unsupported`` (the backend has no lowering for an op of the graph, known before
                       running; the op is printed)
=====================  =========================================================================================

MB = 2^20 bytes. Numbers are written with 6 significant digits (integers in full).

``metrics.json`` (DVC metrics; measured values only)::

    {"max_rel_diff": <largest over every row: every graph, the original too, on every backend>,
     "too_noisy":  {backend: true|false},                                the A/A control per backend
     "latency_ms": {method: {backend: median}},                          original included
     "ratio":      {method: {backend: {"ratio", "ci_low", "ci_high", "verdict", "detectable_effect"}}},
                                                                         every graph but the original
     "improvement_vs_tf": {method: {"ratio", "ci_low", "ci_high", "verdict", "pct", "pct_low", "pct_high"}},
     "roofline": {"gemm_gflops", "bandwidth_gbps", "source",            the device's calibrated figures (absent
                  "bound_ms": {method: ms},                             on a device without calibration), each
                  "headroom": {method: {backend: share}}},              graph's bound and its headroom
     "rules_applied": {method: n}, "optimisation_s": {method: s}, "real_interactions": {method: n}}

``improvement_vs_tf`` is the figure of RLFlow's Table 2 measured honestly: TensorFlow (``tf``, Grappler on)
running the ORIGINAL graph against TensorFlow running the method's graph, both under the protocol in the same
comparison: the ratio, its interval and verdict, and ``pct`` = 100 (1 - ratio) (positive = faster) with
``pct_low``/``pct_high`` from the interval. No figure compares different backends.

``results/summary/<model>.json`` -- the model's headline for the cross-model summary (stage ``summary``)::

    {"format": "rlflow.evaluation-headline/2", "model": M, "device": "cpu"|"cuda", "backends": [...],
     "tolerance": t, "max_rel_diff": <largest over every row>, "too_noisy": {backend: bool},
     "methods": {method: {                          original, original-aa, taso, ... (those evaluated)
         "backends": {backend: {"latency_ms", "ratio", "ci_low", "ci_high", "verdict", "finding"}},
         "improvement_vs_tf": {...} | null,        as in metrics.json
         "nodes": n, "cost_ms": c,                 the graph's size and the cost model's estimate
         "same_as_original": bool,                 the graph that ran is the original's (its figures are the
                                                   A/A control's comparison)
         "estimate_ms", "original_estimate_ms":    the trace's estimate of the graph the method found (``final``)
                                                   and of the original (``initial``), on the method's target
         "platform": {"target", "label", "device", "backend", "verifiable"} | null,
                                                   the platform the method optimised for (its trace's)
         "optimisation_s", "training_s", "real_interactions", "rules_applied", "speed_check"}}}
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from rlflow.evaluation.memory import MB
from rlflow.evaluation.protocol import AA, REFERENCE
from rlflow.evaluation.runs import Measurement
from rlflow.evaluation.traces import TraceSummary

if TYPE_CHECKING:
    import pandas as pd

COLUMNS = ("model", "method", "backend", "device", "device_note", "latency_ms_median", "latency_ms_iqr", "ratio",
           "ci_low", "ci_high", "verdict", "detectable_effect", "sessions", "runs", "too_noisy", "roofline_ms",
           "headroom", "peak_memory_mb", "activation_memory_mb", "nodes", "cost_ms", "flops", "bytes", "launches",
           "optimisation_s", "training_s", "real_interactions",
           "rules_applied", "speed_check", "max_rel_diff", "status", "same_as_original")
#: columns holding whole numbers (written in full)
INT_COLUMNS = ("sessions", "runs", "nodes", "flops", "bytes", "launches", "real_interactions", "rules_applied")
#: every method the table may hold, in its row order (the optimised ones are rlflow.pipeline.registry.METHODS)
METHOD_ORDER = ("original", AA, "taso", "greedy", "eqsat", "eqsat_rl", "model_free", "rlflow", "taso_machine",
                "greedy_machine", "eqsat_machine", "ort_optimizer", "model_free_machine", "rlflow_machine")
HEADLINE_FORMAT = "rlflow.evaluation-headline/3"
TOO_NOISY = "too noisy"


def finding(verdict: str | None, too_noisy: bool) -> str:
    """What a row may be reported as: its verdict, or ``too noisy`` when the backend's A/A control failed."""
    if not verdict:
        return ""
    return TOO_NOISY if too_noisy and verdict != REFERENCE else verdict


def make_rows(model: str, device: str, measurements: Sequence[Measurement], *, nodes: Mapping[str, int],
              activation_bytes: Mapping[str, int], traces: Mapping[str, TraceSummary],
              bounds: Mapping[str, float] | None = None,
              same: Mapping[str, bool] | None = None) -> list[dict[str, Any]]:
    """One dict per measurement with every column of :data:`COLUMNS` (None = empty). ``traces`` maps each
    optimised method to its trace; the original's cost is the ``initial`` of the first trace in method order.
    ``bounds`` maps each graph (method) to its roofline lower bound in ms (:mod:`rlflow.evaluation.roofline`).
    ``same`` maps each optimised method to whether its graph is the original's (``same_as_original``; the
    original and the A/A control are always True; a method not in it: None, empty)."""
    from rlflow.evaluation.roofline import headroom

    bounds = bounds or {}
    first = next((traces[m] for m in METHOD_ORDER if m in traces), None)
    rows = []
    for ms in measurements:
        t = traces.get(ms.method)
        cost = (t.final if t is not None else first.initial if first is not None else {})
        own = "original" if ms.method == AA else ms.method  # the A/A control is the original's graph
        rows.append({
            "model": model, "method": ms.method, "backend": ms.backend, "device": ms.device or device,
            "device_note": ms.device_note or None,
            "latency_ms_median": ms.median_ms, "latency_ms_iqr": ms.iqr_ms,
            "ratio": ms.ratio, "ci_low": ms.ci_low, "ci_high": ms.ci_high, "verdict": ms.verdict or None,
            "detectable_effect": ms.detectable,
            "sessions": len(ms.times_ms) if ms.times_ms else None,
            "runs": sum(map(len, ms.times_ms)) if ms.times_ms else None,
            "too_noisy": ms.too_noisy,
            "roofline_ms": bounds.get(own), "headroom": headroom(bounds.get(own), ms.median_ms),
            "peak_memory_mb": None if ms.peak_memory_bytes is None else ms.peak_memory_bytes / MB,
            "activation_memory_mb": activation_bytes[own] / MB,
            "nodes": nodes[own],
            "speed_check": t.speed_check if t else None,
            "cost_ms": cost.get("runtime_ms"), "flops": cost.get("flops"), "bytes": cost.get("bytes"),
            "launches": cost.get("launches"),
            "optimisation_s": t.optimisation_s if t else None, "training_s": t.training_s if t else None,
            "real_interactions": t.real_interactions if t else None, "rules_applied": t.rules_applied if t else None,
            "max_rel_diff": ms.max_rel_diff, "status": ms.status,
            "same_as_original": True if own == "original" else (same or {}).get(ms.method),
        })
    return rows


def frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The rows as a DataFrame with :data:`COLUMNS` (whole-number columns as nullable integers)."""
    import pandas as pd  # here, not at the top: the search stages import this package and need no pandas

    df = pd.DataFrame(list(rows), columns=list(COLUMNS))
    for c in INT_COLUMNS:
        vals = pd.to_numeric(df[c], errors="coerce")
        if (vals.dropna() % 1 == 0).all():
            df[c] = vals.round().astype("Int64")
    return df


def to_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    return frame(rows).to_csv(index=False, float_format="%.6g", lineterminator="\n")


# ============================================================================================== derived figures
def _ok(rows) -> pd.DataFrame:
    """The timed rows (status ok, a latency): a backend that computes the original wrongly gives no baseline."""
    import pandas as pd

    df = pd.DataFrame(list(rows))
    return df[(df["status"] == "ok") & df["latency_ms_median"].notna()]


def _num(v) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def _interval(r: Mapping[str, Any]) -> dict[str, Any]:
    return {"ratio": _num(r["ratio"]), "ci_low": _num(r["ci_low"]), "ci_high": _num(r["ci_high"]),
            "verdict": r["verdict"], "detectable_effect": _num(r["detectable_effect"])}


def _vs_tf(ok: pd.DataFrame, method: str) -> dict[str, Any] | None:
    """The method's graph on TensorFlow against the original on TensorFlow (same comparison), or None."""
    sel = ok[(ok["method"] == method) & (ok["backend"] == "tf") & ok["ci_low"].notna()]
    if sel.empty:
        return None
    r = sel.iloc[0]
    out = {k: v for k, v in _interval(r).items() if k != "detectable_effect"}
    out.update(pct=100 * (1 - out["ratio"]), pct_low=100 * (1 - out["ci_high"]), pct_high=100 * (1 - out["ci_low"]),
               finding=finding(r["verdict"], bool(r["too_noisy"])))
    return out


def _noisy(rows) -> dict[str, bool]:
    out: dict[str, bool] = {}
    for r in rows:
        out[r["backend"]] = out.get(r["backend"], False) or bool(r["too_noisy"])
    return out


def _max_diff(rows) -> float:
    return max((float(r["max_rel_diff"]) for r in rows
                if r["max_rel_diff"] is not None and math.isfinite(r["max_rel_diff"])), default=0.0)


def metrics(rows: Sequence[Mapping[str, Any]], limits: Mapping[str, Any] | None = None) -> dict:
    """``metrics.json`` (see the module docstring); ``limits``: the device figures the roofline bounds were
    computed at (:meth:`rlflow.evaluation.roofline.DeviceLimits.as_dict`), None when there are none."""
    ok = _ok(rows)
    methods = [m for m in METHOD_ORDER if any(r["method"] == m for r in rows)]
    lat = ok.pivot(index="method", columns="backend", values="latency_ms_median")
    doc: dict[str, Any] = {"max_rel_diff": _max_diff(rows), "too_noisy": _noisy(rows), "latency_ms": {},
                           "ratio": {}, "improvement_vs_tf": {}}
    for m in methods:
        if m in lat.index:
            doc["latency_ms"][m] = {b: float(v) for b, v in lat.loc[m].dropna().items()}
        if m == "original":
            continue
        sel = ok[(ok["method"] == m) & ok["ci_low"].notna()]
        if not sel.empty:
            doc["ratio"][m] = {r["backend"]: _interval(r) for _, r in sel.iterrows()}
        if m != AA and (tf := _vs_tf(ok, m)) is not None:
            doc["improvement_vs_tf"][m] = {k: v for k, v in tf.items() if k != "finding"}
    if limits is not None:
        bounded = ok[ok["headroom"].notna()] if "headroom" in ok else ok.iloc[0:0]
        doc["roofline"] = {**limits, "bound_ms": {r["method"]: float(r["roofline_ms"]) for _, r in bounded.iterrows()},
                           "headroom": {m: {r["backend"]: float(r["headroom"]) for _, r in g.iterrows()}
                                        for m, g in bounded.groupby("method", sort=False)}}
    by_method = {r["method"]: r for r in rows}
    for key in ("rules_applied", "optimisation_s", "real_interactions"):
        vals = {m: by_method[m][key] for m in methods if by_method[m][key] is not None}
        if vals:
            doc[key] = vals
    return doc


def headline(model: str, device: str, backends: Sequence[str], tolerance: float,
             rows: Sequence[Mapping[str, Any]], traces: Mapping[str, TraceSummary] | None = None,
             platforms: Mapping[str, Mapping[str, Any] | None] | None = None) -> dict:
    """The model's headline for the cross-model summary (``results/summary/<model>.json``; see the module
    docstring): per method and backend, never a method's best backend. ``traces``: each optimised method's trace
    (its estimates); ``platforms``: the platform record each method's trace names (None where it names none)."""
    ok = _ok(rows)
    out: dict[str, Any] = {"format": HEADLINE_FORMAT, "model": model, "device": device, "backends": list(backends),
                           "tolerance": tolerance, "max_rel_diff": _max_diff(rows), "too_noisy": _noisy(rows),
                           "methods": {}}
    for m in METHOD_ORDER:
        mine = [r for r in rows if r["method"] == m]
        if not mine:
            continue
        r = mine[0]
        per_backend = {}
        for x in mine:
            if x["status"] == "ok" and x["latency_ms_median"] is not None:
                per_backend[x["backend"]] = {"latency_ms": x["latency_ms_median"], **{
                    k: v for k, v in _interval(x).items() if k != "detectable_effect"},
                    "finding": finding(x["verdict"], bool(x["too_noisy"]))}
        out["methods"][m] = {
            "backends": per_backend,
            "improvement_vs_tf": _vs_tf(ok, m) if m not in ("original", AA) else None,
            "nodes": r["nodes"], "cost_ms": r["cost_ms"],
            "same_as_original": _same(r.get("same_as_original")),
            "estimate_ms": _estimate(traces, m, "searched"), "original_estimate_ms": _estimate(traces, m, "initial"),
            "platform": dict(p) if (p := (platforms or {}).get(m)) else None,
            **{k: r[k] for k in ("optimisation_s", "training_s", "real_interactions", "rules_applied",
                                 "speed_check")},
        }
    return out


def _same(v) -> bool | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else bool(v)


def _estimate(traces: Mapping[str, TraceSummary] | None, method: str, which: str) -> float | None:
    """The runtime estimate of a method's trace: ``searched`` (the graph it found) or ``initial`` (the original)."""
    t = (traces or {}).get(method)
    costs = getattr(t, which, None) if t is not None else None
    return None if not costs else _num(costs.get("runtime_ms"))


def summary_lines(rows: Sequence[Mapping[str, Any]], backends: Sequence[str]) -> list[str]:
    """A compact text table for the log: per method and backend the median latency (ms) and the ratio to the
    original with its interval and finding."""
    lines = []
    noisy = _noisy(rows)
    for b in backends:
        lines.append(f"{b}:" + ("  TOO NOISY (the A/A control's interval excludes 1.0): no verdict is a finding"
                                if noisy.get(b) else ""))
        for r in rows:
            if r["backend"] != b:
                continue
            if r["latency_ms_median"] is None:
                lines.append(f"  {r['method']:<15} {r['status']}")
            elif r["ci_low"] is None:
                lines.append(f"  {r['method']:<15}{r['latency_ms_median']:>10.3f} ms")
            else:
                lines.append(f"  {r['method']:<15}{r['latency_ms_median']:>10.3f} ms  ratio {r['ratio']:.3f} "
                             f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]  {finding(r['verdict'], r['too_noisy'])}")
    return lines
