"""A model's report: first its answer (what each method found, per track), then one section per table or figure
of the paper, this run's numbers beside the paper's.

:func:`render_report` turns :class:`rlflow.report.data.ReportData` into the HTML document. The sections are data
(:data:`SECTIONS`: id, title, build function, in order); each build function returns the section's body from the
loaded data and the :class:`rlflow.report.headline.Headline` (computed once: every verdict sentence reads it). A
section whose inputs are absent says so (``html.missing``) instead of failing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import yaml

from rlflow.graph.ops.attention import ATTENTION_OPSET, KERNELS
from rlflow.report import answer, figures, headline, paper
from rlflow.report import html as h
from rlflow.report import passes as xla_passes
from rlflow.report import tables as t
from rlflow.report import roofline
from rlflow.report import targets as cost_target
from rlflow.report.data import BACKEND_LABEL, METHOD_LABEL, METHOD_ORDER, ReportData, reported_config
from rlflow.report.headline import Headline


#: the methods that saturate an e-graph and extract from it (the e-graph section's columns; no Fig. 10 steps)
E_GRAPH_METHODS = ("eqsat", "eqsat_rl")


def _m(method: str) -> str:
    return METHOD_LABEL.get(method, method)


def _b(backend: str | None) -> str:
    return h.DASH if backend is None else BACKEND_LABEL.get(backend, backend)


def _kv(pairs, caption: str | None = None) -> str:
    return h.table(["key", "value"], [(k, h.auto(v)) for k, v in pairs], caption, cls="kv")


def _paper_model(model: str) -> str | None:
    return paper.RLFLOW_MODEL.get(model)


def _label(v) -> str:
    """A sweep value as written in the config (a temperature 1.0 stays 1.0)."""
    return str(v) if isinstance(v, (float, str)) else h.auto(v)


def _not_evaluated(d: ReportData) -> str:
    """A note naming the methods evaluation.csv has no row for (their stage or the evaluation did not run)."""
    absent = [m for m in METHOD_ORDER if m not in t.methods(d.evaluation)]
    if not absent:
        return ""
    return h.missing("Not evaluated: evaluation.csv has no row for " + ", ".join(_m(m) for m in absent) + ".")


# -- sections -------------------------------------------------------------------------------------------------
def how_to_read(d: ReportData, hl: Headline) -> str:
    body = (
        h.p(f"This page reproduces, for the model '{d.model}', the tables and figures of the RLFlow paper with the "
            "numbers of this pipeline run, read from the files under "
            f"{d.results}. Blue boxes quote the papers' own numbers (RLFlow, X-RLflow, TASO); they were measured on "
            "GPUs, so compare trends rather than absolute values. Orange boxes say where a stage has not run or "
            "an input is missing.")
        + h.ul([
            "The first section gives the answer: per track (the methods that optimised for one cost target) the "
            "best method and its figure, and the methods that found nothing (their graph is the original, so "
            "they have no figures of their own and appear as one line in every section, never as a row).",
            "Methods: 'original' is the exported graph; 'TASO search' is TASO's cost-based backtracking search; "
            "'greedy' applies the best cost-lowering rewrite until none is left; 'equality saturation' (Tensat's "
            "method) applies the same rules at every match at once to an e-graph, which holds every rewritten graph "
            "together, until it saturates or reaches a limit, then extracts the cheapest graph it holds under the "
            "same cost target with an integer linear program; 'model-free PPO' is a PPO agent "
            "trained on the real rewrite environment; 'RLFlow' is the controller trained only inside the learned "
            "world model (the 'dream') and then run once on the real environment.",
            "Backends: each graph is timed end to end on the backends of evaluate.backends: onnxruntime, torch (op "
            "by op), TensorFlow (a tf.function, Grappler on) and, where listed, TF-XLA (configs/paper.yaml; the "
            "quick default leaves it out). Latency is the median of the timed runs; the IQR shows their spread.",
            "Speed is only ever compared on the same backend, under one measurement protocol: every graph runs in "
            "several freshly built sessions, interleaved in rounds of random order; the ratio of its latency to "
            "the original's (paired round by round) comes with a 95% interval over the sessions and a verdict: "
            "faster or slower only when the whole interval is below or above 1, else 'no detectable "
            "difference'. 'Smallest detectable' is the change the comparison could have detected (80% power).",
            "The A/A control is the original graph exported and imported again, timed as a method of its own: it "
            "is the same computation, so its interval must contain 1. Where it does not, that backend's run is "
            "marked TOO NOISY and none of its verdicts is a finding.",
            "Improvement percentages are (baseline - value) / baseline x 100: positive means faster or smaller.",
            "The cost model is the estimate the searches and agents optimise (a sum of per-op costs); the "
            "'cost model vs end-to-end' section shows how far it is from measured latency.",
            "Real interactions count steps in the real rewrite environment (the expensive part in the paper); "
            "steps in the dream cost none.",
            "Everything here is computed from the result files at report time; nothing is typed in by hand "
            "except the papers' numbers, which are quoted with their source.",
        ]))
    return body


def _interval_pct(x: dict) -> str:
    """``+1.2% [-0.3%, +2.6%]`` from a row with pct, pct_low, pct_high."""
    if x["pct"] is None or x["pct_low"] is None:
        return h.DASH
    return f"{h.pct(x['pct'])} [{h.pct(x['pct_low'])}, {h.pct(x['pct_high'])}]"


def _ratio(r: dict | None) -> str:
    """``0.987 [0.975, 0.999]`` from an evaluation row."""
    if r is None or r.get("ratio") is None or r.get("ci_low") is None:
        return h.DASH
    return f"{r['ratio']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"


def _noise_note(hl: Headline) -> str:
    noisy = hl.noisy
    if not noisy:
        return ""
    return h.missing("TOO NOISY on " + ", ".join(_b(b) for b in noisy) + ": the A/A control (the original graph "
                     "re-exported, timed as its own method) got an interval that excludes 1, so the machine's noise "
                     "exceeded what the intervals account for; no verdict on " + ("that backend" if len(noisy) == 1
                                                                                 else "those backends")
                     + " is a finding. Rerun on a quieter machine or with a larger timing.budget_s.")


def table2(d: ReportData, hl: Headline) -> str:
    r = t.table2(answer.own_rows(d, hl))
    parts = [h.p("Each graph on TensorFlow (backend tf, Grappler on) against the original graph on TensorFlow, from "
                 "the same comparison: the effect of the rewrites alone, with its 95% interval and verdict. No "
                 "figure here compares different backends (the paper's Table 2 is GPU work: its numbers are quoted "
                 "beside ours, not comparable).")]
    if r["baseline_ms"] is None:
        parts.append(h.missing("No TensorFlow baseline: evaluation.csv has no 'ok' row for the original graph on "
                               "backend tf (TensorFlow not evaluated or unsupported), so the latency improvements "
                               "cannot be computed."))
    parts.append(_noise_note(hl))
    mem_label = ("peak memory on TensorFlow (MB)" if r["memory_kind"] == "peak"
                 else "activation memory, estimate (MB)")
    rows = [(_m(x["method"]), h.num(x["tf_ms"]), _interval_pct(x), x["finding"] or h.DASH, h.num(x["memory_mb"]),
             h.pct(x["memory_pct"])) for x in r["rows"]]
    parts.append(h.table(["graph", "TensorFlow latency (ms)", "latency improvement vs TF [95% interval]", "verdict",
                          mem_label, "memory improvement"],
                         rows, f"This run: improvement vs TensorFlow running the original, in inference latency "
                               f"and memory ({d.model})"))
    parts.append(answer.same_lines(hl))
    if (sentence := headline.backend_sentence(hl, "tf")):
        parts.append(h.p(sentence))
    parts.append(_not_evaluated(d))
    if r["memory_kind"] != "peak":
        parts.append(h.p("Memory: the backends reported no peak memory for every graph (they do on CUDA only), so "
                         "the column is the activation-memory estimate: the peak size of live intermediate tensors "
                         "when the graph runs node by node (the same for every backend)."))
    pm = _paper_model(d.model)
    prow = [(_bold(name == pm, name), h.pct(a), h.pct(b)) for name, (a, b) in paper.RLFLOW_TABLE2.items()]
    parts.append(h.paper(f"{paper.RLFLOW_TABLE2_SOURCE}: "
                         + (f"{pm}: inference {h.pct(paper.RLFLOW_TABLE2[pm][0])}, memory "
                            f"{h.pct(paper.RLFLOW_TABLE2[pm][1])}." if pm else
                            f"the paper has no row for '{d.model}'.")))
    parts.append(h.details("The paper's Table 2 (all models)",
                           h.table(["model", "inference improvement", "memory improvement"], prow)))
    return "".join(parts)


def _bold(bold: bool, text: str) -> str:
    """Bold a table cell (the row of this report's model in a paper's table)."""
    return h.Raw(f"<strong>{h.esc(text)}</strong>") if bold else text


def fig6(d: ReportData, hl: Headline) -> str:
    grid = t.latency_grid(answer.own_rows(d, hl))
    parts = [h.figure(figures.ratio_points(grid), "latency ratio to the original per method and backend",
                      "Fig. 6: each graph's latency relative to the original graph on the same backend (below 1: "
                      "faster), with the 95% interval of the measurement protocol; the dashed line is 1."),
             _noise_note(hl)]
    rows = []
    for m in grid["methods"]:
        cells = []
        for b in grid["backends"]:
            c = grid["cells"][(m, b)]
            if c is None:
                cells.append(h.DASH)
            elif c["status"] != "ok":
                cells.append(c["status"])
            else:
                cells.append(f"{h.num(c['latency_ms_median'])} (IQR {h.num(c['latency_ms_iqr'])})"
                             + ("" if m == "original" else f"; ratio {_ratio(c)}, {t.finding(c)}"))
        diffs = [c["max_rel_diff"] for b in grid["backends"] if (c := grid["cells"][(m, b)]) is not None
                 and c["max_rel_diff"] is not None]
        rows.append((_m(m), *cells, f"{max(diffs):.1e}" if diffs else h.DASH))
    parts.append(h.table(["graph", *(f"{_b(b)} (ms)" for b in grid["backends"]), "max output difference"], rows,
                         "This run: median latency in ms (IQR); ratio to the original on the same backend [95% "
                         "interval] and verdict; 'unsupported': the backend cannot run the graph; 'mismatch': its "
                         "outputs for the original disagree with onnxruntime (left out)"))
    parts.append(answer.same_lines(hl))
    sentences = [s for b in grid["backends"] if (s := headline.backend_sentence(hl, b))]
    if sentences:
        parts.append(h.p(" ".join(sentences)))
    checks = [(m, c) for m in grid["methods"] if (c := t.method_value(d.evaluation, m, "speed_check"))]
    if checks:
        parts.append(h.p("Never-slower check of each method's stage (its final graph against the original on the "
                         "check backend; a graph not significantly faster is replaced by the original): "
                         + "; ".join(f"{_m(m)}: {c}" for m, c in checks) + "."))
    parts.append(_not_evaluated(d))
    pm = _paper_model(d.model)
    if pm in paper.RLFLOW_LATENCY_MS:
        vals = paper.RLFLOW_LATENCY_MS[pm]
        tf = vals[0]
        prow = [(s, h.num(v, 2), h.pct(t.improvement_pct(tf, v))) for s, v in zip(paper.RLFLOW_LATENCY_SYSTEMS, vals)]
        parts.append(h.paper(f"{paper.RLFLOW_LATENCY_SOURCE}, {pm}:"))
        parts.append(h.table(["system", "latency (ms)", "improvement vs TensorFlow (computed)"], prow))
    else:
        parts.append(h.paper(f"{paper.RLFLOW_LATENCY_SOURCE}: the paper reports no latency for '{d.model}'."))
    tm = paper.TASO_MODEL.get(d.model)
    if tm:
        parts.append(h.paper(f"{paper.TASO_SPEEDUP_SOURCE}: {tm} {paper.TASO_SPEEDUP[tm]}x."))
    parts.append(h.paper(paper.TENSAT_VS_TASO_SOURCE + " (over TASO's rules, on GPUs)."))
    return "".join(parts)


def fig7(d: ReportData, hl: Headline) -> str:
    rows = t.optimisation_times(d)
    parts = [h.figure(figures.optimisation_bars(rows), "bar chart of optimisation time per method",
                      "Fig. 7: optimisation time per method (solid); training time of the RL agents (hatched).")]
    parts.append(h.table(["method", "optimisation (s)", "training (s)", "from"],
                         [(_m(r["method"]), h.num(r["optimisation_s"], 2), h.num(r["training_s"], 2), r["source"])
                          for r in rows]))
    parts.append(h.p("Optimisation time: the search's run time (TASO, greedy; equality saturation: saturating the "
                     "e-graph and extracting from it; eqsat-rl: that and its tree search over schedules), or the "
                     "trained agent's run on the real environment (model-free, RLFlow); the agents' training is "
                     "listed separately."))
    pm = _paper_model(d.model)
    if pm in paper.RLFLOW_OPT_TIME_S:
        a, b = paper.RLFLOW_OPT_TIME_S[pm]
        parts.append(h.paper(f"{paper.RLFLOW_OPT_TIME_SOURCE}, {pm}: TASO {a:g} s, RLFlow {b:g} s."))
    else:
        parts.append(h.paper(f"{paper.RLFLOW_OPT_TIME_SOURCE}: none for '{d.model}'."))
    parts.append(h.paper(paper.TENSAT_VS_TASO_SOURCE + "."))
    parts += [_eqsat_vs_taso(_egraph(d, m), m) for m in E_GRAPH_METHODS]
    return "".join(parts)


def fig8(d: ReportData, hl: Headline) -> str:
    parts = []
    if d.wm_curve.ok:
        parts.append(h.figure(figures.world_model_curve(d.wm_curve.data), "world-model loss per epoch",
                              "Fig. 8: the MDN-RNN's training and held-out loss, and its next-z negative "
                              "log-likelihood per dimension, per epoch."))
    else:
        parts.append(h.missing(d.wm_curve.why()))
    if d.world_model.ok:
        w = d.world_model.data
        keys = ("epochs", "train_episodes", "heldout_episodes", "evaluated_on", "final_train_loss",
                "final_train_nll", "final_heldout_nll", "loglik_per_dim", "reward_corr", "delta_rmse_ms",
                "reward_rmse", "unchanged_share", "change_accuracy", "false_change_rate", "mask_accuracy",
                "mask_recall", "mask_precision", "done_accuracy", "train_seconds")
        parts.append(_kv([(k, v) for k, v in t.flatten({k: w[k] for k in keys if k in w})],
                         "World-model quality (on held-out episodes unless 'evaluated_on' says train)"))
    else:
        parts.append(h.missing(d.world_model.why()))
    parts.append(h.paper(f"{paper.RLFLOW}: MDN-RNN with {paper.RLFLOW_WORLD_MODEL}; the paper plots the loss curve "
                         "without giving numbers."))
    return "".join(parts)


def fig9(d: ReportData, hl: Headline) -> str:
    parts = []
    series = []
    if d.controller.ok:
        series.append(("RLFlow controller: reward predicted in the dream", *t.reward_curve(d.controller)))
    else:
        parts.append(h.missing(d.controller.why()))
    if d.model_free.ok:
        series.append(("model-free PPO: reward in the real environment", *t.reward_curve(d.model_free)))
    if series:
        parts.append(h.figure(figures.reward_curves(series, "mean reward per step"), "reward per PPO update",
                              "Fig. 9: mean reward per PPO update: predicted by the world model while the controller "
                              "trains in the dream (and, for comparison, the model-free agent's real reward)."))
    disagreement = t.reward_curve(d.controller, "disagreement")
    if disagreement[0]:
        parts.append(h.figure(figures.reward_curves([("world-model ensemble: reward disagreement", *disagreement)],
                                                    "reward std across members"), "ensemble disagreement per update",
                              "The world-model ensemble's disagreement during the controller's training: the mean, "
                              "over the dream's moves of each PPO update, of the standard deviation of the members' "
                              "predicted rewards (times controller.disagreement_penalty it is subtracted from the "
                              "dream reward, so the controller is steered away from moves the members disagree on)."))
    rows = []
    for method, inp in (("rlflow", d.controller), ("model_free", d.model_free)):
        r = t.real_run(inp)
        if r:
            rows.append((_m(method), h.num(r["initial_ms"]), h.num(r["best_ms"]), h.pct(r["improvement_pct"], 2),
                         h.count(r["steps"])))
        else:
            rows.append((_m(method), *(["not run" if not inp.ok else h.DASH] * 4)))
    parts.append(h.table(["agent", "cost before (ms)", "best cost (ms)", "improvement (cost model)", "real steps"],
                         rows, "Each trained agent's run on the real environment (cost-model runtime)"))
    if d.controller.ok and d.controller.data.get("reward"):
        parts.append(h.p(f"Reward: {d.controller.data['reward']}; temperature "
                         f"{h.auto(d.controller.data.get('temperature'))}."))
    parts.append(h.paper(f"{paper.RLFLOW}: the paper plots the reward predicted in the dream per epoch (controller "
                         "trained up to 1000 epochs in mini-batches of 10) without giving numbers."))
    return "".join(parts)


def fig10(d: ReportData, hl: Headline) -> str:
    a = t.rules_applied({m: tr for m, tr in d.traces.items() if m not in E_GRAPH_METHODS})
    parts = [h.p(f"{_m('eqsat')} and {_m('eqsat_rl')} are not in this figure: they apply rules at every match to "
                 "an e-graph and extract a graph from it, so they have no sequence of rewrites; the section on the "
                 "e-graph lists the rules whose matches changed it.")]
    for m, inp in a["missing"].items():
        parts.append(h.missing(f"{_m(m)}: {inp.why()}"))
    if a["methods"] and not a["rules"]:
        parts.append(h.p("No method applied any rule: every trace found has an empty list of steps."))
    elif a["rules"]:
        shown = min(40, len(a["rules"]))
        parts.append(h.figure(figures.rules_heatmap(a), "heatmap of rules applied by each method",
                              f"Fig. 10: how often each method applied each rule (the {shown} most used of "
                              f"{len(a['rules'])})."))
        rows = [(r, *(a["counts"].get((r, m), 0) for m in a["methods"])) for r in a["rules"]]
        parts.append(h.details("Every rule applied, per method",
                               h.table(["rule", *(_m(m) for m in a["methods"])], rows)))
    totals = [(_m(m), len(d.traces[m].data.get("steps") or [])) for m in a["methods"]]
    if totals:
        parts.append(h.p("Rewrites applied in all: " + ", ".join(f"{m} {n}" for m, n in totals) + "."))
    return "".join(parts)


def _egraph(d: ReportData, method: str = "eqsat") -> dict | None:
    """eqsat's (or eqsat_rl's) e-graph figures (:func:`rlflow.report.tables.egraph`); None when its trace is
    absent."""
    tr = d.traces.get(method)
    return t.egraph(tr, d.traces["taso"]) if tr is not None and tr.ok else None


def _eqsat_vs_taso(e: dict | None, method: str = "eqsat") -> str:
    """This run's eqsat (or eqsat_rl) against TASO on the cost target and in time (from their traces); empty
    without both."""
    if e is None or e["final_ms"] is None or e["taso_final_ms"] is None:
        return ""
    cheaper = t.improvement_pct(e["taso_final_ms"], e["final_ms"])
    took = (f"; it took {e['seconds']:.2f} s, TASO {e['taso_seconds']:.2f} s"
            if e["seconds"] is not None and e["taso_seconds"] is not None else "")
    return h.p(f"This run, on the cost target: {_m(method)}'s graph {h.num(e['final_ms'], 4)} ms, TASO's "
               f"{h.num(e['taso_final_ms'], 4)} ms ({h.pct(cheaper, 2)} against TASO's; positive: cheaper){took}.")


def _egraph_rows(e: dict) -> list[tuple[str, str]]:
    """One e-graph run's figures (:func:`rlflow.report.tables.egraph`), as (label, value) rows."""
    c, cfg = e["counts"], e["settings"]
    ilp = ""
    if c["ilp_variables"] is not None:
        # the summary line's wording (rlflow.search.output.ilp_verdict); the report does not import the searches
        gap = e.get("ilp_gap")
        verdict = "optimal" if e["ilp_optimal"] else (e["ilp_message"] or "not optimal") + (
            f", gap {h.num(100 * gap, 1)}% to its bound" if gap else "")
        ilp = (f" ({verdict}; "
               f"{h.count(c['ilp_variables'])} variables, {h.count(c['ilp_constraints'])} constraints, "
               f"{h.num(c['ilp_seconds'], 2)} s" + (
                   f"; its {h.count(c['ilp_fusion_pairs'])} fused pairs and {h.count(c['ilp_fusion_triples'] or 0)} "
                   f"three-node kernels priced as the target fuses them; the graph of extraction "
                   f"{h.count(c['extraction_cheapest_round'])} kept" if c["ilp_fusion_pairs"] else "")
               + ")")
    tree = e["tree"]
    return [
        ("e-nodes before -> after saturation", f"{h.count(c['egraph_nodes_initial'])} -> {h.count(c['egraph_nodes'])}"
                                               f" (limit {h.auto(cfg.get('node_limit'))})"),
        ("e-classes before -> after", f"{h.count(c['egraph_classes_initial'])} -> {h.count(c['egraph_classes'])}"),
        ("iterations", f"{h.count(c['iterations'])} (limit {h.auto(cfg.get('iter_limit'))}); stopped: "
                       f"{e['stop'] or h.DASH}"),
        ("rules", f"{h.count(c['rules_translated'])} of {h.count(c['rules'])} translated; "
                  f"{h.count(c['multi_pattern_rules'])} multi-pattern, run in the first "
                  f"{h.auto(cfg.get('multi_iterations'))} iteration(s)"),
        ("rule schedule (rule families per iteration)", ", ".join(e["schedule"]) if e["schedule"]
         else "every rule in every iteration (the backoff scheduler)"),
        ("tree search over schedules", h.DASH if tree["leaves"] is None else
         f"{h.count(tree['leaves'])} schedules scored in {h.num(tree['seconds'], 2)} s; the best one's short-ILP "
         f"cost {h.num(tree['best_proxy_ms'], 4)} ms"),
        ("matches applied", f"{h.count(c['applied'])} ({h.count(c['merges'])} unions; "
                            f"{h.count(c['match_cap_hits'])} rule bans by the backoff scheduler)"),
        ("cycle filtering", f"{h.count(c['cycle_enodes_removed'])} e-nodes removed; {h.count(c['filtered'])} "
                            "matches not applied (their target needs a removed e-node)"),
        ("saturation (s)", h.num(c["saturation_seconds"], 2)),
        ("extraction", f"{e['extraction'] or h.DASH}{ilp}"),
        ("extraction (s)", h.num(c["extraction_seconds"], 2)),
        ("optimisation in all (s)", h.num(e["seconds"], 2)),
        ("cost estimate: original -> extracted -> result (ms)",
         f"{h.num(e['initial_ms'], 4)} -> {h.num(c['extracted_cost_ms'], 4)} -> {h.num(e['final_ms'], 4)}"
         + (" (the extraction cost more: the input was kept)" if e["kept_input"] else "")),
    ]


def egraph(d: ReportData, hl: Headline) -> str:
    tensat = h.paper(f"{paper.TENSAT}'s settings: " + "; ".join(f"{k} {v:,}" for k, v in paper.TENSAT_SETTINGS.items())
                     + f". {paper.TENSAT_VS_TASO_SOURCE}.")
    runs = {m: e for m in E_GRAPH_METHODS if (e := _egraph(d, m)) is not None}
    absent = "".join(h.missing(d.traces[m].why()) for m in E_GRAPH_METHODS if m not in runs)
    if not runs:
        return absent + tensat
    rows = {m: _egraph_rows(e) for m, e in runs.items()}
    labels = [label for label, _ in next(iter(rows.values()))]
    parts = [h.p("Equality saturation's run (stage search_eqsat, from its trace) and eqsat-rl's (stage "
                 "search_eqsat_rl: the same e-graph runner, budget and extraction, the rule families of each iteration "
                 "chosen by a tree search over schedules): how far the e-graph grew, why saturation stopped, and how "
                 "the graph was extracted from it.")]
    if len(runs) == 1 and "eqsat" in runs:
        parts.append(_kv(rows["eqsat"]))
    else:
        parts.append(h.table(["", *(_m(m) for m in runs)],
                             [(label, *(rows[m][i][1] for m in runs)) for i, label in enumerate(labels)], cls="kv"))
    parts.append(absent)
    for m, e in runs.items():
        if e["rules_fired"]:
            parts.append(h.details(f"{_m(m)}: rules whose matches changed the e-graph ({len(e['rules_fired'])})",
                                   h.table(["rule", "matches that changed the e-graph"],
                                           [(r, h.count(n)) for r, n in e["rules_fired"]])))
    parts += [tensat, *(_eqsat_vs_taso(e, m) for m, e in runs.items())]
    return "".join(parts)


def fig5(d: ReportData, hl: Headline) -> str:
    rows = t.reward_rows(d)
    runs = [r for r in rows if r["input"].ok]
    parts = []
    if not d.rewards:
        parts.append(h.missing("Not run: the config's sweeps.rewards is empty, so only the main run's reward "
                               f"({rows[0]['label']}) was trained; set sweeps.rewards to compare reward functions."))
    else:
        for r in rows[1:]:
            if not r["input"].ok:
                parts.append(h.missing(f"reward '{r['label']}': {r['input'].why()}"))
        if len(runs) < 2:
            parts.append(h.missing("Fewer than two reward functions have results, so there is nothing to compare yet."))
        else:
            labels = [f"{r['label']}{' (main run)' if r['main'] else ''}" for r in runs]
            parts.append(h.figure(figures.small_panels([(lab, *t.reward_curve(r["input"])) for lab, r in
                                                        zip(labels, runs)], "mean dream reward"),
                                  "dream reward per reward function",
                                  "Fig. 5 (left): reward predicted in the dream per update, one panel per reward "
                                  "function (their scales differ)."))
            parts.append(h.figure(figures.value_bars(labels, [r["improvement_pct"] for r in runs],
                                                     "real improvement of the cost-model runtime (%)"),
                                  "real improvement per reward function",
                                  "Fig. 5 (right): the trained controller's improvement on the real environment."))
            parts.append(_sweep_table(rows, "reward function"))
    parts.append(h.paper(paper.RLFLOW_REWARD_SOURCE + "."))
    return "".join(parts)


def _sweep_table(rows: list[dict], what: str) -> str:
    body = []
    for r in rows:
        label = f"{_label(r['label'])}{' (main run)' if r['main'] else ''}"
        if not r["input"].ok:
            body.append((label, *(["not run"] * 5)))
            continue
        body.append((label, h.num(r.get("initial_ms")), h.num(r.get("best_ms")), h.pct(r.get("improvement_pct"), 2),
                     h.num(r["final_dream_reward"], 4), h.count(r["real_interactions"])))
    return h.table([what, "cost before (ms)", "best cost (ms)", "real improvement", "final dream reward",
                    "real interactions"], body)


def table3(d: ReportData, hl: Headline) -> str:
    parts = []
    if not d.temperatures:
        parts.append(h.missing("Not run: the config's sweeps.temperatures is empty (the main controller ran at "
                               f"temperature {h.auto((d.config.get('controller') or {}).get('temperature'))} only)."))
    else:
        rows = t.temperature_rows(d)
        for r in rows:
            if not r["input"].ok and not r["main"]:
                parts.append(h.missing(f"temperature {_label(r['label'])}: {r['input'].why()}"))
        parts.append(_sweep_table(rows, "temperature tau"))
        done = [r for r in rows if r["input"].ok and r.get("improvement_pct") is not None]
        if len(done) > 1:
            top = max(r["improvement_pct"] for r in done)
            best = [_label(r["label"]) for r in done if r["improvement_pct"] == top]
            if len(best) == len(done):
                parts.append(h.p(f"Every temperature run gave the same real improvement ({h.pct(top, 2)})."))
            else:
                parts.append(h.p(f"Best real improvement in this run: {h.pct(top, 2)} at tau "
                                 f"{', '.join(dict.fromkeys(best))}."))
    parts.append(h.paper(f"{paper.RLFLOW_TEMPERATURE_SOURCE}; values swept: "
                         f"{', '.join(f'{v:g}' for v in paper.RLFLOW_TEMPERATURES)}."))
    return "".join(parts)


def cost_vs_e2e(d: ReportData, hl: Headline) -> str:
    c = t.cost_discrepancy(answer.own_rows(d, hl))
    parts = [h.p("The cost model's estimate of each graph (cost_ms, what the searches and agents optimise) against "
                 "its measured end-to-end latency; difference = |E2E - cost| / cost, as X-RLflow reports it.")]
    if not c["rows"]:
        parts.append(h.missing("No row of evaluation.csv has both a cost estimate and a measured latency."))
    else:
        parts.append(h.table(["graph", "backend", "cost model (ms)", "end to end (ms)", "difference"],
                             [(_m(r["method"]), _b(r["backend"]), h.num(r["cost_ms"]), h.num(r["e2e_ms"]),
                               f"{r['diff_pct']:.1f}%") for r in c["rows"]], "This run", cls="left2"))
        parts.append(h.p("Mean difference per backend: " + ", ".join(
            f"{_b(b)} {v:.1f}%" for b, v in c["mean_by_backend"].items()) + "."))
    xm = paper.X_RLFLOW_MODEL.get(d.model)
    prow = [(_bold(name == xm, name), h.num(a, 4), h.num(b, 4), f"{p:.1f}%")
            for name, (a, b, p) in paper.X_RLFLOW_COST_DISCREPANCY.items()]
    parts.append(h.paper(paper.X_RLFLOW_COST_SOURCE + (f" (the row of this model: {xm})" if xm else "") + ":"))
    parts.append(h.table(["model", "cost model (ms)", "end to end (ms)", "difference"], prow))
    return "".join(parts)


def sample_efficiency(d: ReportData, hl: Headline) -> str:
    rows = t.sample_efficiency(d)
    parts = []
    body = []
    for r in rows:
        if r["total"] is None:
            body.append((_m(r["method"]), "not run", h.DASH, h.DASH, r["input"].why() if not r["input"].ok else h.DASH))
            continue
        parts_txt = ", ".join(f"{k} {h.auto(v)}" for k, v in r["parts"].items()) or h.DASH
        body.append((_m(r["method"]), h.count(r["total"]), parts_txt, h.count(r["dream_steps"]), r["source"]))
    parts.append(h.table(["agent", "real interactions", "of which", "dream steps (no real cost)", "from"], body,
                         "Real-environment interactions per agent"))
    totals = {r["method"]: r["total"] for r in rows}
    if totals.get("model_free") and totals.get("rlflow"):
        parts.append(h.p(f"The model-free agent used {totals['model_free'] / totals['rlflow']:.2f}x as many real "
                         "interactions as RLFlow (whose count includes the random rollouts the world model "
                         "learnt from)."))
    claim = t.model_based_claim(d)
    if claim is not None:
        parts.append(h.p(_claim_sentence(claim)))
    parts.append(h.figure(figures.value_bars([_m(r["method"]) for r in rows], [r["total"] for r in rows],
                                             "real-environment interactions", log=True),
                          "real interactions per agent", "Real-environment interactions per agent."))
    pi = paper.RLFLOW_INTERACTIONS
    ps = paper.RLFLOW_STEP_MS
    parts.append(h.paper(f"{paper.RLFLOW_SAMPLE_SOURCE}: " + "; ".join(f"{k} ~{v:,}" for k, v in pi.items())
                         + "; one step: " + "; ".join(f"{k} ~{v:g} ms" for k, v in ps.items()) + "."))
    return "".join(parts)


def _claim_sentence(c: dict) -> str:
    """RLFlow's model-based claim, checked on this run's two agents, in one sentence."""
    gain, n = c["gain_pct"], c["interactions"]
    bound_gain, bound_n = paper.CLAIM_MIN_GAIN_SHARE, paper.CLAIM_MAX_INTERACTION_SHARE
    short = []
    if not c["gain_holds"]:
        short.append(f"its improvement is below {bound_gain:.0%} of the model-free agent's")
    if not c["interactions_hold"]:
        short.append(f"it used more than {bound_n:.0%} of the model-free agent's real interactions")
    verdict = "The claim holds in this run." if not short else "This run falls short: " + " and ".join(short) + "."
    plan = c.get("plan")
    if plan:  # controller.plan: say how much of its run the world model chose, not only the policy
        verdict += (f" In its real episodes the controller planned one step ahead with its world model: "
                    f"{plan.get('planned_steps', 0)} of the {plan.get('episode_steps', 0)} steps of its kept episode "
                    "were rewrites the world model expected to save runtime where the policy's choice was not.")
    return (f"RLFlow's claim (the controller trained in the dream reaches at least {bound_gain:.0%} of the model-free "
            f"agent's improvement with at most {bound_n:.0%} of its real interactions), on this run: the controller "
            f"reached {c['gain_share']:.1%} of the model-free agent's improvement ({gain['rlflow']:+.2f}% against "
            f"{gain['model_free']:+.2f}%) with {c['interaction_share']:.1%} of its real interactions "
            f"({n['rlflow']:,.0f} against {n['model_free']:,.0f}). {verdict}")


def generalisation(d: ReportData, hl: Headline) -> str:
    g = d.generalise
    if g is None or not g.ok:
        return h.missing(g.why() if g is not None else "Not run (stage generalise).")
    rows = g.data.get("rows") or []
    agents = [m for m in ("model_free", "rlflow") if any(m in (r.get("agents") or {}) for r in rows)]
    body = []
    for r in rows:
        cells = [r.get("graph"), h.count(r.get("nodes")), h.num(r.get("initial_ms"), 4)]
        for m in agents:
            a = (r.get("agents") or {}).get(m) or {}
            cells += [h.pct(a.get("improvement_pct"), 2), "trained" if r.get("trained") else h.num(a.get("kept"), 2),
                      h.num(a.get("vs_greedy"), 2)]
        body.append((*cells, h.pct(r.get("greedy_pct"), 2)))
    head = ["graph", "nodes", f"cost before (ms, {g.data.get('cost_label', 'cost target')})"]
    for m in agents:
        head += [f"{_m(m)}: improvement", f"{_m(m)}: kept", f"{_m(m)}: x greedy's"]
    parts = [h.table([*head, "greedy: improvement"], body,
                     "Each agent's improvement of the cost-target runtime on the shape it was trained on and, with "
                     "no training, on each variant; kept = improvement on the variant / on the trained shape; "
                     "x greedy's = improvement / greedy's on the same graph (what the shape itself allows moves "
                     "kept too)")]
    for m in agents:
        kept = [(r["graph"], r["agents"][m].get("kept")) for r in rows[1:] if m in (r.get("agents") or {})]
        if not kept:
            continue
        low = [lab for lab, k in kept if k is None or k < 0.9]
        parts.append(h.p(f"{_m(m)}: " + ("kept at least 90% of its improvement on every variant." if not low else
                                         f"kept less than 90% of its improvement (or had none to keep) on: "
                                         f"{', '.join(low)}.")))
    if not rows[1:]:
        parts.append(h.missing(f"No variants configured for {d.model} (generalise.variants.{d.model})."))
    parts.append(h.paper(f"{paper.X_RLFLOW}: trained once, the agent generalises zero-shot to other input tensor "
                         "shapes of the same model (the paper gives no per-shape figures we could set beside these)."))
    return "".join(parts)


def encoder(d: ReportData, hl: Headline) -> str:
    if not d.encoder.ok:
        return h.missing(d.encoder.why())
    e = d.encoder.data
    held, train = e.get("heldout") or {}, e.get("train_eval") or {}
    base = held.get("baseline_median_counts") or {}
    names = ["graphs", "runtime_rel_err", *(f"metric_rel_err.{k}" for k in (held.get("metric_rel_err") or {})),
             "counts_exact_acc", "counts_mask_acc", "counts_exact_acc_where_matched"]
    flat_h, flat_t = dict(t.flatten(held)), dict(t.flatten(train))
    baseline = {"runtime_rel_err": held.get("baseline_mean_runtime_rel_err"), **base}
    rows = [(n, h.auto(flat_h.get(n)), h.auto(flat_t.get(n)), h.auto(baseline.get(n))) for n in names
            if n in flat_h or n in flat_t]
    parts = [h.p("The graph encoder is trained to predict each rollout graph's cost metrics and per-rule match "
                 "counts from its z; errors on graphs of held-out episodes (relative errors: lower is better; "
                 "accuracies: higher is better). The baseline predicts the mean runtime / median counts."),
             h.table(["figure", "held-out", "training graphs", "baseline"], rows)]
    other = {k: e[k] for k in ("episodes", "graphs", "replay_check", "seconds") if k in e}
    if other:
        parts.append(_kv(t.flatten(other)))
    return "".join(parts)


def rollouts(d: ReportData, hl: Headline) -> str:
    if not d.rollouts.ok:
        return h.missing(d.rollouts.why())
    r = d.rollouts.data
    keep = {k: v for k, v in r.items() if k not in ("format", "model")}
    return _kv(t.flatten(keep))


def rules(d: ReportData, hl: Headline) -> str:
    parts = []
    if d.rules_stats.ok:
        parts.append(h.p("TASO's generator, numeric verification and pruning (stage generate_rules): the count "
                         "after every step and the seconds each step took."))
        stats = d.rules_stats.data
        parts.append(_kv(t.flatten({k: v for k, v in stats.items() if k not in ("format", "builtin_families")})))
        families = stats.get("builtin_families") or {}
        if families:
            parts.append(h.details(f"Builtin rule families ({len(families)}, {sum(families.values())} rules)",
                                   h.table(["family", "rules"], [(f, h.count(n)) for f, n in families.items()])))
        if any(f.startswith("attention-") for f in families):
            parts.append(h.p(f"The fused-kernel family is on: attention-fuse rewrites the primitive attention "
                             f"pattern into ONNX's Attention in graphs of opset {ATTENTION_OPSET} and above, "
                             f"attention-unfuse writes it back. What each backend runs for one Attention node:"))
            parts.append(h.table(["backend", "kernel"], [(BACKEND_LABEL.get(b, b), k) for b, k in KERNELS.items()],
                                 cls="kv"))
    else:
        parts.append(h.missing(d.rules_stats.why()))
    parts.append(h.paper(f"{paper.TASO_RULES_SOURCE}: "
                         + "; ".join(f"{k} {v}" for k, v in paper.TASO_RULES.items()) + "."))
    return "".join(parts)


def evaluation(d: ReportData, hl: Headline) -> str:
    cols = list(d.evaluation[0])
    rows = [[h.auto(r[c]) if not isinstance(r[c], str) else r[c] for c in cols] for r in d.evaluation]
    parts = [h.details(f"evaluation.csv ({len(rows)} rows)", h.table(cols, rows))]
    if d.eval_metrics.ok:
        parts.append(h.details("metrics.json (the evaluate stage's DVC metrics)", _kv(t.flatten(d.eval_metrics.data))))
    else:
        parts.append(h.missing(d.eval_metrics.why()))
    return "".join(parts)


def config_versions(d: ReportData, hl: Headline) -> str:
    text = yaml.safe_dump(reported_config(d.config, d.model), sort_keys=False, default_flow_style=None, width=100)
    parts = [h.p("The config this run used (every section the report depends on, after merging config files and "
                 "--set overrides), and the software and machine."), h.pre(text),
             _kv(d.versions.items(), "Package versions"), _kv(d.machine.items(), "Machine")]
    return "".join(parts)


@dataclass(frozen=True)
class Section:
    """One section of the report: its anchor, its title and the function that builds its body from the loaded
    data and the headline (every verdict it states comes from the headline)."""

    id: str
    title: str
    build: Callable[[ReportData, Headline], str]


#: the report's sections, in order: the answer first
SECTIONS = (
    Section("answer", answer.TITLE, answer.build),
    Section("how", "How to read this report", how_to_read),
    Section("table2", "Table 2: improvement vs TensorFlow (latency and memory)", table2),
    Section("fig6", "Fig. 6: runtime of every method on each backend", fig6),
    Section("fig7", "Fig. 7: optimisation time per method", fig7),
    Section("fig8", "Fig. 8: world-model loss", fig8),
    Section("fig9", "Fig. 9: reward predicted in the dream", fig9),
    Section("fig10", "Fig. 10: transformations applied by each method", fig10),
    Section("egraph", "Equality saturation and eqsat-rl: e-graph size, saturation and extraction", egraph),
    Section("fig5", "Fig. 5: reward functions", fig5),
    Section("table3", "Table 3: temperature sweep", table3),
    Section("cost", "Cost model vs end-to-end latency", cost_vs_e2e),
    Section("target", "Estimate on the cost target vs end to end", cost_target.section),
    Section("roofline", "How far from the limit", roofline.section),
    Section("sample", "Sample efficiency: real-environment interactions", sample_efficiency),
    Section("generalise", "Generalisation: the agents zero-shot on other shapes", generalisation),
    Section("encoder", "Graph encoder: held-out prediction error", encoder),
    Section("rollouts", "Random rollouts (the world model's data)", rollouts),
    Section("rules", "Rule generation", rules),
    Section("evaluation", "Evaluation data", evaluation),
    Section(xla_passes.SECTION_ID, xla_passes.TITLE, lambda d, hl: xla_passes.section(d)[2]),
    Section("config", "Config, versions and machine", config_versions),
)


def _targets(hl: Headline, d: ReportData) -> str:
    """The run's cost targets, as resolved: one per track."""
    if not hl.tracks:
        return cost_target.target_label(d)[1]
    return "; ".join(f"{t.platform.target} ({t.platform.label}): " + (
        f"verified on {headline.backend_label(t.platform.backend)}" if t.kind == headline.MACHINE
        else "simulated target, not verifiable on this machine") for t in hl.tracks)


def render_report(d: ReportData) -> str:
    hl = headline.from_report(d)
    cfg = d.config
    reward = (cfg.get("env") or {}).get("reward") or {}
    header = _kv([("model", d.model), *d.machine.items(),
                  ("cost target", _targets(hl, d)),
                  ("reward", reward.get("name")),
                  ("controller temperature", (cfg.get("controller") or {}).get("temperature")),
                  ("seed", cfg.get("seed")), ("results", str(d.results))])
    body = "\n".join(h.section(s.id, s.title, s.build(d, hl)) for s in SECTIONS)
    return h.page(f"RLFlow report: {d.model}", f'<div class="meta">{header}</div>',
                  [(s.id, s.title) for s in SECTIONS], body)
