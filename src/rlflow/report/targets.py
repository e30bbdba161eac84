"""Report section "Estimate on the cost target vs end to end" (issue 13, item 4): per method, what the searches
and agents optimised (the estimate on the run's cost target, ``cost_ms`` of ``evaluation.csv``) beside what the
graph measured end to end on each local backend under the measurement protocol (the latency ratio to the original
with its 95% interval and the verdict, issue G), side by side; and X-RLflow's estimate-vs-E2E
line for the model. A simulated target (``sim-*``) is labelled "simulated <GPU>": no GPU ran it, and its
estimate is not comparable in milliseconds with the CPU latencies, only in direction."""

from __future__ import annotations

from rlflow.report import html as h
from rlflow.report import paper
from rlflow.report.answer import same_lines
from rlflow.report.data import BACKEND_LABEL, METHOD_LABEL, ReportData
from rlflow.report.headline import Headline
from rlflow.report.tables import backends, finding, methods, ok_cell


def target_label(d: ReportData) -> tuple[str, str]:
    """(target, label) the run's cost estimates were made on: from a method's trace, else the config."""
    for inp in d.traces.values():
        cost = (inp.data or {}).get("cost") if inp.ok else None
        if isinstance(cost, dict) and cost.get("label"):
            return str(cost.get("target") or cost.get("model") or "?"), str(cost["label"])
    cost = d.config.get("cost") or {}
    target = str(cost.get("model") or cost.get("target") or "?")
    return target, (f"simulated {target[4:].upper()}" if target.startswith("sim-") else target)


def rows(d: ReportData) -> list[dict]:
    """Per method with a cost estimate: the estimate of the graph the method found (its trace's final cost, else
    ``cost_ms`` of ``evaluation.csv``) and its ratio to the original's; the stage's never-slower check of that
    graph (``check``: the trace's ``speed_check``, or None); and per backend, for the graph evaluate measured (the
    found graph, or the original where the check kept it), the median end-to-end latency, the protocol's latency
    ratio to the original with its 95% interval (``ci``: (low, high) or None) and the verdict
    (:func:`rlflow.report.tables.finding`). Ratios are None where a figure is missing."""
    bs = backends(d.evaluation)
    orig_cost = next((r["cost_ms"] for r in d.evaluation if r["method"] == "original" and r["cost_ms"]), None)
    out = []
    for m in methods(d.evaluation):
        tr = d.traces.get(m)
        trace = tr.data if tr is not None and tr.ok and isinstance(tr.data, dict) else {}
        final = (trace.get("final") or {}).get("runtime_ms") if isinstance(trace.get("final"), dict) else None
        cost = final if isinstance(final, (int, float)) else next(
            (r["cost_ms"] for r in d.evaluation if r["method"] == m and r["cost_ms"] is not None), None)
        check = trace.get("speed_check") if isinstance(trace.get("speed_check"), dict) else None
        cells = {b: ok_cell(d.evaluation, m, b) or {} for b in bs}
        ci = {b: (c["ci_low"], c["ci_high"]) if c.get("ci_low") is not None and c.get("ci_high") is not None
              else None for b, c in cells.items()}
        out.append({"method": m, "cost_ms": cost, "cost_ratio": cost / orig_cost if cost and orig_cost else None,
                    "check": check, "e2e_ms": {b: c.get("latency_ms_median") for b, c in cells.items()},
                    "e2e_ratio": {b: c.get("ratio") for b, c in cells.items()}, "ci": ci,
                    "verdict": {b: finding(c) if c else "" for b, c in cells.items()}})
    return out


def _ratio(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _verdict(r: dict, b: str, hl: Headline) -> str:
    """``0.960 [0.950, 0.970] faster``: the protocol's ratio, interval and verdict on backend ``b`` (the
    headline's)."""
    if r["e2e_ratio"][b] is None:
        return "n/a"
    if r["method"] == "original":
        return "1 (reference)"
    m = hl.method(r["method"])
    if m is not None and b in m.cells:
        return m.cells[b].text()
    ci = r["ci"][b]
    return f"{r['e2e_ratio'][b]:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "") + \
        (f" {r['verdict'][b]}" if r["verdict"][b] else "")


def _check(c: dict | None) -> str:
    """The never-slower check of the found graph: ``1.097 [1.012, 1.189] slower on ort; kept the original``."""
    if not c or not isinstance(c.get("ratio"), (int, float)):
        return h.DASH
    ci = f" [{c['ci_low']:.3f}, {c['ci_high']:.3f}]" if isinstance(c.get("ci_low"), (int, float)) and \
        isinstance(c.get("ci_high"), (int, float)) else ""
    kept = "kept the original" if c.get("kept") == "original" else "kept"
    return f"{c['ratio']:.3f}{ci} {c.get('verdict', '')} on {BACKEND_LABEL.get(c.get('backend'), c.get('backend'))}; {kept}"


def section(d: ReportData, hl: Headline) -> str:
    target, label = target_label(d)
    simulated = target.startswith("sim-")
    parts = [h.p(f"What each method found -- the estimate of its graph on the cost target ({label}) -- beside "
                 "what that graph did end to end: its stage's never-slower check (the found graph against the "
                 "original under the measurement protocol; a graph not significantly faster is replaced by the "
                 "original), then the graph evaluate measured on each local backend (the found graph, or the "
                 "original where the check kept it), with the protocol's latency ratio to the original, its 95% "
                 "interval and verdict. Ratios are to the original graph (< 1: lower). "
                 + ("The target is a simulated GPU: no GPU ran it, so compare directions, not milliseconds."
                    if simulated else ""))]
    rs = [r for r in rows(d) if not hl.same_as_original(r["method"])]
    bs = backends(d.evaluation)
    if not any(r["cost_ms"] is not None for r in rs):
        parts.append(h.missing("No row of evaluation.csv has a cost estimate."))
    else:
        head = ["method", f"estimate, {label} (ms)", "estimate ratio", "found graph end to end (never-slower check)"]
        for b in bs:
            head += [f"{BACKEND_LABEL.get(b, b)} E2E (ms)", f"{BACKEND_LABEL.get(b, b)} ratio [95% CI], verdict (graph evaluated)"]
        body = []
        for r in rs:
            cells = [METHOD_LABEL.get(r["method"], r["method"]), h.num(r["cost_ms"], 4), _ratio(r["cost_ratio"]),
                     _check(r["check"])]
            for b in bs:
                cells += [h.num(r["e2e_ms"][b]), _verdict(r, b, hl)]
            body.append(cells)
        parts.append(h.table(head, body, f"This run (cost target {target})", cls="left1"))
        parts.append(same_lines(hl))
    xm = paper.X_RLFLOW_MODEL.get(d.model)
    if xm:
        a, b, pct = paper.X_RLFLOW_COST_DISCREPANCY[xm]
        line = (f"{paper.X_RLFLOW_COST_SOURCE}, {xm}: cost model {a:.4f} ms, end to end {b:.4f} ms, difference "
                f"{pct:.1f}%.")
        orig = next((r for r in rs if r["method"] == "original"), None)
        if orig and orig["cost_ms"] and not simulated:
            ours = [f"{BACKEND_LABEL.get(k, k)} {abs(v - orig['cost_ms']) / orig['cost_ms'] * 100:.1f}%"
                    for k, v in orig["e2e_ms"].items() if v]
            if ours:
                line += f" This run, the original graph on {label}: " + ", ".join(ours) + "."
        parts.append(h.paper(line))
    else:
        parts.append(h.paper(f"{paper.X_RLFLOW} did not report this model's cost-model discrepancy."))
    return "".join(parts)
