"""Report section "How far from the limit" (issue G, item 5): each graph's measured latency on each backend
against its roofline lower bound at the device's calibrated GEMM rate and bandwidth
(:mod:`rlflow.evaluation.roofline`), and the share of the latency any rewrite could still win."""

from __future__ import annotations

from rlflow.report import html as h
from rlflow.report.data import AA, BACKEND_LABEL, METHOD_LABEL, ReportData
from rlflow.report.headline import Headline
from rlflow.report.tables import backends, method_value, methods, ok_cell


def limits(d: ReportData) -> dict | None:
    """The device figures of ``metrics.json``'s ``roofline`` section, or None."""
    doc = d.eval_metrics.data if d.eval_metrics.ok else None
    section = doc.get("roofline") if isinstance(doc, dict) else None
    return section if isinstance(section, dict) and section.get("gemm_gflops") else None


def section(d: ReportData, hl: Headline) -> str:
    """Each graph's latency against its roofline bound (the original once; a method whose graph is the original
    has no row of its own)."""
    lim = limits(d)
    ms = [m for m in methods(d.evaluation) if m != AA and not hl.same_as_original(m)
          and method_value(d.evaluation, m, "roofline_ms") is not None]
    if lim is None or not ms:
        return h.missing(
            "No roofline: the evaluation has no device calibration (it is measured on CPUs only; rerun stage "
            "evaluate after measure_costs).")
    bs = backends(d.evaluation)
    head = ["graph", "lower bound (ms)"]
    for b in bs:
        head += [f"{BACKEND_LABEL.get(b, b)} latency (ms)", f"{BACKEND_LABEL.get(b, b)} headroom"]
    body = []
    for m in ms:
        cells = [METHOD_LABEL.get(m, m), h.num(method_value(d.evaluation, m, "roofline_ms"), 2)]
        for b in bs:
            r = ok_cell(d.evaluation, m, b) or {}
            share = r.get("headroom")
            cells += [h.num(r.get("latency_ms_median"), 2), "n/a" if share is None else f"{share * 100:.0f}%"]
        body.append(cells)
    text = (f"The device's sustained figures, measured once and cached (the cost model uses them too): GEMM "
            f"{lim['gemm_gflops']:.0f} GFLOP/s, bandwidth {lim['bandwidth_gbps']:.0f} GB/s ({lim.get('source', '')}). "
            "A graph's lower bound is the larger of its flops at that GEMM rate and, at that bandwidth, the bytes "
            "any execution must move: its inputs, outputs and weights (intermediate tensors count nothing, as if "
            "perfectly fused). The headroom, 1 - bound / median latency, is the most any rewrite that keeps the "
            "arithmetic could still win on that backend; a small headroom means there is little to gain here.")
    return h.p(text) + h.table(head, body, "Latency against the roofline", cls="left1")
