"""The XLA pass agents vs XLA's own pipeline and the baselines on one model's HLO (pipeline stage
``evaluate_passes``).

Methods, each on the model's module from export_hlo (every pass a real XLA compile in the crash-isolated worker):
``xla_default`` (XLA's own target-independent pipeline), ``random`` (the mean final op count of
``xla.random_orders`` uniform orders of ``xla.max_steps`` passes), ``greedy`` (the pass giving the fewest ops at
each step, at most ``xla.greedy_steps`` steps) and ``ppo-<variant>`` for every agent in ``xla.variants``
(``<--agents-dir>/agent-<variant>.pt``, from train_pass_agent; the most likely pass at each step, the best module
on the way). For each: the final op count, the reduction from the initial count and the paper's ratio
(ops_0 - ops_method) / (ops_0 - ops_default). Whether the model was held out is recorded: not in
``xla.train_models``, or with ``xla.train_on=suite`` in none of ``xla.suite.train_families``. The work is
:func:`rlflow.stages.passes_common.evaluate_module`, which evaluate_passes_suite runs on the suite's modules.

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
from pathlib import Path

HELP = "XLA pass agents vs XLA's default pipeline, random orders and greedy on a model's HLO (pipeline stage evaluate_passes)"
SET_EXAMPLE = "xla.random_orders=3"


def run(args: argparse.Namespace) -> int:
    from rlflow.atomic import write_text
    from rlflow.config import get, load_config
    from rlflow.errors import RLFlowError
    from rlflow.stages.passes_common import evaluate_module, load_agents, to_csv, trained_on

    config = load_config(args.config, args.overrides)
    x = get(config, "xla")
    if not Path(args.hlo).is_file():
        raise RLFlowError(f"{args.hlo}: no such HLO module (stage export_hlo)")
    agents = load_agents(config, args.agents_dir)
    # held out: not trained on (with xla.train_on=suite, a model of none of the suite's training families)
    doc = evaluate_module(config, args.hlo, args.model, agents, args.model not in trained_on(x),
                          float(x["time_budget_s"]), float(x["select_budget_s"]))
    write_text(args.out, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    write_text(args.csv, to_csv(doc))
    methods = doc["methods"]
    best = min(methods[1:], key=lambda m: m["ops"])
    print(f"evaluate_passes: wrote {args.out}: initial {doc['initial_ops']} ops, XLA default {methods[0]['ops']:g}, "
          f"best other {best['method']} {best['ops']:g}", flush=True)
    return 0
