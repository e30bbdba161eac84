"""The table across models: one row per (model, method, backend) from each evaluate job's headline file
``results/summary/<model>.json`` (format ``rlflow.evaluation-headline/2``, written by
:func:`rlflow.evaluation.tables.headline`), as CSV and as a self-contained HTML page linking each model's report.

Every comparison is on one backend: a method's graph against the original graph on the same backend (the ratio,
its 95% interval and the verdict, or ``too noisy`` where that backend's A/A control failed). There is no "best
backend" column: picking each method's fastest backend would compare different executors and reward noise.
"Improvement vs TF" is the ``tf`` rows' figure (the original on TensorFlow against the method on TensorFlow).

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
from rlflow.report.data import BACKEND_LABEL, BACKEND_ORDER, METHOD_LABEL, METHOD_ORDER
from rlflow.report.tables import ordered

#: the CSV's columns
COLUMNS = ("model", "device", "method", "backend", "latency_ms", "ratio", "ci_low", "ci_high", "finding",
           "optimisation_s", "training_s", "real_interactions", "rules_applied", "speed_check")
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


def summary_rows(headlines: list[dict]) -> pd.DataFrame:
    """One row per (model, method, backend) with :data:`COLUMNS` (NaN / None where the headline lacks it)."""
    rows = []
    for doc in headlines:
        methods = doc["methods"]
        for m in ordered(methods, METHOD_ORDER):
            entry = methods[m] if isinstance(methods[m], dict) else {}
            per = entry.get("backends") if isinstance(entry.get("backends"), dict) else {}
            for b in ordered(per, BACKEND_ORDER):
                cell = per[b] if isinstance(per[b], dict) else {}
                rows.append({"model": str(doc["model"]), "device": doc.get("device"), "method": m, "backend": b,
                             **{k: cell.get(k) for k in _PER_BACKEND}, **{k: entry.get(k) for k in _PER_METHOD}})
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


def _ratio(r) -> str:
    if _num(r["ci_low"], ".3f") == h.DASH:
        return _num(r["ratio"], ".3f")
    return f"{r['ratio']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"


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
    for _, r in rows.iterrows():
        body_rows.append((links.get(r["model"], r["model"]), r["device"] or h.DASH,
                          METHOD_LABEL.get(r["method"], r["method"]), BACKEND_LABEL.get(r["backend"], r["backend"]),
                          _num(r["latency_ms"], ".3f"), _ratio(r) if r["method"] != "original" else h.DASH,
                          (r["finding"] or h.DASH) if r["method"] != "original" else h.DASH,
                          _num(r["optimisation_s"], ".2f"), h.count(_value(r["real_interactions"])),
                          h.count(_value(r["rules_applied"])), r["speed_check"] or h.DASH))
    parts = [h.p("One row per model, method and backend, from each model's evaluation (results/summary/<model>.json)."
                 " Every comparison is on one backend: the method's graph against the original graph on the same "
                 "backend, as the ratio of latencies (below 1: faster) with its 95% interval and the verdict; "
                 "'too noisy' where that backend's A/A control failed (no finding). Improvement vs TF is the "
                 "TensorFlow rows' ratio (RLFlow's Table 2 compares against TensorFlow running the original). "
                 "Real interactions: steps in the real rewrite environment (RL agents only). Rules applied: rewrites "
                 "on the path to the method's graph (none for equality saturation, which extracts its graph from an "
                 "e-graph). Never-slower check: "
                 "whether the method's stage kept its graph or the original. Click a model for its full report."),
             h.table(["model", "device", "method", "backend", "median latency (ms)", "ratio to original [95%]",
                      "verdict", "optimisation (s)", "real interactions", "rules applied", "never-slower check"],
                     body_rows, cls="left4")]
    if missing_models:
        parts.append(h.missing("Not evaluated yet (no headline file): " + ", ".join(missing_models) + "."))
    parts.append(xla_passes.summary_line(results, [str(d["model"]) for d in headlines] + list(missing_models)))
    return h.page("RLFlow summary: every model evaluated", "", [], "".join(parts))
