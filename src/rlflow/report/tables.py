"""The numbers of each table and figure, derived from the loaded files (no formatting, no HTML).

Every function takes :class:`rlflow.report.data.ReportData` parts and returns plain rows/dicts; a value the
inputs do not give is None. Percentages are "improvement": positive means faster / smaller than the baseline.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from rlflow.report import paper
from rlflow.report.data import AA, BACKEND_ORDER, METHOD_ORDER, Input, ReportData


def improvement_pct(base: float | None, new: float | None) -> float | None:
    """(base - new) / base x 100; None where either is missing or base is 0."""
    if base is None or new is None or base == 0:
        return None
    return (base - new) / base * 100.0


def ordered(values, order) -> list:
    """``values`` in ``order`` first, then any others sorted (so an unexpected method still shows)."""
    values = list(dict.fromkeys(values))
    return [v for v in order if v in values] + sorted(v for v in values if v not in order)


def methods(rows: list[dict]) -> list[str]:
    return ordered((r["method"] for r in rows), METHOD_ORDER)


def backends(rows: list[dict]) -> list[str]:
    return ordered((r["backend"] for r in rows), BACKEND_ORDER)


def cell(rows: list[dict], method: str, backend: str) -> dict | None:
    """The evaluation row of (method, backend), or None."""
    for r in rows:
        if r["method"] == method and r["backend"] == backend:
            return r
    return None


def ok_cell(rows: list[dict], method: str, backend: str) -> dict | None:
    r = cell(rows, method, backend)
    return r if r is not None and r["status"] == "ok" else None


TOO_NOISY = "too noisy"


def finding(r: dict | None) -> str:
    """What a row may be reported as: its verdict (faster / slower / no detectable difference), ``too noisy``
    when its backend's A/A control failed, ``reference`` for the original, empty when not compared."""
    if r is None or not r.get("verdict"):
        return ""
    return TOO_NOISY if r.get("too_noisy") and r["verdict"] != "reference" else r["verdict"]


def method_value(rows: list[dict], method: str, column: str) -> float | None:
    """A per-method column (optimisation_s, training_s, real_interactions, rules_applied, activation memory):
    the first row of the method that has it."""
    for r in rows:
        if r["method"] == method and r.get(column) is not None:
            return r[column]
    return None


# -- Table 2 ------------------------------------------------------------------------------------------------
def table2(rows: list[dict]) -> dict:
    """Improvement vs TensorFlow: TensorFlow (backend ``tf``) running the original graph against TensorFlow
    running the method's graph, from the same comparison of the measurement protocol, with the interval; and
    memory.

    Returns ``{"baseline_ms", "memory_kind", "rows": [{method, tf_ms, pct, pct_low, pct_high, finding,
    memory_mb, memory_pct}]}``; ``pct`` = 100 (1 - ratio), its interval from the ratio's. Memory: the measured
    peak on ``tf`` where the backend reported one for both graphs (CUDA), else the activation-memory estimate."""
    base = ok_cell(rows, "original", "tf")
    base_ms = base["latency_ms_median"] if base else None
    peak_base = base["peak_memory_mb"] if base else None
    act_base = method_value(rows, "original", "activation_memory_mb")
    use_peak = peak_base is not None and all(
        (ok_cell(rows, m, "tf") or {}).get("peak_memory_mb") is not None for m in methods(rows))
    out = []
    for m in methods(rows):
        tf = ok_cell(rows, m, "tf")
        ratio, lo, hi = ((tf or {}).get(k) for k in ("ratio", "ci_low", "ci_high"))
        if use_peak:
            mem, mem_base = (tf or {}).get("peak_memory_mb"), peak_base
        else:
            mem, mem_base = method_value(rows, m, "activation_memory_mb"), act_base
        out.append({"method": m, "tf_ms": tf["latency_ms_median"] if tf else None,
                    "pct": None if ratio is None or m == "original" else 100 * (1 - ratio),
                    "pct_low": None if hi is None else 100 * (1 - hi),
                    "pct_high": None if lo is None else 100 * (1 - lo),
                    "finding": finding(tf), "memory_mb": mem, "memory_pct": improvement_pct(mem_base, mem)})
    return {"baseline_ms": base_ms, "memory_kind": "peak" if use_peak else "activation", "rows": out}


# -- Fig. 6 -------------------------------------------------------------------------------------------------
def latency_grid(rows: list[dict]) -> dict:
    """``{"methods", "backends", "cells": {(method, backend): row or None}}`` for the runtime figure/table."""
    ms, bs = methods(rows), backends(rows)
    return {"methods": ms, "backends": bs, "cells": {(m, b): cell(rows, m, b) for m in ms for b in bs}}


# -- Fig. 7 -------------------------------------------------------------------------------------------------
def optimisation_times(data: ReportData) -> list[dict]:
    """Per optimising method: optimisation seconds (the search, or the trained agent's run) and training seconds
    (RL agents), from evaluation.csv, else from the method's trace."""
    out = []
    for m in methods(data.evaluation):
        if m in ("original", AA):
            continue
        opt = method_value(data.evaluation, m, "optimisation_s")
        train = method_value(data.evaluation, m, "training_s")
        source = "evaluation.csv"
        tr = data.traces.get(m)
        if opt is None and tr is not None and tr.ok and _num(tr.data.get("seconds")) is not None:
            opt, source = _num(tr.data.get("seconds")), "trace.json"
        if train is None and tr is not None and tr.ok:
            train = _num(tr.data.get("training_seconds"))
        out.append({"method": m, "optimisation_s": opt, "training_s": train, "source": source})
    return out


# -- Fig. 10 ------------------------------------------------------------------------------------------------
def rules_applied(traces: dict[str, Input]) -> dict:
    """Which rules each method's trace applied: ``{"methods": [...], "rules": [label, ...], "counts":
    {(label, method): n}, "missing": {method: Input}}``; rules ordered by total uses, then name."""
    counts: Counter = Counter()
    names: dict[str, str] = {}
    present, missing = [], {}
    for m, tr in traces.items():
        if not tr.ok or not isinstance(tr.data.get("steps"), list):
            missing[m] = tr
            continue
        present.append(m)
        for s in tr.data["steps"]:
            if not isinstance(s, dict):
                continue
            rid = str(s.get("rule_id", "?"))
            names.setdefault(rid, str(s.get("rule_name") or rid))
            counts[(rid, m)] += 1
    label = {}
    for rid, name in names.items():
        clash = sum(1 for n in names.values() if n == name) > 1
        label[rid] = f"{name} [{rid}]" if clash else name
    totals = Counter()
    for (rid, _), n in counts.items():
        totals[rid] += n
    rids = sorted(totals, key=lambda r: (-totals[r], label[r]))
    return {"methods": present, "rules": [label[r] for r in rids],
            "counts": {(label[rid], m): n for (rid, m), n in counts.items()}, "missing": missing}


# -- equality saturation ------------------------------------------------------------------------------------
#: the figures of eqsat's trace ``stats`` the report shows (rlflow.search.eqsat.eqsat_search)
EGRAPH_COUNTS = ("egraph_nodes_initial", "egraph_nodes", "egraph_classes_initial", "egraph_classes", "iterations",
                 "rules", "rules_translated", "multi_pattern_rules", "matches", "applied", "merges", "match_cap_hits",
                 "cycle_enodes_removed", "filtered",
                 "saturation_seconds", "extraction_seconds", "ilp_variables", "ilp_constraints", "ilp_seconds",
                 "ilp_fusion_pairs", "ilp_fusion_triples", "extraction_cheapest_round", "extracted_cost_ms")


def egraph(eqsat: Input, taso: Input) -> dict:
    """eqsat's (or eqsat-rl's) e-graph and extraction from its trace: ``{"counts": {EGRAPH_COUNTS key: number or
    None}, "settings", "stop", "extraction", "ilp_optimal", "ilp_message", "ilp_gap" (relative; None if unknown),
    "kept_input", "rules_fired": [(rule, n)] (most first), "initial_ms", "final_ms", "seconds", "schedule": [action
    per iteration] (eqsat-rl; empty for eqsat), "tree": {"leaves", "seconds", "best_proxy_ms"} (eqsat-rl's tree
    search; None each without one)}``,
    plus TASO's ``taso_final_ms`` and ``taso_seconds`` from its trace (None if absent): the run's own
    eqsat-vs-TASO comparison on the same cost target."""
    doc = eqsat.data
    stats = doc.get("stats") if isinstance(doc.get("stats"), dict) else {}
    fired = stats.get("rules_fired") if isinstance(stats.get("rules_fired"), dict) else {}
    tdoc = taso.data if taso.ok else {}
    return {"counts": {k: _num(stats.get(k)) for k in EGRAPH_COUNTS},
            "settings": doc.get("settings") if isinstance(doc.get("settings"), dict) else {},
            "stop": doc.get("stop_reason"), "extraction": stats.get("extraction"),
            "ilp_optimal": stats.get("ilp_optimal"), "ilp_message": stats.get("ilp_message"),
            "ilp_gap": _num(stats.get("ilp_gap")), "kept_input": stats.get("kept_input"),
            "rules_fired": sorted(((str(r), n) for r, n in fired.items() if _num(n) is not None),
                                  key=lambda x: (-x[1], x[0])),
            "initial_ms": _cost(doc, "initial"), "final_ms": _cost(doc, "final"), "seconds": _num(doc.get("seconds")),
            "taso_final_ms": _cost(tdoc, "final"), "taso_seconds": _num(tdoc.get("seconds")),
            "schedule": [str(a) for a in stats.get("schedule") or [] if isinstance(a, str)],
            "tree": {"leaves": _num(stats.get("tree_simulations")), "seconds": _num(stats.get("tree_seconds")),
                     "best_proxy_ms": _num(stats.get("tree_best_proxy_ms"))}}


def _cost(doc: dict, key: str) -> float | None:
    """A trace's cost-model runtime of its ``initial`` or ``final`` graph."""
    sub = doc.get(key)
    return _num(sub.get("runtime_ms")) if isinstance(sub, dict) else None


# -- cost model vs end to end -------------------------------------------------------------------------------
def cost_discrepancy(rows: list[dict]) -> dict:
    """Per (method, backend) with both figures: cost-model estimate, measured latency and X-RLflow's
    difference |E2E - cost| / cost x 100; plus the mean difference per backend."""
    out, per_backend = [], {}
    for m in methods(rows):
        for b in backends(rows):
            r = ok_cell(rows, m, b)
            if r is None or r["cost_ms"] is None or not r["cost_ms"]:
                continue
            diff = abs(r["latency_ms_median"] - r["cost_ms"]) / r["cost_ms"] * 100.0
            out.append({"method": m, "backend": b, "cost_ms": r["cost_ms"], "e2e_ms": r["latency_ms_median"],
                        "diff_pct": diff})
            per_backend.setdefault(b, []).append(diff)
    means = {b: sum(v) / len(v) for b, v in per_backend.items()}
    return {"rows": out, "mean_by_backend": means}


# -- sample efficiency ----------------------------------------------------------------------------------------
def sample_efficiency(data: ReportData) -> list[dict]:
    """Real-environment interactions per agent: from the agent's metrics.json (with the breakdown), else the
    evaluation table or its trace; plus the dream steps (RLFlow) that cost no real interaction."""
    out = []
    for method, inp in (("model_free", data.model_free), ("rlflow", data.controller)):
        total, parts, source = None, {}, None
        if inp.ok and isinstance(inp.data.get("real_interactions"), dict):
            ri = inp.data["real_interactions"]
            total = _num(ri.get("total"))
            parts = {k: v for k, v in ri.items() if k != "total" and _num(v) is not None}
            source = str(inp.path)
        elif inp.ok and _num(inp.data.get("real_interactions")) is not None:
            total, source = _num(inp.data.get("real_interactions")), str(inp.path)
        if total is None:
            v = method_value(data.evaluation, method, "real_interactions")
            if v is not None:
                total, source = v, "evaluation.csv"
        if total is None:
            tr = data.traces.get(method)
            ri = tr.data.get("real_interactions") if tr is not None and tr.ok else None
            v = _num(ri.get("total")) if isinstance(ri, dict) else _num(ri)
            if v is not None:
                total, source = v, str(tr.path)
        dream = _num(inp.data.get("dream_steps")) if inp.ok else None
        out.append({"method": method, "total": total, "parts": parts, "dream_steps": dream, "source": source,
                    "input": inp})
    return out


def model_based_claim(data: ReportData) -> dict | None:
    """RLFlow's claim on this run: the controller's improvement as a share of the model-free agent's, and its real
    interactions as a share of the model-free agent's, each against the claim's bound (paper.CLAIM_*). None
    when either agent has not run, or the model-free agent found no improvement to share."""
    gain = {m: real_run(inp).get("improvement_pct") for m, inp in (("model_free", data.model_free),
                                                                      ("rlflow", data.controller))}
    inter = {r["method"]: r["total"] for r in sample_efficiency(data)}
    if None in gain.values() or not inter.get("model_free") or inter.get("rlflow") is None:
        return None
    if gain["model_free"] <= 0:
        return None
    out = {"gain_pct": gain, "interactions": inter, "gain_share": gain["rlflow"] / gain["model_free"],
           "interaction_share": inter["rlflow"] / inter["model_free"]}
    out["gain_holds"] = out["gain_share"] >= paper.CLAIM_MIN_GAIN_SHARE
    out["interactions_hold"] = out["interaction_share"] <= paper.CLAIM_MAX_INTERACTION_SHARE
    plan = data.controller.data.get("plan") if data.controller.ok else None
    out["plan"] = plan if isinstance(plan, dict) and plan.get("min_saving") is not None else None
    return out


# -- learning curves and sweeps -------------------------------------------------------------------------------
def reward_curve(inp: Input, key: str = "mean_reward") -> tuple[list[float], list[float]]:
    """(update, value of ``key``) per PPO update from an agent's metrics.json ``curve`` (updates without it are
    left out): the mean reward, or e.g. the ensemble's ``disagreement``."""
    xs, ys = [], []
    if inp.ok and isinstance(inp.data.get("curve"), list):
        for i, c in enumerate(inp.data["curve"]):
            if isinstance(c, dict) and _num(c.get(key)) is not None:
                xs.append(_num(c.get("update")) or i + 1)
                ys.append(_num(c[key]))
    return xs, ys


def real_run(inp: Input) -> dict:
    """The agent's run in the real environment (metrics.json ``real``): initial and best cost-model runtime,
    improvement %, steps."""
    real = inp.data.get("real") if inp.ok else None
    if not isinstance(real, dict):
        return {}
    return {"initial_ms": _num((real.get("initial") or {}).get("runtime_ms")),
            "best_ms": _num((real.get("best") or {}).get("runtime_ms")),
            "improvement_pct": _num(real.get("improvement_pct")), "steps": _num(real.get("steps")),
            "best_step": _num(real.get("best_step"))}


def sweep_row(label: Any, inp: Input, main: bool = False) -> dict:
    """One controller run of a sweep: its real-run figures, its final dream reward and interactions."""
    _, ys = reward_curve(inp)
    ri = inp.data.get("real_interactions") if inp.ok else None
    return {"label": label, "main": main, "input": inp, **real_run(inp),
            "final_dream_reward": ys[-1] if ys else None,
            "real_interactions": _num(ri.get("total")) if isinstance(ri, dict) else _num(ri)}


def temperature_rows(data: ReportData) -> list[dict]:
    """Table 3: every configured sweep temperature, plus the main controller run at controller.temperature."""
    main_tau = _num((data.config.get("controller") or {}).get("temperature"))
    rows = [sweep_row(tau, inp) for tau, inp in data.temperatures]
    rows.append(sweep_row(main_tau, data.controller, main=True))
    return sorted(rows, key=lambda r: (r["label"] is None, r["label"] or 0.0, r["main"]))


def reward_rows(data: ReportData) -> list[dict]:
    """Fig. 5: the main run (env.reward.name) and every configured sweep reward."""
    main = str(((data.config.get("env") or {}).get("reward") or {}).get("name", "?"))
    return [sweep_row(main, data.controller, main=True), *(sweep_row(n, inp) for n, inp in data.rewards)]


def flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested dicts as (dotted key, leaf) pairs in document order; lists of scalars are kept as leaves."""
    out: list[tuple[str, Any]] = []
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out += flatten(v, key)
            elif not isinstance(v, (list, dict)) or all(not isinstance(x, (list, dict)) for x in v):
                out.append((key, v))
    return out


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if v == v and abs(v) != float("inf") else None
