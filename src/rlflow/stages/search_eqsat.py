"""Equality saturation over the rules, Tensat's method (pipeline stage search_eqsat).

Every rule is applied everywhere at once in an e-graph (no choice between rewrites is ever made) until the
e-graph saturates or reaches eqsat.node_limit e-nodes, eqsat.iter_limit iterations or eqsat.time_limit_s
seconds (cycles among its classes filtered out as Tensat does); then the cheapest graph it holds under the
cost target is extracted by an ILP (HiGHS; greedy extraction if the ILP finds nothing within
eqsat.ilp_time_limit_s and eqsat.ilp_node_limit; with both time limits 0 and a node limit, the result does not
depend on the machine's speed or load). The result,
weight-only nodes folded, is checked equal to the original under onnxruntime before anything is written.

Reads these config keys: seed, device, cost.*, eqsat.*.
Writes OUT (the optimised ONNX) and TRACE (JSON "rlflow.search-trace/2": cost before/after, e-graph size and
saturation and extraction statistics, config values used, max output difference), atomically.

"""

from __future__ import annotations

import argparse

from rlflow.stages.search_common import run_stage

HELP = "equality saturation (Tensat) over the rules; verified optimised ONNX and trace (pipeline stage search_eqsat)"
SET_EXAMPLE = "eqsat.node_limit=20000"


def run(args: argparse.Namespace) -> int:
    return run_stage(args, "eqsat", "search_eqsat")
