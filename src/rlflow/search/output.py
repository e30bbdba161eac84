"""Running a search method and writing its result, shared by the stages ``search-taso`` / ``search-greedy`` and
the user command ``rlflow optimize``: the optimised graph is checked equal to the original under onnxruntime
before anything is written; then the ONNX file and the trace JSON are each written atomically."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from rlflow.errors import RLFlowError
from rlflow.graph.ir import Graph
from rlflow.search.result import SearchResult

#: largest allowed output difference (relative to the output's magnitude) between original and optimised graph
TOLERANCE = 1e-4


def run_method(method: str, graph: Graph, rules: Sequence, cost, alpha: float = 1.05, budget: int = 1000,
               time_limit_s: float = 0, progress: bool = False, eqsat: dict[str, Any] | None = None,
               policy: str | Path | None = None) -> SearchResult:
    """``taso``, ``greedy``, ``eqsat`` or ``eqsat-rl`` on ``graph`` (greedy ignores alpha and budget; eqsat and
    eqsat-rl take their settings, the config's ``eqsat`` section, from ``eqsat`` and ignore the others;
    eqsat-rl: the schedule policy file ``policy`` (:class:`rlflow.search.eqsat_rl.LinearPolicy`), else the tree
    search over schedules, with ``eqsat["rl_leaves"]`` leaves if given)."""
    if method == "taso":
        from rlflow.search.taso import taso_search

        return taso_search(graph, rules, cost, alpha=alpha, budget=budget, time_limit_s=time_limit_s,
                           progress=progress)
    if method == "greedy":
        from rlflow.search.greedy import greedy_search

        return greedy_search(graph, rules, cost, time_limit_s=time_limit_s, progress=progress)
    if method == "eqsat":
        from rlflow.search.eqsat import eqsat_search

        return eqsat_search(graph, rules, cost, **(eqsat or {}))
    if method == "eqsat-rl":
        from rlflow.search.eqsat_rl import EqsatBudget, LinearPolicy, eqsat_rl_search, tree_search

        settings = dict(eqsat or {})
        extraction = settings.pop("extraction", "ilp")
        leaves = settings.pop("rl_leaves", None)
        budget = EqsatBudget(**settings)
        if policy is None:
            return tree_search(graph, rules, cost, budget, extraction=extraction,
                               **({} if leaves is None else {"simulations": int(leaves)}))
        return eqsat_rl_search(graph, rules, cost, LinearPolicy.load(policy), budget, extraction=extraction)
    raise RLFlowError(f"unknown search method '{method}' (choose from taso, greedy, eqsat, eqsat-rl)")


def verify_and_write(original: Graph, result: SearchResult, out: Path, trace: Path | None, extra: dict[str, Any],
                     seed: int = 0, device: str = "cpu", tol: float = TOLERANCE,
                     speed_check: Callable[[Graph, Graph], dict] | None = None,
                     log: Callable[[str], None] = print) -> tuple[float, dict]:
    """:func:`verify_and_choose`, then write the graph chosen to ``out`` and, if given, the trace document to
    ``trace``; nothing is written if the check fails. Returns (difference, trace doc)."""
    from rlflow.atomic import write_text
    from rlflow.graph.onnx_io import save_onnx

    for p in (out, trace):
        if p is not None and p.is_dir():
            raise RLFlowError(f"{p}: is a folder, expected a file path")
    graph, diff, doc = verify_and_choose(original, result, extra, seed, device, tol, speed_check, log,
                                         not_written=f"{out} not written")
    save_onnx(graph, out)
    if trace is not None:
        write_text(trace, json.dumps(doc, indent=1) + "\n")
    return diff, doc


def verify_and_choose(original: Graph, result: SearchResult, extra: dict[str, Any], seed: int = 0,
                      device: str = "cpu", tol: float = TOLERANCE,
                      speed_check: Callable[[Graph, Graph], dict] | None = None,
                      log: Callable[[str], None] = print, not_written: str | None = None
                      ) -> tuple[Graph, float, dict]:
    """Check ``result.graph`` against ``original`` (RLFlowError if it differs), then choose the graph to keep.
    Returns (graph, largest relative difference, trace doc: ``result.to_json(**extra)`` plus ``max_rel_diff``).

    ``speed_check(original, optimised)`` (the never-slower check; the callers above this floor pass
    :func:`rlflow.evaluation.protocol.never_slower`) returns a record with ``kept`` (``optimised`` |
    ``original``) and a one-line ``line``: the record goes into the trace as ``speed_check``, the line to
    ``log``, and when it says ``original`` the ORIGINAL graph is the one chosen. ``not_written`` ends the
    message of a failed equality check (``out.onnx not written``)."""
    from rlflow.graph.exec.check import check_equal

    try:
        diff = check_equal(original, result.graph, seed=seed, tol=tol, device=device,
                           what=str(extra.get("model", "the original model")))
    except RLFlowError as e:
        if not_written is None:
            raise
        raise RLFlowError(f"{e}; {not_written}") from None
    doc = result.to_json(**extra)
    doc["max_rel_diff"] = diff
    doc["tolerance"] = tol
    graph = result.graph
    if speed_check is not None:
        doc["speed_check"] = record = speed_check(original, result.graph)
        log(record["line"])
        if record["kept"] == "original":
            graph = original
    return graph, diff, doc


def summary(result: SearchResult, diff: float, label: str) -> str:
    """A few lines for the terminal."""
    r = result
    if r.method.startswith("eqsat"):
        s = r.stats
        schedule = [] if "schedule" not in s else [
            f"{label}: schedule ({r.method}): {', '.join(s['schedule'])}"
            + (f"; tree search {s['tree_simulations']} leaves in {s['tree_seconds']:.1f} s" if "tree_seconds" in s
               else "")]
        return "\n".join([
            f"{label}: cost {r.initial.runtime_ms:.4f} -> {r.final.runtime_ms:.4f} ms ({r.speedup:.3f}x), "
            f"nodes {r.nodes_before} -> {r.nodes_after}" + (" (extraction cost more: input kept)" if s["kept_input"] else ""),
            f"{label}: e-graph {s['egraph_nodes_initial']} -> {s['egraph_nodes']} e-nodes, {s['egraph_classes']} "
            f"e-classes after {s['iterations']} iterations (stopped: {r.stop_reason}), {s['applied']} matches applied "
            f"({s['rules_translated']} of {s['rules']} rules translated, {s['multi_pattern_rules']} multi-pattern), "
            f"{s['saturation_seconds']:.1f} s",
            f"{label}: extraction {s['extraction']}" + (f" ({ilp_verdict(s)}, "
                                                         f"{s['ilp_variables']} variables{_pairs(s)})"
                                                         if "ilp_variables" in s else "")
            + f" {s['extraction_seconds']:.1f} s; {r.seconds:.1f} s in all; max output difference {diff:.2e}"] + schedule)
    lines = [
        f"{label}: cost {r.initial.runtime_ms:.4f} -> {r.final.runtime_ms:.4f} ms ({r.speedup:.3f}x), "
        f"nodes {r.nodes_before} -> {r.nodes_after}, {len(r.trace)} rewrites applied",
        f"{label}: {r.expansions} graphs expanded, {r.generated} candidates ({r.kept} kept) in {r.seconds:.1f} s "
        f"({r.ms_per_expansion:.1f} ms per expansion; stopped: {r.stop_reason}); max output difference {diff:.2e}",
    ]
    return "\n".join(lines + rules_line(r, label))


def rules_line(result: SearchResult, label: str) -> list[str]:
    """The rules a result applied, in first-use order with their counts, as one line (none if it applied none)."""
    names: dict[str, int] = {}
    for step in result.trace:
        names[step.rule_name] = names.get(step.rule_name, 0) + 1
    if not names:
        return []
    return [f"{label}: rules: " + ", ".join(f"{n} x{c}" if c > 1 else n for n, c in names.items())]


def ilp_verdict(stats: dict) -> str:
    """``optimal``, or why eqsat's last ILP stopped before proving its answer and how far its answer may be from
    the optimum: ``Time limit reached (HiGHS status 13), gap 6.6% to its bound``."""
    if stats.get("ilp_optimal"):
        return "optimal"
    gap = stats.get("ilp_gap")
    shown = isinstance(gap, (int, float)) and 0 < gap < float("inf")
    return (stats.get("ilp_message") or "not optimal") + (f", gap {100 * gap:.1f}% to its bound" if shown else "")


def _pairs(stats: dict) -> str:
    """``, 869 fused pairs and 72 three-node kernels priced; the graph of extraction 2 kept`` where eqsat's last
    ILP priced fused kernels, else ``""``."""
    n = stats.get("ilp_fusion_pairs") or 0
    return (f", {n} fused pairs and {stats.get('ilp_fusion_triples') or 0} three-node kernels priced; the graph of "
            f"extraction {stats.get('extraction_cheapest_round')} kept") if n else ""
