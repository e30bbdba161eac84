"""The XLA pass agents vs XLA's own pipeline and the baselines on one model's HLO (pipeline stage
``evaluate_passes``).

Methods, each on the model's module from export_hlo (every pass a real XLA compile in the crash-isolated worker):
``xla_default`` (XLA's own target-independent pipeline), ``random`` (the mean final op count of
``xla.random_orders`` uniform orders of ``xla.max_steps`` passes), ``greedy`` (the pass giving the fewest ops at
each step, at most ``xla.greedy_steps`` steps) and ``ppo-<variant>`` for every agent in ``xla.variants``
(``<--agents-dir>/agent-<variant>.pt``, from train_pass_agent; the most likely pass at each step, the best module
on the way). For each: the final op count, the reduction from the initial count and the paper's ratio
(ops_0 - ops_method) / (ops_0 - ops_default). Whether the model was held out (not in ``xla.train_models``) is
recorded.

Runtime (``xla.time_modules``): the module of every method that has one (XLA's default, greedy, each agent) is
compiled by XLA's CPU compiler without the target-independent passes and timed with the project's protocol
(config ``timing``, ``xla.time_budget_s`` seconds): latency ratio to XLA's default pipeline's module with its 95%
interval and verdict, and an A/A control (the default module timed twice, ``xla_default-aa``) whose interval must
hold 1.0, else the comparison is marked too noisy (:mod:`rlflow.xla.timing`). With ``xla.select_by_latency``, each
agent's timed module is its final choice by measured latency: its candidates (the module with the fewest ops,
its last module, and XLA's default pipeline run after its passes) and XLA's default pipeline's module, timed
with the protocol (``xla.select_budget_s`` seconds); the fastest candidate the protocol calls faster than the
default, else the default's module (``selection`` in the JSON, ``latency_choice`` in the CSV). The op-count
columns stay the agent's fewest-ops module (the paper's metric). Each module's outputs on the same
inputs are compared with the default module's; beyond ``evaluate.tolerance`` the stage fails, naming the method.

Writes ``--out`` (JSON ``rlflow.xla-passes/1``: also the passes each method ran) and ``--csv`` (one row per
method), atomically.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HELP = "XLA pass agents vs XLA's default pipeline, random orders and greedy on a model's HLO (pipeline stage evaluate_passes)"
SET_EXAMPLE = "xla.random_orders=3"

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
                      candidates: list[dict], model: str) -> None:
    """The agent's final module, chosen by measured latency among its candidates and XLA's default pipeline's
    module (:func:`rlflow.xla.timing.choose_by_latency`, protocol ``timing`` with ``xla.select_budget_s``
    seconds): sets ``texts[method]`` (what the runtime comparison times) and the method's ``selection``."""
    from rlflow.config import get
    from rlflow.evaluation.protocol import Protocol
    from rlflow.xla.hlo import histogram, parse
    from rlflow.xla.timing import choose_by_latency

    protocol = Protocol.from_config(config, budget_s=float(get(config, "xla.select_budget_s")))
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
    print(f"evaluate_passes: {model} {name}: final module by latency: {choice['chosen']} "
          f"(candidates vs XLA default: {seen or 'all equal to it'})", flush=True)


def time_methods(config: dict, timer, disabled: list[str], texts: dict[str, str], methods: list[dict],
                 model: str) -> dict:
    """Time the methods' modules on XLA CPU against XLA's default one (:mod:`rlflow.xla.timing`, in ``timer``);
    adds each method's ``runtime`` entry and returns the comparison's summary (protocol, A/A control, too
    noisy)."""
    from rlflow.config import get
    from rlflow.errors import RLFlowError
    from rlflow.evaluation.protocol import SAME, Protocol

    protocol = Protocol.from_config(config, budget_s=float(get(config, "xla.time_budget_s")))
    order = ["xla_default", AA_NAME] + [m["method"] for m in methods if m["method"] != "xla_default"
                                        and m["method"] in texts]
    modules = [(n, texts["xla_default" if n == AA_NAME else n]) for n in order]
    print(f"evaluate_passes: {model}: timing {len(modules)} modules on XLA CPU ({protocol.describe()})", flush=True)
    result = timer.time(modules, protocol, disabled, seed=int(get(config, "seed")))
    tolerance = float(get(config, "evaluate.tolerance"))
    for m in methods:
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
        print(f"evaluate_passes: {model} {m['method']}: XLA CPU median {est['median_ms']:.3f} ms, {vs}", flush=True)
    aa = result["estimates"][AA_NAME]
    return {"backend": "xla-cpu", "reference": "xla_default", "protocol": protocol.describe(),
            "aa": {k: aa[k] for k in ("ratio", "ci_low", "ci_high", "verdict")}, "too_noisy": aa["verdict"] != SAME,
            "rounds": result["rounds"], "seconds": result["seconds"], "disabled_passes": disabled}


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from rlflow.agents.pass_agent import (default_pipeline, greedy, latency_candidates, load_pass_agent,
                                          random_orders, reduction_ratio, run_agent)
    from rlflow.atomic import write_text
    from rlflow.config import get, load_config
    from rlflow.env.xla_pass_order import make_xla_env
    from rlflow.errors import RLFlowError

    config = load_config(args.config, args.overrides)
    x = get(config, "xla")
    if not Path(args.hlo).is_file():
        raise RLFlowError(f"{args.hlo}: no such HLO module (stage export_hlo)")
    ckpts = {v: Path(args.agents_dir) / f"agent-{v}.pt" for v in x["variants"]}
    missing = [str(p) for p in ckpts.values() if not p.is_file()]
    if missing:
        raise RLFlowError(f"no pass agent {', '.join(missing)} (stage train_pass_agent)")
    agents = {v: load_pass_agent(p) for v, p in ckpts.items()}
    rng = np.random.default_rng(int(get(config, "seed")))
    env = make_xla_env(config, [args.hlo])
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
            print(f"evaluate_passes: {args.model} {name}: {out.ops:g} ops (initial {ops0})", flush=True)
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
                    select_by_latency(config, timer, disabled, texts, m, candidates[m["method"]], args.model)
            runtime = time_methods(config, timer, disabled, texts, methods, args.model)
    default = methods[0]["ops"]
    for m in methods:
        m["ratio_vs_default"] = reduction_ratio(ops0, m["ops"], default)
    doc = {"format": "rlflow.xla-passes/1", "model": args.model, "initial_ops": ops0,
           "held_out": args.model not in x["train_models"], "train_models": list(x["train_models"]),
           "max_steps": int(x["max_steps"]), "methods": methods, "runtime": runtime}
    write_text(args.out, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    write_text(args.csv, to_csv(doc))
    best = min(methods[1:], key=lambda m: m["ops"])
    print(f"evaluate_passes: wrote {args.out}: initial {ops0} ops, XLA default {default:g}, best other "
          f"{best['method']} {best['ops']:g}", flush=True)
    return 0
