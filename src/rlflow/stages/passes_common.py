"""What the XLA pass-ordering evaluation stages share (evaluate_passes on a model's module, evaluate_passes_suite
on the HLO suite's held-out modules): every method on one module, its XLA CPU timing and the choice of an agent's
module by latency, the CSV rows."""

from __future__ import annotations

import time
from pathlib import Path

def _log(line: str) -> None:
    """Progress lines of the functions below (``log``: another stage's own prefix)."""
    print(f"evaluate_passes: {line}", flush=True)


CSV_COLUMNS = ("model", "method", "ops", "initial_ops", "reduction", "ratio_vs_default", "passes_run", "seconds",
               "runtime_ratio", "runtime_ci_low", "runtime_ci_high", "runtime_verdict", "max_rel_diff",
               "latency_choice")
AA_NAME = "xla_default-aa"


def to_csv(doc: dict) -> str:
    lines = [",".join(CSV_COLUMNS)]
    for m in doc["methods"]:
        rt = m.get("runtime") or {}
        row = {**m, "model": doc["model"], "initial_ops": doc["initial_ops"], "passes_run": len(m["passes"]),
               "runtime_ratio": rt.get("ratio"), "runtime_ci_low": rt.get("ci_low"),
               "runtime_ci_high": rt.get("ci_high"),
               "runtime_verdict": rt.get("verdict"), "max_rel_diff": rt.get("max_rel_diff"),
               "latency_choice": (m.get("selection") or {}).get("chosen")}
        lines.append(",".join("" if row[c] is None else (f"{row[c]:.6g}" if isinstance(row[c], float) else str(row[c]))
                              for c in CSV_COLUMNS))
    return "\n".join(lines) + "\n"


def select_by_latency(config: dict, timer, disabled: list[str], texts: dict[str, str], method: dict,
                      candidates: list[dict], model: str, budget_s: float, log=None) -> None:
    """The agent's final module, chosen by measured latency among its candidates and XLA's default pipeline's
    module (:func:`rlflow.xla.timing.choose_by_latency`, protocol ``timing`` with ``budget_s`` seconds): sets ``texts[method]`` (what the runtime comparison times) and the method's ``selection``."""
    from rlflow.config import get
    from rlflow.evaluation.protocol import Protocol
    from rlflow.xla.hlo import histogram, parse
    from rlflow.xla.timing import choose_by_latency

    protocol = Protocol.from_config(config, budget_s=budget_s)
    name = method["method"]
    choice = choose_by_latency(timer, texts["xla_default"], [(c["name"], c["text"]) for c in candidates], protocol,
                               disabled, int(get(config, "seed")), float(get(config, "evaluate.tolerance")))
    chosen = next((c for c in candidates if c["name"] == choice["chosen"]), None)
    texts[name] = texts["xla_default"] if chosen is None else chosen["text"]
    timed = choice["candidates"]  # name -> ratio, interval, verdict (a candidate equal to the default: absent)
    rows = []
    for c in candidates:
        row = {"name": c["name"], "ops": c["ops"], "passes": c["passes"]}
        row.update(timed.get(c["name"], {"same_as": "xla_default"}))
        rows.append(row)
    method["selection"] = {
        "chosen": choice["chosen"], "protocol": protocol.describe(),
        "final_ops": float(sum(histogram(parse(texts[name])).values())),
        "final_passes": chosen["passes"] if chosen else ["<XLA default pipeline>"], "candidates": rows}
    seen = ", ".join(f"{n} {e['ratio']:.3f} {e['verdict']}" for n, e in timed.items())
    (log or _log)(f"{model} {name}: final module by latency: {choice['chosen']} "
                  f"(candidates vs XLA default: {seen or 'all equal to it'})")


def time_methods(config: dict, timer, disabled: list[str], texts: dict[str, str], methods: list[dict],
                 model: str, budget_s: float, log=None) -> dict:
    """Time the methods' modules on XLA CPU against XLA's default one (:mod:`rlflow.xla.timing`, in ``timer``);
    adds each method's ``runtime`` entry and returns the comparison's summary (protocol, A/A control, too
    noisy). A method whose module is the default's own (an agent whose choice by latency fell back to it) is not
    timed again: timing a module against itself is the A/A control's job, and under another name its false
    positives would read as verdicts; its entry is the default's, ratio 1, ``same_as: xla_default``."""
    from rlflow.config import get
    from rlflow.errors import RLFlowError
    from rlflow.evaluation.protocol import SAME, Protocol

    protocol = Protocol.from_config(config, budget_s=budget_s)
    same = {m["method"] for m in methods if m["method"] != "xla_default"
            and texts.get(m["method"]) == texts["xla_default"]}
    order = ["xla_default", AA_NAME] + [m["method"] for m in methods if m["method"] != "xla_default"
                                        and m["method"] in texts and m["method"] not in same]
    modules = [(n, texts["xla_default" if n == AA_NAME else n]) for n in order]
    (log or _log)(f"{model}: timing {len(modules)} modules on XLA CPU ({protocol.describe()})")
    result = timer.time(modules, protocol, disabled, seed=int(get(config, "seed")))
    tolerance = float(get(config, "evaluate.tolerance"))
    default_ms = result["estimates"]["xla_default"]["median_ms"]
    for m in methods:
        if m["method"] in same:
            m["runtime"] = {"ratio": 1.0, "ci_low": 1.0, "ci_high": 1.0, "verdict": SAME, "detectable": None,
                            "median_ms": default_ms, "max_rel_diff": 0.0, "same_as": "xla_default"}
            (log or _log)(f"{model} {m['method']}: XLA default's own module (not timed again)")
            continue
        est = result["estimates"].get(m["method"])
        if est is None:
            continue
        diff = result["max_rel_diff"][m["method"]]
        if not diff <= tolerance:
            raise RLFlowError(f"{model}: the module of {m['method']} computes other outputs than XLA's default "
                              f"pipeline's (max relative difference {diff:.3g} > evaluate.tolerance {tolerance:g})")
        m["runtime"] = {k: est[k] for k in ("ratio", "ci_low", "ci_high", "verdict", "detectable", "median_ms")}
        m["runtime"]["max_rel_diff"] = diff
        vs = "the reference" if est["ci_low"] is None else \
            f"{est['ratio']:.3f} [{est['ci_low']:.3f}, {est['ci_high']:.3f}] of it, {est['verdict']}"
        (log or _log)(f"{model} {m['method']}: XLA CPU median {est['median_ms']:.3f} ms, {vs}")
    aa = result["estimates"][AA_NAME]
    return {"backend": "xla-cpu", "reference": "xla_default", "protocol": protocol.describe(),
            "aa": {k: aa[k] for k in ("ratio", "ci_low", "ci_high", "verdict")}, "too_noisy": aa["verdict"] != SAME,
            "rounds": result["rounds"], "seconds": result["seconds"], "disabled_passes": disabled}


def trained_on(x: dict) -> list[str]:
    """What the pass agents trained on, from the config's ``xla`` section: the suite's training families
    (``train_on: suite``) or ``train_models``."""
    return list(x["suite"]["train_families"]) if x["train_on"] == "suite" else list(x["train_models"])


def load_agents(config: dict, agents_dir) -> dict:
    """The pass agent of every variant in ``xla.variants`` (``<agents_dir>/agent-<variant>.pt``); a missing
    checkpoint is a one-line error naming it."""
    from rlflow.agents.pass_agent import load_pass_agent
    from rlflow.config import get
    from rlflow.errors import RLFlowError

    ckpts = {v: Path(agents_dir) / f"agent-{v}.pt" for v in get(config, "xla.variants")}
    missing = [str(p) for p in ckpts.values() if not p.is_file()]
    if missing:
        raise RLFlowError(f"no pass agent {', '.join(missing)} (stage train_pass_agent)")
    return {v: load_pass_agent(p) for v, p in ckpts.items()}


def evaluate_module(config: dict, hlo, model: str, agents: dict, held_out: bool, time_budget_s: float,
                    select_budget_s: float, log=None) -> dict:
    """Every method on one HLO module (the file ``hlo``, named ``model``): op counts, the paper's ratio and, with
    ``xla.time_modules``, the XLA CPU timing (``time_budget_s`` seconds; each agent's module chosen by latency in
    ``select_budget_s``); the document evaluate_passes writes (``rlflow.xla-passes/1``)."""
    import numpy as np

    from rlflow.agents.pass_agent import (default_pipeline, greedy, latency_candidates, random_orders,
                                          reduction_ratio, run_agent)
    from rlflow.config import get
    from rlflow.env.xla_pass_order import make_xla_env

    x = get(config, "xla")
    rng = np.random.default_rng(int(get(config, "seed")))
    env = make_xla_env(config, [hlo])
    methods = []
    try:
        ops0 = env.reset(options={"module": 0})[1]["op_count"]
        runs = [("xla_default", lambda: default_pipeline(env, 0)),
                ("random", lambda: random_orders(env, 0, int(x["random_orders"]), rng)),
                ("greedy", lambda: greedy(env, 0, int(x["greedy_steps"])))]
        runs += [(f"ppo-{v}", lambda a=a: run_agent(env, a, 0)) for v, a in agents.items()]
        texts, candidates = {}, {}
        for name, fn in runs:
            t0 = time.perf_counter()
            out = fn()
            methods.append({"method": name, "ops": float(out.ops), "reduction": float(ops0 - out.ops),
                            "passes": list(out.passes), "seconds": time.perf_counter() - t0})
            if out.text is not None:
                texts[name] = out.text
            (log or _log)(f"{model} {name}: {out.ops:g} ops (initial {ops0})")
            if name.startswith("ppo-") and x["time_modules"] and x["select_by_latency"]:
                candidates[name] = latency_candidates(env, out)
        pipeline = env.pipeline
    finally:
        env.close()
    runtime = None
    if x["time_modules"]:
        from rlflow.xla.timing import TimingWorker, timing_disabled

        disabled = timing_disabled(pipeline)
        with TimingWorker() as timer:  # one process: a module the selection compiled is not compiled again
            for m in methods:
                if m["method"] in candidates:
                    select_by_latency(config, timer, disabled, texts, m, candidates[m["method"]], model,
                                      select_budget_s, log)
            runtime = time_methods(config, timer, disabled, texts, methods, model, time_budget_s, log)
    default = methods[0]["ops"]
    for m in methods:
        m["ratio_vs_default"] = reduction_ratio(ops0, m["ops"], default)
    return {"format": "rlflow.xla-passes/1", "model": model, "initial_ops": ops0, "held_out": held_out,
            "train_on": x["train_on"], "train_models": trained_on(x), "max_steps": int(x["max_steps"]),
            "methods": methods, "runtime": runtime}
