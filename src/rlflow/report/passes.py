"""The XLA pass-ordering section of a model's report and its line in the summary (self-contained: it reads
``results/<model>/xla/passes.json`` of stage evaluate_passes itself, and nothing else of the report).

Section: one row per method (XLA's default pipeline, random orders, greedy, each PPO agent): final HLO op count,
reduction from the initial module, the paper's ratio (ops_0 - ops_method) / (ops_0 - ops_default), the module's
XLA CPU latency ratio to the default pipeline's with its interval and verdict (issue G's protocol, A/A control
included; "too noisy" when that control fails), the passes run.
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
    runtime = doc.get("runtime") or {}
    noisy = bool(runtime.get("too_noisy"))
    rows = [(m["method"], h.count(m.get("ops")), h.count(m.get("reduction")), h.num(m.get("ratio_vs_default")),
             *_runtime_cells(m.get("runtime"), noisy), ", ".join(map(str, m.get("passes") or [])) or h.DASH)
            for m in methods]
    held = "held out (not trained on)" if doc.get("held_out") else "one of the training models"
    parts = [h.p(f"The model's HLO module (the JAX lowering of its ONNX graph) has {h.count(ops0)} ops; this model is "
                 f"{held} (training models: {', '.join(doc.get('train_models') or []) or h.DASH}). Ratio: the "
                 "paper's (ops_0 - ops_method) / (ops_0 - ops_default): 1 matches XLA's default pipeline, above "
                 "1 beats it. Random: the mean of several uniform orders. Every pass is a real XLA compile."),
             h.table(["method", "ops", "reduction", "ratio vs XLA default", "XLA CPU ms (median)",
                      "latency vs XLA default [95%]", "verdict", "passes run"], rows)]
    if runtime:
        aa = runtime.get("aa") or {}
        parts.append(h.p(
            "Runtime: each module compiled by XLA's CPU compiler with the passes an agent chooses from switched "
            f"off ({len(runtime.get('disabled_passes') or [])} passes; legalisation, layout, fusion and code "
            f"generation as usual), outputs checked against the default module's, and timed: "
            f"{runtime.get('protocol', h.DASH)}. A/A control (the default module against itself): "
            f"{_interval(aa)} ({aa.get('verdict', h.DASH)}). Random orders have no module of their own."))
        if noisy:
            parts.append(h.missing("TOO NOISY: the A/A control's interval excludes 1.0, so no runtime verdict "
                                   "above is a finding."))
    else:
        parts.append(h.missing("Runtime not measured (xla.time_modules is off)."))
    return SECTION_ID, TITLE, "".join(parts)


def _interval(r: dict) -> str:
    if r.get("ci_low") is None:
        return h.DASH
    return f"{r['ratio']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"


def _runtime_cells(r: dict | None, noisy: bool) -> tuple[str, str, str]:
    if not r:
        return h.DASH, h.DASH, h.DASH
    verdict = r.get("verdict", h.DASH)
    if r.get("same_as"):  # the agent's final module is the default's own: not timed again
        return h.num(r.get("median_ms")), h.DASH, f"the {r['same_as']} module itself"
    return h.num(r.get("median_ms")), _interval(r), ("too noisy" if noisy and verdict != "reference" else verdict)


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


SUITE_STAGE = "evaluate_passes_suite"


def suite_file(results_root: Path) -> Path:
    """evaluate_passes_suite's output under the results root."""
    return Path(results_root) / "xla-suite" / "passes.json"


def suite_summary(results_root: Path) -> str:
    """The summary page's table of the HLO suite's held-out modules: per method, the paper's geometric-mean
    ratio, the modules it covers and the XLA CPU verdicts against the default pipeline's module; or one line
    saying the stage has not run."""
    inp = read_json(suite_file(results_root), SUITE_STAGE)
    if not inp.ok:
        return h.missing(inp.why() + " (the HLO suite's held-out modules; `snakemake xla --cores 2`).")
    doc = inp.data
    summary = doc.get("summary")
    modules = doc.get("modules")
    if not isinstance(summary, dict) or not isinstance(modules, list):
        raise inp.damaged("has no summary or module list")
    rows = []
    for method, s in summary.items():
        verdicts = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted((s.get("verdicts") or {}).items()))
        rows.append((method, h.num(s.get("geomean_ratio")), h.count(s.get("modules_with_ratio")),
                     h.count(s.get("no_ratio")), verdicts or h.DASH))
    trained = "the suite's training split" if doc.get("train_on") == "suite" else "the training models"
    return h.p(f"XLA pass ordering on the HLO suite's {len(modules)} held-out modules (families "
               f"{', '.join(doc.get('families') or []) or h.DASH}; the agents trained on {trained}, never on these "
               "families). Ratio: the paper's (ops_0 - ops_method) / (ops_0 - ops_default), its geometric mean "
               "over the modules where XLA's default pipeline removes ops (the others have none). Verdicts: each "
               "module's XLA CPU latency against the default pipeline's module with the protocol (an agent's "
               "module chosen by latency, the default's always a candidate; 'too noisy' where that module's A/A "
               "control failed). The paper (Ganapathy et al.) reports its averages on GPT-2 training graphs and a "
               "300+ graph suite; its stored text has lost the figures, so none is set beside these.") + \
        h.table(["method", "geometric-mean ratio vs XLA default", "modules with a ratio", "modules without",
                 "XLA CPU verdicts vs the default (modules)"], rows)
