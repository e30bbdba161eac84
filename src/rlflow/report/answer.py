"""The report's first section, "The answer": per track (the methods that optimised for one cost target), the
best method and its figure, a compact table of every method that changed the graph, and one line per method
whose graph is the original. Everything comes from the :class:`rlflow.report.headline.Headline`; the helpers
here (:func:`own_rows`, :func:`same_lines`) let the other sections leave such methods out the same way.
"""

from __future__ import annotations

from rlflow.report import html as h
from rlflow.report.data import ReportData
from rlflow.report.headline import MACHINE, Headline, Track, backend_label, track_sentences

TITLE = "The answer: what each method found"


def own_rows(d: ReportData, hl: Headline) -> list[dict]:
    """The evaluation rows less those of methods whose graph is the original (their figures are the A/A
    control's comparison, not theirs: :func:`same_lines` says so in one line each)."""
    return [r for r in d.evaluation if not hl.same_as_original(r["method"])]


def same_lines(hl: Headline) -> str:
    """One line per method whose graph is the original (empty when there is none)."""
    same = [m for m in hl.methods if m.same_as_original]
    if not same:
        return ""
    return h.p("No row of its own (its figures would be the A/A control's):") + h.ul([m.one_line() for m in same])


def _ratio(v: float | None) -> str:
    return h.DASH if v is None else f"{v:.3f}"


def track_table(t: Track, backends: tuple[str, ...]) -> str:
    """The compact table of a track: each method that changed the graph, its estimate against the original's
    and TASO's on the track's target, and its verified ratio [95% CI] and verdict on each backend; the method
    the track's answer names is in bold."""
    lead = t.best_estimate if t.kind != MACHINE else (t.best.get(t.lead_backend) or t.best_estimate)
    head = ["method", f"estimate / original's ({t.platform.label})", "estimate / TASO's",
            *(f"{backend_label(b)}{' (verifies)' if b == t.lead_backend else ''}: ratio [95% CI], verdict"
              for b in backends)]
    body = []
    for m in t.changed:
        name = h.Raw(f"<strong>{h.esc(m.label)}</strong>") if m.method == lead else m.label
        body.append((name, _ratio(m.estimate_ratio), _ratio(m.vs_taso),
                     *(m.cells[b].text() if b in m.cells else h.DASH for b in backends)))
    if not body:
        return ""
    return h.table(head, body, f"{t.platform.target}: the original's estimate "
                               f"{h.num(t.original_estimate_ms, 4)} ms; ratios below 1: faster or cheaper",
                   cls="left1")


def build(d: ReportData, hl: Headline) -> str:
    parts = [h.p(f"What this run found for '{d.model}'. A track is the group of methods that optimised for one cost "
                 "target: on a simulated target (a GPU this machine does not have) the answer is the cost model's "
                 "estimate, beside what the graphs do on this machine's backends; on this machine's own target it "
                 "is the verified end-to-end latency ratio to the original with its 95% interval (the measurement "
                 "protocol). A method whose graph is the original found nothing to show: it is one line, not a "
                 "row.")]
    if not hl.tracks:
        parts.append(h.missing("No optimised method was evaluated: evaluation.csv has rows for the original only."))
        return "".join(parts)
    if hl.noisy:
        parts.append(h.missing("TOO NOISY on " + ", ".join(backend_label(b) for b in hl.noisy) + ": the A/A "
                               "control failed there, so no verdict on it is a finding."))
    for t in hl.tracks:
        parts.append(f"<h3>{h.esc(t.title)}</h3>")
        parts.append(h.ul(track_sentences(t, hl.noisy, nothing=False)))
        parts.append(track_table(t, hl.backends))
        if t.found_nothing:
            parts.append(h.ul([m.one_line() for m in t.found_nothing]))
    return "".join(parts)
