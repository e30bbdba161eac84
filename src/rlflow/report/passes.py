"""The XLA pass-ordering section of a model's report and its line in the summary (self-contained: it reads
``results/<model>/xla/passes.json`` of stage evaluate_passes itself, and nothing else of the report).

Section: one row per method (XLA's default pipeline, random orders, greedy, each PPO agent): final HLO op count,
reduction from the initial module, the paper's ratio (ops_0 - ops_method) / (ops_0 - ops_default), the passes run.
When evaluate_passes has not run for the model, the section says so. Summary line: per method, the geometric
mean of that ratio over every model with a passes.json (held-out models marked).
"""

from __future__ import annotations

from pathlib import Path

from rlflow.report import html as h
from rlflow.report.data import Input, read_json
from rlflow.xla.metric import geomean_ratio

SECTION_ID, TITLE = "xla-passes", "XLA pass ordering: HLO op counts per method"
STAGE = "evaluate_passes"


def passes_file(results: Path) -> Path:
    """A model's evaluate_passes output in its results folder (``results/<model>``)."""
    return Path(results) / "xla" / "passes.json"


def _methods(inp: Input) -> list[dict]:
    methods = (inp.data or {}).get("methods")
    if not isinstance(methods, list) or not all(isinstance(m, dict) and "method" in m for m in methods):
        raise inp.damaged("has no list of methods")
    return methods


def section(d) -> tuple[str, str, str]:
    """The report section of ``d`` (a :class:`rlflow.report.data.ReportData`; only ``d.results`` is read)."""
    inp = read_json(passes_file(d.results), STAGE)
    if not inp.ok:
        return SECTION_ID, TITLE, h.missing(inp.why() + " Build it with `snakemake xla --cores 2`.")
    doc, methods = inp.data, _methods(inp)
    ops0 = doc.get("initial_ops")
    rows = [(m["method"], h.count(m.get("ops")), h.count(m.get("reduction")), h.num(m.get("ratio_vs_default")),
             ", ".join(map(str, m.get("passes") or [])) or h.DASH) for m in methods]
    held = "held out (not trained on)" if doc.get("held_out") else "one of the training models"
    parts = [h.p(f"The model's HLO module (JAX lowering, weights included) has {h.count(ops0)} ops; this model is "
                 f"{held} (training models: {', '.join(doc.get('train_models') or []) or h.DASH}). Ratio: the "
                 "paper's (ops_0 - ops_method) / (ops_0 - ops_default): 1 matches XLA's default pipeline, above "
                 "1 beats it. Random: the mean of several uniform orders. Every pass is a real XLA compile."),
             h.table(["method", "ops", "reduction", "ratio vs XLA default", "passes run"], rows)]
    return SECTION_ID, TITLE, "".join(parts)


def geomean_by_method(results_root: Path, models: list[str]) -> tuple[dict[str, float | None], list[str], list[str]]:
    """(method -> the paper's geometric-mean ratio over the models with a passes.json, those models, the
    held-out ones among them)."""
    ratios: dict[str, list] = {}
    have, held = [], []
    for model in models:
        inp = read_json(passes_file(Path(results_root) / model), STAGE)
        if not inp.ok:
            continue
        have.append(model)
        if inp.data.get("held_out"):
            held.append(model)
        for m in _methods(inp):
            ratios.setdefault(m["method"], []).append(m.get("ratio_vs_default"))
    return {k: geomean_ratio(v) for k, v in ratios.items()}, have, held


def summary_line(results_root: Path, models: list[str]) -> str:
    """One paragraph for the summary page: the geometric-mean ratio per method, or that no model has one."""
    means, have, held = geomean_by_method(results_root, models)
    if not have:
        return h.missing("XLA pass ordering: no model has results/<model>/xla/passes.json yet (stage "
                         "evaluate_passes; `snakemake xla --cores 2`).")
    figures = "; ".join(f"{k} {h.num(v)}" for k, v in means.items() if k != "xla_default")
    return h.p(f"XLA pass ordering ({len(have)} models: {', '.join(have)}; held out: {', '.join(held) or 'none'}): "
               f"geometric mean of the op-count reduction ratio vs XLA's default pipeline: {figures}.")
