"""The table across models: one row per (model, method, backend) from each evaluate job's headline file
``results/summary/<model>.json`` (format ``rlflow.evaluation-headline/2``, written by
:func:`rlflow.evaluation.tables.headline`), as CSV and as a self-contained HTML page linking each model's report.

The page leads with the answer per model and track (:mod:`rlflow.report.headline`: the best method and its
figure, which methods found nothing), then the table of every method whose graph is its own. Every comparison is on
one backend: a method's graph against the original graph on the same backend (the ratio, its 95% interval and the
verdict, or ``too noisy`` where that backend's A/A control failed). There is no "best backend" column: picking each
method's fastest backend would compare different executors and reward noise.

The CSV keeps every method's rows; a method whose graph is the original (``same_as_original``) has the A/A
control's figures -- that is its comparison -- and its ``note`` says so.

Keys are read tolerantly: a missing one is an empty cell. A headline that is not a JSON object with a ``methods``
mapping is a one-line :class:`RLFlowError` naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pandas as pd

from rlflow.errors import RLFlowError
from rlflow.report import html as h
from rlflow.report import passes as xla_passes
from rlflow.report.headline import MACHINE, Headline, from_evaluation_headline, method_label, track_sentences
from rlflow.report.data import AA, BACKEND_LABEL, BACKEND_ORDER, METHOD_ORDER
from rlflow.report.tables import ordered

#: the CSV's columns
COLUMNS = ("model", "device", "method", "target", "backend", "latency_ms", "ratio", "ci_low", "ci_high", "finding",
           "optimisation_s", "training_s", "real_interactions", "rules_applied", "speed_check", "same_as_original",
           "note")
#: the note on a row of a method whose graph is the original
SAME_NOTE = "graph is the original: these are the A/A control's figures"
_PER_METHOD = ("optimisation_s", "training_s", "real_interactions", "rules_applied", "speed_check")
_PER_BACKEND = ("latency_ms", "ratio", "ci_low", "ci_high", "finding")


def read_headlines(folder: Path, models: list[str] | None = None) -> list[dict]:
    """Every ``<model>.json`` in ``folder``: the models of ``models`` (the config's order) first, then any other
    model that was run, by name."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RLFlowError(f"{folder}: headline folder not found (run stage evaluate first)")
    files = {p.stem: p for p in folder.glob("*.json") if p.is_file()}
    if not files:
        raise RLFlowError(f"{folder}: no <model>.json headline files (run stage evaluate first)")
    docs = []
    for name in ordered(files, list(models or [])):
        p = files[name]
        try:
            doc = json.loads(p.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RLFlowError(f"{p}: not a valid JSON headline ({e.__class__.__name__})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("methods"), dict):
            raise RLFlowError(f"{p}: a headline must be a JSON object with a 'methods' mapping")
        doc.setdefault("model", name)
        docs.append(doc)
    return docs


def model_headlines(headlines: list[dict], default: dict | None = None) -> list[Headline]:
    """Each model's :class:`rlflow.report.headline.Headline` (``default``: the platform of a method whose entry
    names none)."""
    return [from_evaluation_headline(doc, default) for doc in headlines]


def summary_rows(headlines: list[dict], default: dict | None = None) -> pd.DataFrame:
    """One row per (model, method, backend) with :data:`COLUMNS` (NaN / None where the headline lacks it)."""
    rows = []
    for doc, hl in zip(headlines, model_headlines(headlines, default)):
        methods = doc["methods"]
        target = {m.method: t.platform.target for t in hl.tracks for m in t.methods}
        for m in ordered(methods, METHOD_ORDER):
            entry = methods[m] if isinstance(methods[m], dict) else {}
            per = entry.get("backends") if isinstance(entry.get("backends"), dict) else {}
            same = m in ("original", AA) or hl.same_as_original(m)
            for b in ordered(per, BACKEND_ORDER):
                cell = per[b] if isinstance(per[b], dict) else {}
                rows.append({"model": str(doc["model"]), "device": doc.get("device"), "method": m,
                             "target": target.get(m), "backend": b,
                             **{k: cell.get(k) for k in _PER_BACKEND}, **{k: entry.get(k) for k in _PER_METHOD},
                             "same_as_original": same,
                             "note": SAME_NOTE if same and m not in ("original", AA) else None})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def to_csv(rows: pd.DataFrame) -> str:
    out = rows.copy()
    for c in ("real_interactions", "rules_applied"):
        out[c] = pd.to_numeric(out[c], errors="coerce").round().astype("Int64")
    return out.to_csv(index=False, float_format="%.6g", lineterminator="\n")


def _num(v: Any, fmt: str) -> str:
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        return h.DASH
    return format(v, fmt)


def _value(v: Any) -> float | None:
    """A DataFrame cell as a number, or None (missing: None or NaN)."""
    return None if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or v != v else v


def _text(v: Any) -> str:
    """A text cell: a dash for a missing one (None, or NaN from the frame)."""
    return h.DASH if v is None or (isinstance(v, float) and v != v) or v == "" else str(v)


def _ratio(r) -> str:
    if _num(r["ci_low"], ".3f") == h.DASH:
        return _num(r["ratio"], ".3f")
    return f"{r['ratio']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"


def _lead(headlines: list[Headline], links: dict) -> str:
    """The answer across models: per model and track, the best method and its figure and what found nothing
    (a compact table), then each track's sentences."""
    body, notes = [], []
    for hl in headlines:
        for t in hl.tracks:
            if t.kind == MACHINE:
                k = t.lead_backend if t.lead_backend in t.best else next((b for b in t.best if t.best[b]), None)
                best = t.method(t.best[k]) if k is not None and t.best.get(k) else None
                figure = f"{BACKEND_LABEL.get(k, k)} {best.cells[k].text()}" if best else (
                    f"none verified faster on {BACKEND_LABEL.get(k, k)}" if k else h.DASH)
            else:
                best = t.method(t.best_estimate) if t.best_estimate else None
                figure = (f"estimate {best.estimate_ratio:.3f} of the original's"
                          + (f", {best.vs_taso:.3f} of TASO's" if best.vs_taso is not None else "")
                          if best and best.estimate_ratio is not None else "no method lowered the estimate")
            track = f"{t.platform.label} ({t.platform.target}), " + (
                f"verified on {BACKEND_LABEL.get(t.lead_backend, t.lead_backend)}" if t.kind == MACHINE
                else "not verifiable here")
            body.append((links.get(hl.model, hl.model), track, best.label if best else h.DASH, figure,
                         ", ".join(m.label for m in t.found_nothing) or h.DASH))
            notes.append(f"{hl.model}, {t.platform.label}: " + " ".join(track_sentences(t, hl.noisy)))
    if not body:
        return h.missing("No model has an optimised method evaluated yet.")
    return (h.table(["model", "track (cost target)", "best method", "its figure", "found nothing (graph is the "
                     "original)"], body, "The answer per model and track", cls="left4")
            + h.ul(notes))


def to_html(rows: pd.DataFrame, headlines: list[dict], out: Path, headline_dir: Path,
            missing_models: list[str], default: dict | None = None) -> str:
    """The summary page; each model name links to ``<results>/<model>/report.html`` relative to ``out``. It leads
    with the answer per model and track; the table below has the rows of every method whose graph is its own
    (a method whose graph is the original is named in the answer instead)."""
    results = Path(headline_dir).parent
    links = {}
    for doc in headlines:
        report = results / str(doc["model"]) / "report.html"
        rel = os.path.relpath(report, Path(out).parent).replace(os.sep, "/")
        links[str(doc["model"])] = h.Raw(f'<a href="{h.esc(rel)}">{h.esc(doc["model"])}</a>')
    body_rows = []
    for _, r in rows.iterrows():
        if r["method"] == AA or (r["method"] != "original" and bool(r["same_as_original"])):
            continue
        ref = r["method"] == "original"
        body_rows.append((links.get(r["model"], r["model"]), _text(r["device"]), method_label(r["method"]),
                          _text(r["target"]), BACKEND_LABEL.get(r["backend"], r["backend"]),
                          _num(r["latency_ms"], ".3f"), h.DASH if ref else _ratio(r),
                          "reference" if ref else _text(r["finding"]),
                          _num(r["optimisation_s"], ".2f"), h.count(_value(r["real_interactions"])),
                          h.count(_value(r["rules_applied"])), h.DASH if ref else _text(r["speed_check"])))
    parts = [h.section("answer", "The answer per model", _lead(model_headlines(headlines, default), links)),
             h.p("One row per model, method and backend, from each model's evaluation (results/summary/<model>.json)."
                 " Every comparison is on one backend: the method's graph against the original graph on the same "
                 "backend, as the ratio of latencies (below 1: faster) with its 95% interval and the verdict; "
                 "'too noisy' where that backend's A/A control failed (no finding). Improvement vs TF is the "
                 "TensorFlow rows' ratio (RLFlow's Table 2 compares against TensorFlow running the original). "
                 "Real interactions: steps in the real rewrite environment (RL agents only). Rules applied: rewrites "
                 "on the path to the method's graph (none for equality saturation, which extracts its graph from an "
                 "e-graph). Never-slower check: "
                 "whether the method's stage kept its graph or the original. The A/A control and the methods "
                 "whose graph is the original have no rows here (the answer above names them; summary.csv has "
                 "their rows, marked). Click a model for its full report."),
             h.table(["model", "device", "method", "target", "backend", "median latency (ms)",
                      "ratio to original [95%]", "verdict", "optimisation (s)", "real interactions", "rules applied",
                      "never-slower check"], body_rows, cls="left4")]
    if missing_models:
        parts.append(h.missing("Not evaluated yet (no headline file): " + ", ".join(missing_models) + "."))
    parts.append(xla_passes.summary_line(results, [str(d["model"]) for d in headlines] + list(missing_models)))
    parts.append(xla_passes.suite_summary(results))
    return h.page("RLFlow summary: every model evaluated", "", [], "".join(parts))
