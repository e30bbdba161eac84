"""The table across models: one row per (model, method) from each evaluate job's headline file
``results/summary/<model>.json`` (format ``rlflow.evaluation-headline/1``, written by
:func:`rlflow.evaluation.tables.headline`), as CSV and as a self-contained HTML page linking each model's report.

Keys are read tolerantly: a missing one is an empty cell. A headline that is not a JSON object with a ``methods``
mapping is a one-line :class:`RLFlowError` naming the file.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from rlflow.errors import RLFlowError
from rlflow.report import html as h
from rlflow.report import passes as xla_passes
from rlflow.report.data import METHOD_LABEL, METHOD_ORDER
from rlflow.report.tables import ordered

#: the CSV's columns: (column, headline key(s) tried in turn)
COLUMNS = (
    ("model", ()), ("device", ()), ("method", ()),
    ("best_backend", ("best_backend",)),
    ("latency_ms", ("latency_ms",)),
    ("speedup_vs_original_ort", ("speedup_ort", "speedup_vs_original_ort")),
    ("improvement_vs_tf_pct", ("improvement_vs_tf_pct",)),
    ("optimisation_s", ("optimisation_s",)),
    ("training_s", ("training_s",)),
    ("real_interactions", ("real_interactions",)),
    ("rules_applied", ("rules_applied",)),
)


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


def summary_rows(headlines: list[dict]) -> list[dict[str, Any]]:
    """One dict per (model, method) with the keys of :data:`COLUMNS` (None where the headline lacks it)."""
    rows = []
    for doc in headlines:
        methods = doc["methods"]
        for m in ordered(methods, METHOD_ORDER):
            entry = methods[m] if isinstance(methods[m], dict) else {}
            row: dict[str, Any] = {"model": str(doc["model"]), "device": doc.get("device"), "method": m}
            for col, keys in COLUMNS[3:]:
                row[col] = next((entry[k] for k in keys if entry.get(k) is not None), None)
            rows.append(row)
    return rows


def _csv_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) < 1e15 else format(v, ".6g")
    return str(v)


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([c for c, _ in COLUMNS])
    for r in rows:
        w.writerow([_csv_cell(r[c]) for c, _ in COLUMNS])
    return buf.getvalue()


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else h.DASH


def to_html(rows: list[dict], headlines: list[dict], out: Path, headline_dir: Path,
            missing_models: list[str]) -> str:
    """The summary page; each model name links to ``<results>/<model>/report.html`` relative to ``out``."""
    results = Path(headline_dir).parent
    links = {}
    for doc in headlines:
        report = results / str(doc["model"]) / "report.html"
        rel = os.path.relpath(report, Path(out).parent).replace(os.sep, "/")
        links[str(doc["model"])] = h.Raw(f'<a href="{h.esc(rel)}">{h.esc(doc["model"])}</a>')
    body_rows = []
    for r in rows:
        body_rows.append((links.get(r["model"], r["model"]), r["device"] or h.DASH, METHOD_LABEL.get(r["method"], r["method"]),
                          r["best_backend"] or h.DASH, _num(r["latency_ms"], ".3f"),
                          _num(r["speedup_vs_original_ort"], ".3f") + ("x" if r["speedup_vs_original_ort"] is not None else ""),
                          h.pct(r["improvement_vs_tf_pct"]), _num(r["optimisation_s"], ".2f"),
                          h.count(r["real_interactions"]), h.count(r["rules_applied"])))
    parts = [h.p("One row per model and method, from each model's evaluation (results/summary/<model>.json). "
                 "Best latency: the median on the backend where the method's graph ran fastest. Speedup: the "
                 "original's latency over the optimised graph's, both on onnxruntime (the rewrite alone). "
                 "Improvement vs TF: how much faster than TensorFlow runs the original graph, in percent (RLFlow's "
                 "Table 2). Real interactions: steps in the real rewrite environment (RL agents only). Click a "
                 "model for its full report."),
             h.table(["model", "device", "method", "best backend", "best latency (ms)", "speedup vs original (ort)",
                      "improvement vs TF", "optimisation (s)", "real interactions", "rules applied"], body_rows,
                     cls="left4")]
    if missing_models:
        parts.append(h.missing("Not evaluated yet (no headline file): " + ", ".join(missing_models) + "."))
    parts.append(xla_passes.summary_line(results, [str(d["model"]) for d in headlines] + list(missing_models)))
    return h.page("RLFlow summary: every model evaluated", "", [], "".join(parts))
