"""TASO's cost-based backtracking search over the rules (pipeline stage search_taso).

A priority queue of candidate graphs ordered by estimated cost: take the cheapest, apply every rule at every
location, keep each new graph whose cost is below search.alpha x the best so far (and that is new and has
fewer than twice the original's nodes); stop after search.budget graphs (or search.time_limit_s seconds).
The best graph, weight-only nodes folded, is checked equal to the original under onnxruntime (random inputs,
seed from the config) before anything is written.

Reads these config keys: seed, device, cost.model, cost.peak (and cost.warmup/repeats for the cache's
description), search.alpha, search.budget, search.time_limit_s.
Writes OUT (the optimised ONNX) and TRACE (JSON "rlflow.search-trace/2": the rewrites applied in order with
the cost after each, cost before/after, search statistics, config values used, max output difference),
each atomically.

Examples:
  rlflow search-taso --model bert --onnx m.onnx --rules rules.json --set cost.model=analytic \\
      --set search.budget=100 --out /tmp/taso.onnx --trace /tmp/trace.json
"""

from __future__ import annotations

import argparse

from rlflow.stages.search_common import run_stage

HELP = "TASO's backtracking search over the rules; verified optimised ONNX and trace (pipeline stage search_taso)"
SET_EXAMPLE = "search.budget=100"


def run(args: argparse.Namespace) -> int:
    return run_stage(args, "taso", "search_taso")
