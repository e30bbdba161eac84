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

CSV_COLUMNS = ("model", "method", "ops", "initial_ops", "reduction", "ratio_vs_default", "passes_run", "seconds")


def to_csv(doc: dict) -> str:
    lines = [",".join(CSV_COLUMNS)]
    for m in doc["methods"]:
        row = {**m, "model": doc["model"], "initial_ops": doc["initial_ops"], "passes_run": len(m["passes"])}
        lines.append(",".join("" if row[c] is None else (f"{row[c]:.6g}" if isinstance(row[c], float) else str(row[c]))
                              for c in CSV_COLUMNS))
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from rlflow.agents.pass_agent import (default_pipeline, greedy, load_pass_agent, random_orders,
                                          reduction_ratio, run_agent)
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
        for name, fn in runs:
            t0 = time.perf_counter()
            out = fn()
            methods.append({"method": name, "ops": float(out.ops), "reduction": float(ops0 - out.ops),
                            "passes": list(out.passes), "seconds": time.perf_counter() - t0})
            print(f"evaluate_passes: {args.model} {name}: {out.ops:g} ops (initial {ops0})", flush=True)
    finally:
        env.close()
    default = methods[0]["ops"]
    for m in methods:
        m["ratio_vs_default"] = reduction_ratio(ops0, m["ops"], default)
    doc = {"format": "rlflow.xla-passes/1", "model": args.model, "initial_ops": ops0,
           "held_out": args.model not in x["train_models"], "train_models": list(x["train_models"]),
           "max_steps": int(x["max_steps"]), "methods": methods}
    write_text(args.out, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    write_text(args.csv, to_csv(doc))
    best = min(methods[1:], key=lambda m: m["ops"])
    print(f"evaluate_passes: wrote {args.out}: initial {ops0} ops, XLA default {default:g}, best other "
          f"{best['method']} {best['ops']:g}", flush=True)
    return 0
