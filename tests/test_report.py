"""The report and summary stages on a fake but schema-correct results folder: one self-contained HTML file with
every section, the input's numbers in it, honest "not run" sections, and one-line errors without output."""

from __future__ import annotations

import base64
import csv
import json
import re
import xml.etree.ElementTree as ET
from html import unescape
from pathlib import Path

import pytest

from rlflow import cli

EVAL_COLUMNS = ("model,method,backend,device,latency_ms_median,latency_ms_iqr,ratio,ci_low,ci_high,verdict,"
                "detectable_effect,sessions,runs,too_noisy,roofline_ms,headroom,peak_memory_mb,activation_memory_mb,"
                "nodes,cost_ms,flops,bytes,launches,optimisation_s,training_s,real_interactions,rules_applied,"
                "speed_check,max_rel_diff,status").split(",")
BACKENDS = ("ort", "torch", "tf", "tf-xla")
#: median latency (ms) per method and backend; None = unsupported
LATENCY = {
    "original": (12.5, 30.0, 20.0, 16.0),
    "original-aa": (12.5, 30.0, 20.0, 16.0),
    "taso": (12.0, 28.0, 18.5, 15.5),
    "greedy": (12.25, 29.0, 19.0, 15.75),
    "eqsat": (12.0, 28.5, 18.8, 15.5),
    "eqsat_rl": (11.875, 28.25, 18.6, 15.25),
    "model_free": (11.75, 27.0, 18.0, 15.0),
    "rlflow": (11.5, 26.0, 17.5, None),
}
ACTIVATION_MB = {"original": 8.0, "original-aa": 8.0, "taso": 7.5, "greedy": 8.0, "eqsat": 7.5, "eqsat_rl": 7.5,
                 "model_free": 7.0, "rlflow": 6.0}
COST_MS = {"original": 10.0, "original-aa": 10.0, "taso": 9.5, "greedy": 9.75, "eqsat": 9.4, "eqsat_rl": 9.3,
           "model_free": 9.25, "rlflow": 10.0}
OPT_S = {"taso": 42.5, "greedy": 3.25, "eqsat": 0.85, "eqsat_rl": 2.25, "model_free": 1.5, "rlflow": 0.75}
TRAIN_S = {"model_free": 250.0, "rlflow": 125.0}
INTERACTIONS = {"model_free": 2408, "rlflow": 608}
STEPS = {"taso": ["conv-relu", "conv-relu", "matmul-merge"], "greedy": ["conv-relu"], "eqsat": [], "eqsat_rl": [],
         "model_free": ["add-const-fold"], "rlflow": ["matmul-merge", "matmul-merge", "matmul-merge"]}
FOLDER = {"taso": "taso", "greedy": "greedy", "eqsat": "eqsat", "eqsat_rl": "eqsat_rl", "model_free": "model_free",
          "rlflow": "controller"}
#: eqsat's trace: its settings and e-graph statistics (as rlflow.search.eqsat.eqsat_search writes them)
EQSAT_SETTINGS = {"node_limit": 50000, "iter_limit": 15, "time_limit_s": 60.0, "ilp_time_limit_s": 60.0,
                  "multi_iterations": 1, "extraction": "ilp"}
EQSAT_STATS = {"egraph_nodes_initial": 115, "egraph_classes_initial": 115, "egraph_nodes": 2513, "egraph_classes": 153,
               "saturation_seconds": 0.25, "extraction_seconds": 0.5, "rules": 34, "rules_translated": 34,
               "multi_pattern_rules": 5, "rules_skipped": 0, "iterations": 6, "matches": 178, "applied": 177,
               "merges": 98, "match_cap_hits": 0, "rules_fired": {"add-commutativity": 42, "matmul-merge": 12},
               "extraction": "ilp", "ilp_variables": 600, "ilp_constraints": 1009, "ilp_seconds": 0.25,
               "ilp_status": 0, "ilp_message": "Optimization terminated successfully.", "ilp_optimal": True,
               "extracted_cost_ms": 9.4, "kept_input": False}
#: eqsat-rl's trace (stage search_eqsat_rl, rlflow.search.eqsat_rl.tree_search): eqsat's statistics of the schedule
#: chosen, the schedule and the tree search's
EQSAT_RL_STATS = {**EQSAT_STATS, "egraph_nodes": 3001, "iterations": 7, "extracted_cost_ms": 9.3,
                  "ilp_fusion_pairs": 869, "ilp_fusion_triples": 72,  # (as on a target that fuses kernels)
                  "extraction_cheapest_round": 2,
                  # its ILP stopped at its time limit before proving its answer
                  "ilp_optimal": False, "ilp_status": 13, "ilp_message": "Time limit reached (HiGHS status 13)",
                  "ilp_gap": 0.0656,
                  "schedule": ["no:elementwise", "all", "all", "all", "all", "all", "all"],
                  "families": ["elementwise", "matmul", "multi", "other", "transpose"],
                  "tree_simulations": 16, "tree_seconds": 1.5, "tree_best_proxy_ms": 9.3}

#: every graph's roofline lower bound (ms), at the device figures of metrics.json's roofline section
ROOFLINE_MS = 10.0
SECTION_TITLES = ("How to read this report", "Table 2", "Fig. 6", "Fig. 7", "Fig. 8", "Fig. 9", "Fig. 10",
                  "Equality saturation", "Fig. 5", "Table 3", "Cost model vs end-to-end latency",
                  "How far from the limit", "Sample efficiency", "Generalisation", "Graph encoder", "Random rollouts", "Rule generation",
                  "Config, versions and machine")


# -- a fake results folder ----------------------------------------------------------------------------------
def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))


#: half-width of every fake ratio interval
HALF = 0.01


def write_evaluation(folder: Path, model: str = "bert", methods=tuple(LATENCY), noisy=()) -> None:
    """Ratios are latency / the original's on the backend, intervals +/- HALF; ``noisy``: backends whose A/A
    control failed (too_noisy on every row)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "evaluation.csv", "w", newline="") as f:
        w = csv.DictWriter(f, EVAL_COLUMNS)
        w.writeheader()
        for m in methods:
            for b, lat in zip(BACKENDS, LATENCY[m]):
                row = dict.fromkeys(EVAL_COLUMNS, "")
                row.update(model=model, method=m, backend=b, device="cpu")
                if lat is None:
                    row.update(status="unsupported", too_noisy=False)
                else:
                    row.update(latency_ms_median=lat, latency_ms_iqr=0.5, activation_memory_mb=ACTIVATION_MB[m],
                               nodes=100, cost_ms=COST_MS[m], flops=1e9, bytes=1e8, launches=90, max_rel_diff=1e-7,
                               status="ok", sessions=4, runs=40, too_noisy=b in noisy, roofline_ms=ROOFLINE_MS,
                               headroom=1 - ROOFLINE_MS / lat)
                    if m == "original":
                        row.update(ratio=1, verdict="reference")
                    else:
                        ratio = lat / LATENCY["original"][BACKENDS.index(b)]
                        lo, hi = ratio - HALF, ratio + HALF
                        row.update(ratio=ratio, ci_low=lo, ci_high=hi, detectable_effect=0.02,
                                   verdict="faster" if hi < 1 else "slower" if lo > 1 else "no detectable difference")
                    if m not in ("original", "original-aa"):
                        row.update(optimisation_s=OPT_S[m],
                                   rules_applied=len(STEPS[m]) if m not in ("eqsat", "eqsat_rl") else "")
                    if m in TRAIN_S:
                        row.update(training_s=TRAIN_S[m], real_interactions=INTERACTIONS[m])
                w.writerow(row)


def trace(method: str) -> dict:
    metrics = {"runtime_ms": COST_MS[method], "flops": 1e9, "bytes": 1e8, "launches": 90.0}
    doc = {"format": "rlflow.search-trace/1", "method": method, "model": "bert",
           "initial": {"nodes": 100, **metrics, "runtime_ms": COST_MS["original"]},
           "final": {"nodes": 98, **metrics},
           "steps": [{"rule_id": f"r-{name}", "rule_name": name, "location": 0, "nodes": ["n"],
                      "cost_ms": COST_MS[method], "metrics": metrics} for name in STEPS[method]],
           "seconds": OPT_S[method]}
    if method == "eqsat":
        doc.update(settings=EQSAT_SETTINGS, stats=EQSAT_STATS, stop_reason="saturated")
    if method == "eqsat_rl":
        doc.update(method="eqsat-mcts", settings={**EQSAT_SETTINGS, "method": "eqsat-mcts"}, stats=EQSAT_RL_STATS,
                   stop_reason="saturated")
    if method in TRAIN_S:
        doc.update(training_seconds=TRAIN_S[method], real_interactions={"total": INTERACTIONS[method]})
    return doc


def controller_metrics(improvement: float, rewards=(0.111, 0.222, 0.333), reward="WeightedReward(alpha=0.8)") -> dict:
    return {"model": "bert", "temperature": 1.5, "reward": reward, "dream_steps": 4096,
            "real": {"initial": {"runtime_ms": 10.0}, "best": {"runtime_ms": 10.0 * (1 - improvement / 100)},
                     "best_step": 3, "steps": 8, "improvement_pct": improvement, "actions": [[1, 0]]},
            "real_interactions": {"rollouts": 600, "training": 0, "evaluation": 8, "total": INTERACTIONS["rlflow"]},
            "curve": [{"update": i + 1, "mean_reward": r, "disagreement": 0.5 / (i + 1)} for i, r in enumerate(rewards)],
            "seconds": 12.0}


def make_results(root: Path, model: str = "bert") -> Path:
    """A complete results tree: results/<model>/... and results/rules/stats.json."""
    res = root / "results" / model
    write_evaluation(res, model)
    write_json(res / "metrics.json", {"max_rel_diff": 1e-7, "speedup": {"rlflow": {"ort": 1.087}},
                                      "roofline": {"gemm_gflops": 437.0, "bandwidth_gbps": 46.0, "source": "ort"}})
    for m, folder in FOLDER.items():
        write_json(res / folder / "trace.json", trace(m))
    write_json(res / "encoder" / "metrics.json", {
        "model": model, "heldout": {"graphs": 40, "runtime_rel_err": 0.0123, "metric_rel_err": {"runtime_ms": 0.0123},
                                    "counts_exact_acc": 0.875, "counts_mask_acc": 0.9375,
                                    "baseline_mean_runtime_rel_err": 0.0456},
        "train_eval": {"graphs": 160, "runtime_rel_err": 0.0111}})
    write_json(res / "world_model" / "metrics.json", {"epochs": 3, "loglik_per_dim": -1.25, "mask_accuracy": 0.96875,
                                                      "reward_corr": {"weighted": 0.625, "delta": 0.5},
                                                      "reward_rmse": {"weighted": 0.0425}, "false_change_rate": 0.03125})
    (res / "world_model" / "loss.csv").write_text(
        "epoch,lr,train_loss,train_nll,heldout_loss,heldout_nll,seconds\n"
        "1,0.001,3.5,1.5,3.75,1.625,0.1\n2,0.0005,2.5,1.25,2.75,1.375,0.1\n3,0.0001,1.75,1.0,2.0,1.125,0.1\n")
    write_json(res / "controller" / "metrics.json", controller_metrics(7.25))
    write_json(res / "model_free" / "metrics.json", {
        "model": model, "reward": "WeightedReward(alpha=0.8)",
        "real": {"initial": {"runtime_ms": 10.0}, "best": {"runtime_ms": 9.5}, "best_step": 2, "steps": 8,
                 "improvement_pct": 5.0},
        "real_interactions": {"training": 2400, "evaluation": 8, "total": INTERACTIONS["model_free"]},
        "curve": [{"update": 1, "interactions": 1200, "mean_reward": 0.05},
                  {"update": 2, "interactions": 2400, "mean_reward": 0.07}]})
    write_json(res / "generalise.json", {
        "format": "rlflow.generalise/1", "model": model, "cost_target": "sim-h100", "cost_label": "simulated H100",
        "variants": ["bert seq=64", "bert seq=256"], "rows": [
            {"graph": "bert (trained)", "trained": True, "nodes": 412, "initial_ms": 2.25, "greedy_pct": 1.5,
             "agents": {"model_free": {"improvement_pct": 4.0, "kept": 1.0}, "rlflow": {"improvement_pct": 2.0,
                                                                                     "kept": 1.0}}},
            {"graph": "bert seq=64", "trained": False, "nodes": 412, "initial_ms": 1.5, "greedy_pct": 1.25,
             "agents": {"model_free": {"improvement_pct": 3.8, "kept": 0.95, "vs_greedy": 1.27}, "rlflow": {"improvement_pct": 1.0,
                                                                                     "kept": 0.5}}},
            {"graph": "bert seq=256", "trained": False, "nodes": 412, "initial_ms": 4.5, "greedy_pct": 1.75,
             "agents": {"model_free": {"improvement_pct": 3.9, "kept": 0.975}, "rlflow": {"improvement_pct": 1.9,
                                                                                      "kept": 0.95}}}]})
    write_json(res / "controller" / "temperature-0.5" / "metrics.json", controller_metrics(3.5))
    write_json(res / "controller" / "reward-delta" / "metrics.json",
               controller_metrics(4.75, rewards=(1.5, 2.5), reward="DeltaReward()"))
    write_json(res / "rollouts.json", {"format": "rlflow.rollouts/1", "model": model, "seed": 0,
                                       "stats": {"episodes": 200, "steps": 6170, "mean_length": 30.85},
                                       "episodes": [{"actions": [[0, 0]]}]})
    write_json(root / "results" / "rules" / "stats.json", {
        "format": 1, "graphs_enumerated": 148225, "candidates": 29012,
        "after_each_pruning_step": {"trivial": 13704, "renaming": 6235}, "verified": 1295,
        "generated_rules": 1163, "builtin_rules": 34, "final_rules": 1197, "seconds": {"total": 36.1}})
    return res


# -- running the stages through the CLI ------------------------------------------------------------------------
@pytest.fixture
def rlflow(monkeypatch, capsys):
    """``rlflow ...`` in-process (the stages registered whether or not cli.py lists them yet): (code, stderr)."""
    mods = list(cli.COMMAND_MODULES)
    for m in ("rlflow.stages.report", "rlflow.stages.summary"):
        if m not in mods:
            mods.append(m)
    monkeypatch.setattr(cli, "COMMAND_MODULES", mods)

    def run(*args: str) -> tuple[int, str]:
        code = cli.main([str(a) for a in args])
        return code, capsys.readouterr().err

    return run


def report_args(root: Path, out: Path, *sets: str, model: str = "bert") -> list[str]:
    args = ["report", "--model", model, "--results", root / "results" / model,
            "--rules-stats", root / "results" / "rules" / "stats.json", "--out", out]
    for s in sets:
        args += ["--set", s]
    return args


def section(html: str, sid: str) -> str:
    m = re.search(rf'<section id="{sid}">(.*?)</section>', html, re.S)
    assert m, f"no section {sid}"
    return m.group(1)


def text(fragment: str) -> str:
    """Visible text of an HTML fragment (tags dropped, entities undone)."""
    return unescape(re.sub(r"<[^>]+>", " ", fragment))


def assert_self_contained(html: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I)
    assert not re.search(r"<(script|link|iframe|object|embed)\b", html, re.I)
    assert "@import" not in html and "url(" not in html
    for src in re.findall(r'<img[^>]*\ssrc="([^"]*)"', html):
        assert src.startswith("data:image/svg+xml;base64,")
        svg = base64.b64decode(src.split(",", 1)[1])
        root = ET.fromstring(svg)  # a well-formed SVG document
        assert root.tag.endswith("svg")
        # inside the SVG too, every reference is internal ("#id" or data:); namespaces and the DTD are not fetched
        refs = re.findall(rb"""(?:href|src)\s*=\s*["']([^"']*)["']|url\(\s*['"]?([^)'"]*)""", svg)
        assert all(r.startswith((b"#", b"data:")) for pair in refs for r in pair if r), refs


# -- the report ------------------------------------------------------------------------------------------------
def test_report_has_every_section_the_inputs_numbers_and_is_self_contained(tmp_path, rlflow):
    make_results(tmp_path)
    out = tmp_path / "results" / "bert" / "report.html"
    code, err = rlflow(*report_args(tmp_path, out, "sweeps.temperatures=[0.5,1.0]", "sweeps.rewards=[delta]",
                                    "controller.temperature=1.5", "env.reward.name=weighted"))
    assert code == 0, err
    html = out.read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert_self_contained(html)
    # figures: 6, 7, 8, 9 (two: rewards, the ensemble's disagreement), 10, 5 (two) and the interactions bars
    assert len(re.findall(r"<img ", html)) == 9
    visible = text(html)
    for title in SECTION_TITLES:
        assert re.search(rf"<h2>{re.escape(title)}", html), title

    t2 = text(section(html, "table2"))
    # baseline: the original on TensorFlow 20 ms; RLFlow's graph 17.5 ms on tf: ratio 0.875 [0.865, 0.885]
    assert "20.000" in t2 and "17.500" in t2 and "+12.5% [+11.5%, +13.5%]" in t2
    assert "+42.5%" not in t2  # no cross-backend figure (RLFlow's graph on ort against the original on tf)
    assert "A/A control" in t2 and "+0.0% [-1.0%, +1.0%]" in t2
    assert ("faster than the original: TASO search, greedy, equality saturation, eqsat-rl (tree search), "
            "model-free PPO, RLFlow") in t2
    assert "+7.0% [+6.0%, +8.0%]" in t2  # eqsat-rl's graph on tf: 18.6 / 20
    assert "+6.0% [+5.0%, +7.0%]" in t2  # eqsat's graph on tf: 18.8 / 20
    assert "TOO NOISY" not in t2
    assert "+25.0%" in t2  # activation memory 8 -> 6 MB
    assert "+32.4%" in t2 and "+4.5%" in t2  # RLFlow's Table 2, BERT-Base
    f6 = text(section(html, "fig6"))
    assert "11.500 (IQR 0.500); ratio 0.920 [0.910, 0.930], faster" in f6 and "unsupported" in f6  # rlflow on tf-xla
    assert ("On onnxruntime, faster than the original: TASO search, greedy, equality saturation, eqsat-rl (tree "
            "search), model-free PPO, RLFlow (95% intervals).") in f6
    assert "18.600 (IQR 0.500); ratio 0.930 [0.920, 0.940], faster" in f6  # eqsat-rl on TensorFlow
    assert "18.800 (IQR 0.500); ratio 0.940 [0.930, 0.950], faster" in f6  # eqsat on TensorFlow
    assert "up to 16% more speedup than TASO" in f6  # Tensat
    assert "A/A control (original re-exported)" in f6
    assert "2.98" in f6  # the paper's RLFlow latency for BERT-Base
    f7 = text(section(html, "fig7"))
    assert "42.50" in f7 and "125.00" in f7 and "10.8" in f7  # TASO's time, RLFlow's training, the paper's TASO
    assert re.search(r"equality saturation\s+0\.85\s", f7)  # eqsat's optimisation time
    assert re.search(r"eqsat-rl \(tree search\)\s+2\.25\s", f7)  # eqsat-rl's, its tree search included
    assert ("eqsat-rl (tree search)'s graph 9.3000 ms, TASO's 9.5000 ms (+2.11% against TASO's; positive: cheaper); "
            "it took 2.25 s, TASO 42.50 s") in f7
    assert "48x less optimisation time" in f7  # Tensat's claim, then this run's eqsat against TASO (the traces)
    assert ("graph 9.4000 ms, TASO's 9.5000 ms (+1.05% against TASO's; positive: cheaper); it took 0.85 s, "
            "TASO 42.50 s") in f7
    f8 = text(section(html, "fig8"))
    assert "-1.25" in f8 and "0.9688" in f8
    assert "0.0425" in f8 and "0.03125" in f8  # the held-out reward error and false-change rate
    f9 = text(section(html, "fig9"))
    assert "ensemble's disagreement during the controller's training" in f9
    assert "+7.25%" in f9 and "+5.00%" in f9  # each agent's real improvement
    f10 = section(html, "fig10")
    assert "conv-relu" in f10 and "matmul-merge" in f10 and "add-const-fold" in f10
    assert re.search(r"<td>matmul-merge</td><td>1</td><td>0</td><td>0</td><td>3</td>", f10)  # no eqsat column
    assert "equality saturation and eqsat-rl (tree search) are not in this figure" in text(f10).lower()
    eg = text(section(html, "egraph"))
    assert "115 -> 2,513 (limit 50,000)" in eg and "115 -> 153" in eg and "6 (limit 15); stopped: saturated" in eg
    assert "34 of 34 translated; 5 multi-pattern, run in the first 1 iteration(s)" in eg
    assert "177 (98 unions; 0 rule bans by the backoff scheduler)" in eg
    assert "ilp (optimal; 600 variables, 1,009 constraints, 0.25 s)" in eg
    assert "10.0000 -> 9.4000 -> 9.4000" in eg and "input was kept" not in eg
    assert re.search(r"add-commutativity\s+42\s+matmul-merge\s+12", eg)
    assert "node limit 50,000; iterations 15" in eg and "+1.05% against TASO's" in eg
    # eqsat-rl beside it: the same rows, its schedule and its tree search
    head = re.search(r"<thead>(.*?)</thead>", section(html, "egraph"), re.S).group(1)
    assert "equality saturation" in head and "eqsat-rl (tree search)" in head
    assert "115 -> 3,001 (limit 50,000)" in eg and "7 (limit 15)" in eg
    assert "no:elementwise, all, all" in eg and "every rule in every iteration (the backoff scheduler)" in eg
    assert "16 schedules scored in 1.50 s; the best one's short-ILP cost 9.3000 ms" in eg
    assert "10.0000 -> 9.3000 -> 9.3000" in eg and "+2.11% against TASO's" in eg
    assert "ilp (Time limit reached (HiGHS status 13), gap 6.6% to its bound; 600 variables" in eg
    assert ("0.25 s; its 869 fused pairs and 72 three-node kernels priced as the target fuses them; the graph of "
            "extraction 2 kept)" in eg
            and eg.count("fused pairs") == 1)
    f5 = text(section(html, "fig5"))
    assert "weighted (main run)" in f5 and "delta" in f5 and "+4.75%" in f5
    t3 = text(section(html, "table3"))
    assert "0.5" in t3 and "+3.50%" in t3 and "1.5 (main run)" in t3 and "0.3330" in t3
    assert "temperature 1.0: Not run" in t3 and "stage sweep_temperature has not run" in t3
    assert "Best real improvement in this run: +7.25% at tau 1.5" in t3
    cost = text(section(html, "cost"))
    assert "15.0%" in cost  # rlflow on ort: |11.5 - 10| / 10
    assert "24.0%" in cost and "BERT" in cost  # X-RLflow's table
    roof = text(section(html, "roofline"))
    assert "GEMM 437 GFLOP/s, bandwidth 46 GB/s" in roof
    assert "20%" in roof and "13%" in roof  # the original: 1 - 10 / 12.5 on ort; RLFlow: 1 - 10 / 11.5 on ort
    assert roof.count("10.00") == 7  # one bound per graph (6 methods and the original), not the A/A control
    gen = text(section(html, "generalise"))
    assert "bert seq=64" in gen and "+3.80%" in gen and "0.95" in gen and "simulated H100" in gen
    assert "model-free PPO: kept at least 90% of its improvement on every variant" in gen
    assert "model-free PPO: x greedy's" in gen and "1.27" in gen
    assert "RLFlow: kept less than 90% of its improvement (or had none to keep) on: bert seq=64." in gen
    se = text(section(html, "sample"))
    assert "2,408" in se and "608" in se and "4,096" in se and "3.96x" in se
    assert "rollouts 600" in se
    assert ("the controller reached 145.0% of the model-free agent's improvement (+7.25% against +5.00%) with 25.2% "
            "of its real interactions (608 against 2,408). This run falls short: it used more than 25% of the "
            "model-free agent's real interactions.") in se
    assert "0.0123" in text(section(html, "encoder")) and "0.0456" in text(section(html, "encoder"))
    assert "6,170" in text(section(html, "rollouts"))
    rules = text(section(html, "rules"))
    assert "1,197" in rules and "29,012" in rules and "743" in rules
    cfg = text(section(html, "config"))
    assert "temperature: 1.5" in cfg and "temperatures: [0.5, 1.0]" in cfg and "zoo:" in cfg
    assert "onnxruntime" in cfg and "python" in cfg and "cpu" in visible
    assert "Not run" not in text(section(html, "fig8")) + text(section(html, "fig9"))


def test_report_says_which_stages_have_not_run(tmp_path, rlflow):
    res = tmp_path / "results" / "bert"
    write_evaluation(res, methods=("original", "taso"))
    out = tmp_path / "report.html"
    code, err = rlflow(*report_args(tmp_path, out))
    assert code == 0, err
    html = out.read_text()
    assert_self_contained(html)
    for title in SECTION_TITLES:
        assert re.search(rf"<h2>{re.escape(title)}", html), title
    assert ("Not evaluated: evaluation.csv has no row for A/A control (original re-exported), greedy, equality "
            "saturation, eqsat-rl (tree search), model-free PPO, RLFlow") in text(section(html, "table2"))
    assert "stage search_eqsat has not run" in text(section(html, "egraph"))
    assert "stage search_eqsat_rl has not run" in text(section(html, "egraph"))
    assert "stage train_world_model has not run" in text(section(html, "fig8"))
    assert "stage train_controller has not run" in text(section(html, "fig9"))
    f10 = text(section(html, "fig10"))
    assert "stage search_taso has not run" in f10 and "stage train_model_free has not run" in f10
    assert "sweeps.rewards is empty" in text(section(html, "fig5"))
    assert "sweeps.temperatures is empty" in text(section(html, "table3"))
    assert "stage train_encoder has not run" in text(section(html, "encoder"))
    assert "stage merge_rollouts has not run" in text(section(html, "rollouts"))
    assert "stage generate_rules has not run" in text(section(html, "rules"))
    assert "not run" in text(section(html, "sample"))
    assert "stage generalise has not run" in text(section(html, "generalise"))
    # what evaluation.csv has is still reported: the original on TensorFlow and TASO's graph
    assert "20.000" in text(section(html, "table2")) and "18.500" in text(section(html, "table2"))


@pytest.mark.parametrize("file, content, needle", [
    ("controller/metrics.json", "{not json", "not valid JSON (line 1: Expecting property name"),
    ("taso/trace.json", "[1, 2]", "expected a JSON object, found a list"),
    ("world_model/loss.csv", "epoch,loss\n", "a CSV without rows"),
    ("encoder/metrics.json", b"\xff\xfe\x00", "not text"),
    ("../rules/stats.json", "", "not valid JSON"),
])
def test_report_damaged_upstream_file_is_one_line_exit_2_and_no_output(tmp_path, rlflow, file, content, needle):
    """An upstream output that exists but cannot be read is an error naming it and its stage, not a report that
    quietly shows it as absent."""
    res = make_results(tmp_path)
    path = (res / file).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    out = res / "report.html"
    code, err = rlflow(*report_args(tmp_path, out))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"rlflow: error: {path}: ") and needle in lines[0], lines
    assert "it is written by stage " in lines[0]
    assert not out.exists() and not list(res.glob(".report.html.*"))


def test_report_temperature_ties_name_no_winner(tmp_path, rlflow):
    res = make_results(tmp_path)
    write_json(res / "controller" / "temperature-0.5" / "metrics.json", controller_metrics(7.25))
    out = tmp_path / "r.html"
    code, err = rlflow(*report_args(tmp_path, out, "sweeps.temperatures=[0.5]"))
    assert code == 0, err
    t3 = text(section(out.read_text(), "table3"))
    assert "Every temperature run gave the same real improvement (+7.25%)" in t3 and "Best real" not in t3


@pytest.mark.parametrize("damage, needle", [
    (lambda p: p.unlink(), "evaluation table not found"),
    (lambda p: p.write_text("model,method,backend\nbert,original,ort\n"), "lacks column(s)"),
    (lambda p: p.write_text(p.read_text().replace("12.5,", "fast,", 1)), "not a number"),
    (lambda p: p.write_text(",".join(EVAL_COLUMNS) + "\n"), "has no rows"),
])
def test_report_without_a_valid_evaluation_is_one_line_exit_2_and_no_output(tmp_path, rlflow, damage, needle):
    res = make_results(tmp_path)
    damage(res / "evaluation.csv")
    out = res / "report.html"
    code, err = rlflow(*report_args(tmp_path, out))
    assert code == 2
    assert needle in err and "evaluation.csv" in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not list(res.glob(".report.html.*"))


def test_report_evaluation_of_another_model_is_refused(tmp_path, rlflow):
    make_results(tmp_path)
    code, err = rlflow(*report_args(tmp_path, tmp_path / "r.html", model="vit"))
    assert code == 2 and not (tmp_path / "r.html").exists()
    write_evaluation(tmp_path / "results" / "vit", model="bert")
    code, err = rlflow(*report_args(tmp_path, tmp_path / "r.html", model="vit"))
    assert code == 2 and "for model 'bert', not 'vit'" in err


def test_report_too_noisy_backend_calls_no_difference(tmp_path, rlflow):
    """A backend whose A/A control failed: the report says so and no sentence calls a method faster or slower
    there; the other backends keep their verdicts."""
    res = make_results(tmp_path)
    write_evaluation(res, noisy=("tf",))
    out = res / "report.html"
    code, err = rlflow(*report_args(tmp_path, out))
    assert code == 0, err
    t2 = text(section(out.read_text(), "table2"))
    assert "TOO NOISY on TensorFlow" in t2 and "too noisy" in t2
    assert "faster than the original" not in t2 and "no method is reported faster or slower" in t2
    f6 = text(section(out.read_text(), "fig6"))
    assert "On onnxruntime, faster than the original" in f6
    assert "On TensorFlow the run was too noisy" in f6


# -- the summary --------------------------------------------------------------------------------------------------
def headline(model: str, rlflow_ms: float) -> dict:
    def cell(ms, ratio, verdict, finding=None):
        return {"latency_ms": ms, "ratio": ratio, "ci_low": None if ratio == 1 else ratio - HALF,
                "ci_high": None if ratio == 1 else ratio + HALF, "verdict": verdict, "finding": finding or verdict}

    sim = {"target": "sim-h100", "label": "simulated H100", "device": "cuda", "backend": None, "verifiable": False}
    here = {"target": "ort-cpu", "label": "onnxruntime CPU", "device": "cpu", "backend": "ort", "verifiable": True}
    aa = {"ort": cell(12.52, 1.0016, "no detectable difference"), "tf": cell(20.1, 1.005, "no detectable difference",
                                                                               "too noisy")}
    return {"format": "rlflow.evaluation-headline/3", "model": model, "device": "cpu",
            "too_noisy": {"ort": False, "tf": True},
            "methods": {
                "original": {"backends": {"ort": cell(12.5, 1, "reference"), "tf": cell(20.0, 1, "reference")},
                             "optimisation_s": None, "real_interactions": None, "speed_check": None,
                             "same_as_original": True},
                "original-aa": {"backends": aa, "same_as_original": True},
                "taso": {"backends": {"ort": cell(12.0, 0.96, "faster"), "tf": cell(18.5, 0.925, "faster", "too noisy")},
                         "optimisation_s": 42.5, "rules_applied": 3, "speed_check": None, "same_as_original": False,
                         "platform": sim, "estimate_ms": 9.5, "original_estimate_ms": 10.0},
                # greedy found nothing: its rows are the A/A control's
                "greedy": {"backends": aa, "optimisation_s": 3.25, "rules_applied": 0, "speed_check": None,
                           "same_as_original": True, "platform": sim, "estimate_ms": 10.0,
                           "original_estimate_ms": 10.0},
                "eqsat": {"backends": {"ort": cell(11.75, 0.94, "faster"),
                                       "tf": cell(18.0, 0.9, "faster", "too noisy")},
                          "optimisation_s": 0.85, "rules_applied": None, "speed_check": None, "same_as_original": False,
                          "platform": sim, "estimate_ms": 9.4, "original_estimate_ms": 10.0},
                "eqsat_rl": {"backends": {"ort": cell(11.875, 0.95, "faster"),
                                          "tf": cell(18.25, 0.9125, "faster", "too noisy")},
                             "optimisation_s": 2.25, "rules_applied": None, "speed_check": None,
                             "same_as_original": False, "platform": sim, "estimate_ms": 9.4,
                             "original_estimate_ms": 10.0},
                "rlflow": {"backends": {"ort": cell(rlflow_ms, rlflow_ms / 12.5, "faster"),
                                        "tf": cell(17.5, 0.875, "faster", "too noisy")},
                           "optimisation_s": 0.75, "real_interactions": 608, "speed_check": None,
                           "same_as_original": False, "platform": sim, "estimate_ms": 9.9,
                           "original_estimate_ms": 10.0},
                "eqsat_machine": {"backends": {"ort": cell(10.0, 0.8, "faster"),
                                               "tf": cell(21.0, 1.05, "slower", "too noisy")},
                                  "optimisation_s": 1.5, "speed_check": "kept optimised", "same_as_original": False,
                                  "platform": here, "estimate_ms": 8.0, "original_estimate_ms": 10.0},
            }}


def test_summary_over_two_models(tmp_path, rlflow):
    heads = tmp_path / "results" / "summary"
    write_json(heads / "vit.json", headline("vit", 9.25))
    write_json(heads / "bert.json", headline("bert", 11.5))
    csv_path, html_path = tmp_path / "results" / "summary.csv", tmp_path / "results" / "summary.html"
    code, err = rlflow("summary", "--set", "models=[bert,vit,resnet18]", "--headlines", heads, "--csv", csv_path,
                       "--out", html_path)
    assert code == 0, err
    rows = list(csv.DictReader(csv_path.open()))
    assert "best_backend" not in rows[0]
    assert [(r["model"], r["method"], r["backend"]) for r in rows] == [
        (m, x, b) for m in ("bert", "vit")
        for x in ("original", "original-aa", "taso", "greedy", "eqsat", "eqsat_rl", "rlflow", "eqsat_machine")
        for b in ("ort", "tf")]
    erl = {(r["model"], r["backend"]): r for r in rows if r["method"] == "eqsat_rl"}
    assert erl[("bert", "ort")]["ratio"] == "0.95" and erl[("vit", "tf")]["optimisation_s"] == "2.25"
    assert "eqsat-rl (tree search)" in html_path.read_text()
    eq = {(r["model"], r["backend"]): r for r in rows if r["method"] == "eqsat"}
    assert eq[("bert", "ort")]["ratio"] == "0.94" and eq[("bert", "ort")]["optimisation_s"] == "0.85"
    assert eq[("bert", "ort")]["rules_applied"] == ""  # no sequence of rewrites: it extracts from an e-graph
    rl = {(r["model"], r["backend"]): r for r in rows if r["method"] == "rlflow"}
    assert rl[("bert", "ort")]["latency_ms"] == "11.5" and rl[("vit", "ort")]["latency_ms"] == "9.25"
    assert rl[("bert", "ort")]["ratio"] == "0.92" and rl[("bert", "ort")]["ci_low"] == "0.91"
    assert rl[("bert", "tf")]["finding"] == "too noisy" and rl[("bert", "ort")]["finding"] == "faster"
    assert rl[("bert", "ort")]["real_interactions"] == "608" and rl[("bert", "ort")]["speed_check"] == ""
    assert rows[0]["optimisation_s"] == "" and rows[4]["rules_applied"] == "3"
    # each method keeps its own rows; the A/A control's figures only where the graph is the original, said so
    by = {(r["model"], r["method"], r["backend"]): r for r in rows}
    assert by[("bert", "greedy", "ort")]["ratio"] == by[("bert", "original-aa", "ort")]["ratio"] == "1.0016"
    assert by[("bert", "greedy", "ort")]["same_as_original"] == "True"
    assert by[("bert", "greedy", "ort")]["note"] == "graph is the original: these are the A/A control's figures"
    for m in ("taso", "eqsat", "rlflow", "eqsat_machine"):
        assert by[("bert", m, "ort")]["same_as_original"] == "False" and by[("bert", m, "ort")]["note"] == "", m
    assert by[("bert", "eqsat", "ort")]["target"] == "sim-h100"
    assert by[("bert", "eqsat_machine", "ort")]["target"] == "ort-cpu"
    html = html_path.read_text()
    assert_self_contained(html)
    assert '<a href="bert/report.html">bert</a>' in html and '<a href="vit/report.html">vit</a>' in html
    assert "9.250" in html and "0.920 [0.910, 0.930]" in html and "too noisy" in html
    assert "best backend" not in text(html).lower()
    assert not re.search(r"\bnan\b", text(html), re.I)  # the original's and the A/A control's empty cells
    # it leads with the answer per model and track
    assert html.index('<section id="answer">') < html.index("<table")
    lead = text(section(html, "answer"))
    assert re.search(r"bert\s+simulated H100 \(sim-h100\), not verifiable here\s+equality saturation\s+"
                     r"estimate 0\.940 of the original's, 0\.989 of TASO's\s+greedy\s", lead), lead
    assert re.search(r"bert\s+onnxruntime CPU \(ort-cpu\), verified on onnxruntime\s+equality saturation \(machine\)\s+"
                     r"onnxruntime 0\.800 \[0\.790, 0\.810\] faster\s", lead), lead
    # the table below: every method's own graph; no row for the A/A control or for greedy (its graph is the original)
    rest = html.split("</section>", 1)[1]
    cells = [[text(c).strip() for c in re.findall(r"<td>(.*?)</td>", tr)] for tr in re.findall(r"<tr>(.*?)</tr>", rest)]
    assert {c[2] for c in cells if c and c[0] == "bert"} == {
        "original", "TASO search", "equality saturation", "eqsat-rl (tree search)", "RLFlow",
        "equality saturation (machine)"}
    assert ["bert", "cpu", "equality saturation", "sim-h100", "onnxruntime", "11.750", "0.940 [0.930, 0.950]",
            "faster"] in [c[:8] for c in cells]
    assert ["bert", "cpu", "eqsat-rl (tree search)", "sim-h100", "onnxruntime", "11.875", "0.950 [0.940, 0.960]",
            "faster"] in [c[:8] for c in cells]
    assert "Not evaluated yet (no headline file): resnet18" in html


def test_summary_without_headlines_is_one_line_exit_2(tmp_path, rlflow):
    (tmp_path / "summary").mkdir()
    out = tmp_path / "summary.html"
    code, err = rlflow("summary", "--headlines", tmp_path / "summary", "--csv", tmp_path / "s.csv", "--out", out)
    assert code == 2 and "no <model>.json headline files" in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not (tmp_path / "s.csv").exists()
    (tmp_path / "summary" / "bert.json").write_text("[1, 2]")
    code, err = rlflow("summary", "--headlines", tmp_path / "summary", "--csv", tmp_path / "s.csv", "--out", out)
    assert code == 2 and "bert.json" in err and not out.exists()


@pytest.mark.parametrize("target", ["sim-h100", "ort-cpu"])
def test_report_estimate_on_the_target_beside_end_to_end(tmp_path, rlflow, target):
    res = make_results(tmp_path)
    doc = trace("taso")  # TASO's stage kept the original: its found graph was slower on onnxruntime
    doc["speed_check"] = {"backend": "ort", "ratio": 1.097, "ci_low": 1.012, "ci_high": 1.189, "verdict": "slower",
                          "kept": "original"}
    write_json(res / "taso" / "trace.json", doc)
    out = tmp_path / "results" / "bert" / "report.html"
    code, err = rlflow(*report_args(tmp_path, out, f"cost.target={target}"))
    assert code == 0, err
    html = out.read_text()
    assert re.search(r"<h2>Estimate on the cost target vs end to end", html)
    sec = text(section(html, "target"))
    label = "simulated H100" if target == "sim-h100" else "ort-cpu"
    assert f"estimate, {label} (ms)" in sec
    # TASO: estimate 9.5 / 10 = 0.950 beside the protocol's onnxruntime ratio 12.0 / 12.5 = 0.960 with its
    # interval and verdict; RLFlow on TF-XLA unsupported
    assert "0.950" in sec and "0.960 [0.950, 0.970] faster" in sec and "n/a" in sec
    assert "1 (reference)" in sec and "ratio [95% CI], verdict" in sec
    assert "1.097 [1.012, 1.189] slower on onnxruntime; kept the original" in sec  # the found graph's own verdict
    assert "BERT: cost model 1.0453 ms, end to end 1.1264 ms, difference 7.8%" in sec  # X-RLflow's line
    if target == "sim-h100":
        assert "no GPU ran it" in sec and "This run, the original graph" not in sec
    else:  # the original: |12.5 - 10| / 10 on onnxruntime
        assert "This run, the original graph on ort-cpu: onnxruntime 25.0%" in sec


# -- the answer: one headline, two tracks ---------------------------------------------------------------------------
SIM = {"target": "sim-h100", "label": "simulated H100", "device": "cuda", "backend": None, "verifiable": False}
HERE = {"target": "ort-cpu", "label": "onnxruntime CPU", "device": "cpu", "backend": "ort", "verifiable": True}
#: per method: same_as_original, the ratio on (ort, tf) (None: the A/A control's figures), the estimate (ms) on
#: its own target, its platform. TASO found nothing on either target; taso_machine's copied A/A row is made
#: deceptively fast, so a headline that ranked a copy of the A/A control would pick it.
TRACKS = {
    "original": (True, (1.0, 1.0), 10.0, None),
    "original-aa": (True, (0.998, 1.003), 10.0, None),
    "taso": (True, None, 10.0, SIM),
    "greedy": (False, (1.0, 0.99), 9.75, SIM),
    "eqsat": (False, (1.02, 0.96), 9.4, SIM),
    "taso_machine": (True, (0.7, 0.7), 8.5, HERE),
    "greedy_machine": (False, (0.98, 1.0), 7.8, HERE),
    "eqsat_machine": (False, (0.8, 1.05), 7.5, HERE),
}


def track_rows(model: str = "bert") -> list[dict]:
    """evaluation rows (as read_evaluation returns them) for TRACKS on ort and tf, intervals +/- HALF."""
    rows = []
    for m, (same, ratios, est, _) in TRACKS.items():
        for k, b in enumerate(("ort", "tf")):
            ratio = (ratios or TRACKS["original-aa"][1])[k]
            verdict = ("reference" if m == "original" else "faster" if ratio + HALF < 1 else "slower"
                       if ratio - HALF > 1 else "no detectable difference")
            rows.append({"model": model, "method": m, "backend": b, "device": "cpu", "status": "ok",
                         "latency_ms_median": (12.5, 20.0)[k] * ratio, "latency_ms_iqr": 0.5, "ratio": ratio,
                         "ci_low": None if m == "original" else ratio - HALF,
                         "ci_high": None if m == "original" else ratio + HALF, "verdict": verdict,
                         "too_noisy": False, "cost_ms": 10.0 if m in ("original", "original-aa") else est,
                         "speed_check": None, "same_as_original": same})
    return rows


def test_headline_picks_the_best_method_per_track_and_lists_what_found_nothing():
    from rlflow.report.headline import MACHINE, SIMULATED, build, track_sentences

    platforms = {m: p for m, (_, _, _, p) in TRACKS.items() if p}
    estimates = {m: (10.0 if p is SIM else 8.5, est) for m, (_, _, est, p) in TRACKS.items() if p}
    hl = build("bert", track_rows(), platforms, estimates)
    sim, here = hl.tracks
    assert (sim.kind, sim.platform.target, here.kind, here.platform.target, here.lead_backend) == (
        SIMULATED, "sim-h100", MACHINE, "ort-cpu", "ort")
    assert [m.method for m in sim.methods] == ["taso", "greedy", "eqsat"]
    assert [m.method for m in sim.found_nothing] == ["taso"]
    assert [m.method for m in here.found_nothing] == ["taso_machine"]
    # simulated: the lowest estimate; TASO found nothing, so "vs TASO" is against the original's estimate
    assert sim.best_estimate == "eqsat"
    eq = sim.method("eqsat")
    assert eq.estimate_ratio == pytest.approx(0.94) and eq.vs_taso == pytest.approx(0.94)
    assert sim.best == {"ort": None, "tf": "eqsat"}  # eqsat is slower on ort: no method of the track is faster there
    # machine: verified faster with the lowest ratio, never the copy of the A/A control (taso_machine's 0.7)
    assert here.best == {"ort": "eqsat_machine", "tf": None}
    assert here.best_estimate == "eqsat_machine" and here.method("eqsat_machine").vs_taso == pytest.approx(7.5 / 8.5)
    assert here.method("eqsat_machine").cells["ort"].text() == "0.800 [0.790, 0.810] faster"
    assert hl.same_as_original("taso") and not hl.same_as_original("eqsat")
    lines = " ".join(track_sentences(here))
    assert "onnxruntime (verifies the target): equality saturation (machine) 0.800 [0.790, 0.810] faster" in lines
    assert "Found nothing (their graph is the original): TASO search (machine)." in lines
    assert "Slower than the original: equality saturation (machine) on TensorFlow 1.050 [1.040, 1.060] slower" in lines
    assert here.method("taso_machine").why_original == "found nothing"
    # a graph the search improved whose export is the original's: its rewrites did not survive the export
    lost = build("bert", track_rows(), platforms, {**estimates, "taso_machine": (8.5, 8.0)})
    assert lost.method("taso_machine").one_line() == ("TASO search (machine): its rewrites do not survive the ONNX "
                                                      "export; its graph is the original")
    # without platform records: a target named sim-* is not verifiable, any other is
    bare = build("bert", track_rows(), {m: {"target": p["target"]} for m, p in platforms.items()}, estimates)
    assert [(t.kind, t.best_estimate, t.best["ort"]) for t in bare.tracks] == [
        (SIMULATED, "eqsat", None), (MACHINE, "eqsat_machine", "eqsat_machine")]


def write_tracks(res: Path) -> None:
    """evaluation.csv with the same_as_original column for TRACKS, and every method's trace with its platform."""
    rows = track_rows()
    with open(res / "evaluation.csv", "w", newline="") as f:
        w = csv.DictWriter(f, [*EVAL_COLUMNS, "same_as_original"])
        w.writeheader()
        for r in rows:
            full = dict.fromkeys(EVAL_COLUMNS, "")
            full.update({k: ("" if v is None else v) for k, v in r.items()}, nodes=100, activation_memory_mb=8.0,
                        max_rel_diff=1e-7, sessions=4, runs=40)
            w.writerow(full)
    for m, (_, _, est, p) in TRACKS.items():
        if p is None:
            continue
        base = m.removesuffix("_machine")
        doc = trace(base if base in COST_MS else "greedy")
        doc["final"]["runtime_ms"], doc["initial"]["runtime_ms"] = est, 10.0 if p is SIM else 8.5
        doc["platform"] = p
        write_json(res / ("machine/" + base if m.endswith("_machine") else FOLDER[base]) / "trace.json", doc)


def test_report_first_section_states_the_answer_and_a_method_without_a_graph_is_one_line(tmp_path, rlflow):
    res = make_results(tmp_path)
    write_tracks(res)
    out = res / "report.html"
    code, err = rlflow(*report_args(tmp_path, out))
    assert code == 0, err
    html = out.read_text()
    assert re.findall(r'<section id="([\w-]+)">', html)[:2] == ["answer", "how"]  # the answer leads
    ans = text(section(html, "answer"))
    assert ("Best on simulated H100 (the cost model's estimate; this machine cannot verify it): equality "
            "saturation, estimated cost 0.940 of the original's and 0.940 of TASO's.") in ans
    assert ("Its graph on this machine (latency ratio to the original [95% CI]): onnxruntime 1.020 [1.010, 1.030] "
            "slower") in ans
    assert ("Best verified (latency ratio to the original [95% CI]): onnxruntime (verifies the target): equality "
            "saturation (machine) 0.800 [0.790, 0.810] faster") in ans
    assert "TASO search: found nothing; its graph is the original" in ans
    assert "TASO search (machine): found nothing; its graph is the original" in ans
    assert "0.700" not in ans  # taso_machine's copy of the A/A control is no figure of its own
    # elsewhere too, a method whose graph is the original is one line, not a row copied from the A/A control
    for sid in ("answer", "fig6", "table2", "target"):
        body = section(html, sid)
        assert "<td>TASO search</td>" not in body and "<td>TASO search (machine)</td>" not in body, sid
        assert "TASO search: found nothing; its graph is the original" in text(body), sid
    assert "<td>equality saturation (machine)</td>" in section(html, "fig6")
    # every verdict sentence reads the same headline
    f6 = text(section(html, "fig6"))
    assert ("On onnxruntime, faster than the original: greedy (machine), equality saturation (machine); slower than "
            "the original: equality saturation; no detectable difference from the original: greedy (95% intervals); "
            "graph is the original (no comparison of its own): TASO search, TASO search (machine).") in f6
    assert "cost target" in html and "sim-h100 (simulated H100): simulated target, not verifiable on this machine" \
        in text(html)


def test_model_based_claim_is_checked_against_both_bounds(tmp_path):
    """The claim holds at >= 95% of the gain with <= 25% of the interactions; each bound alone can fail it, and
    a model-free agent with no improvement leaves nothing to compare."""
    from rlflow.config import load_config
    from rlflow.report.data import load_report_data
    from rlflow.report.tables import model_based_claim

    res = make_results(tmp_path)
    config = load_config([Path(__file__).resolve().parents[1] / "config.yaml"])

    def data():
        return load_report_data("bert", res, tmp_path / "results/rules/stats.json", config)

    cases = [(4.75, 602, True, True), (4.74, 602, False, True), (5.0, 603, True, False)]
    for ctl_pct, ctl_n, gain_ok, n_ok in cases:  # the model-free agent: +5.00%, 2,408 interactions
        doc = controller_metrics(ctl_pct)
        doc["real_interactions"]["total"] = ctl_n
        write_json(res / "controller" / "metrics.json", doc)
        claim = model_based_claim(data())
        assert (claim["gain_holds"], claim["interactions_hold"]) == (gain_ok, n_ok), (ctl_pct, ctl_n)
    mf = json.loads((res / "model_free" / "metrics.json").read_text())
    mf["real"]["improvement_pct"] = 0.0
    write_json(res / "model_free" / "metrics.json", mf)
    assert model_based_claim(data()) is None


def test_claim_sentence_says_how_much_of_the_controllers_run_its_world_model_planned(tmp_path):
    """controller.plan: the sentence names the kept episode's planned steps; a controller that did not plan (or a
    metrics.json from before planning) gets no such words."""
    from rlflow.config import load_config
    from rlflow.report.data import load_report_data
    from rlflow.report.render import _claim_sentence
    from rlflow.report.tables import model_based_claim

    res = make_results(tmp_path)
    config = load_config([Path(__file__).resolve().parents[1] / "config.yaml"])
    for plan, words in ((None, None), ({"min_saving": None, "planned_steps": 0, "episode_steps": 5}, None),
                        ({"min_saving": 1e-4, "planned_steps": 3, "episode_steps": 5}, "3 of the 5 steps")):
        doc = controller_metrics(4.9)
        if plan is not None:
            doc["plan"] = plan
        write_json(res / "controller" / "metrics.json", doc)
        sentence = _claim_sentence(model_based_claim(load_report_data("bert", res, tmp_path / "results/rules/stats.json",
                                                                      config)))
        assert ("planned one step ahead" in sentence) is (words is not None)
        assert words is None or words in sentence


def test_rules_section_lists_the_builtin_families_and_the_fused_kernels_only_when_on(tmp_path, rlflow):
    """The rule section lists stats.json's builtin families; the table of what each backend runs for Attention
    appears when the fused-kernel family is in the rule file, and not otherwise."""
    stats_path = tmp_path / "results" / "rules" / "stats.json"
    out = tmp_path / "results" / "bert" / "report.html"
    make_results(tmp_path)
    stats = json.loads(stats_path.read_text())
    for families, fused in (({"conv-relu": 2, "matmul-merge": 3}, False),
                            ({"attention-fuse": 18, "attention-unfuse": 2, "conv-relu": 2}, True)):
        write_json(stats_path, {**stats, "builtin_families": families})
        code, err = rlflow(*report_args(tmp_path, out))
        assert code == 0, err
        rules = text(section(out.read_text(), "rules"))
        assert f"Builtin rule families ({len(families)}, {sum(families.values())} rules)" in rules
        assert all(f in rules for f in families) and "builtin_families" not in rules
        assert ("scaled_dot_product_attention" in rules) is fused
        assert ("onnxruntime's own Attention kernel" in rules) is fused
