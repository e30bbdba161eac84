"""Greedy search over the rules (pipeline stage search_greedy).

Apply the (rule, location) that lowers the estimated cost the most, and repeat until no rewrite lowers it
(ties: first rule, then first location; search.time_limit_s also stops it). The result, weight-only nodes
folded, is checked equal to the original under onnxruntime (random inputs, seed from the config) before
anything is written.

Reads these config keys: seed, device, cost.model, cost.peak, search.time_limit_s.
Writes OUT (the optimised ONNX) and TRACE (JSON "rlflow.search-trace/2": the rewrites applied in order with
the cost after each, cost before/after, statistics, config values used, max output difference), atomically.
"""

from __future__ import annotations

import argparse

from rlflow.stages.search_common import run_stage

HELP = "greedy search over the rules; verified optimised ONNX and trace (pipeline stage search_greedy)"
SET_EXAMPLE = "search.time_limit_s=600"


def run(args: argparse.Namespace) -> int:
    return run_stage(args, "greedy", "search_greedy")
