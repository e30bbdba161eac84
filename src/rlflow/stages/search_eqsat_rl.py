"""eqsat-rl: equality saturation whose rule families a tree search picks per iteration (pipeline stage
search_eqsat_rl), then the same ILP extraction as search_eqsat.

The same e-graph runner, budget (eqsat.node_limit, eqsat.iter_limit, eqsat.time_limit_s, eqsat.multi_iterations)
and extraction (eqsat.extraction, eqsat.ilp_time_limit_s, eqsat.ilp_node_limit) as search_eqsat, on the
configured cost target; only the schedule differs: UCT over the first iterations' actions (all rule families, one
family only, or all but one; rlflow.search.eqsat_rl.tree_search, MCTS-GEB style) scores eqsat.rl_leaves schedules,
each a whole saturation with a short ILP (eqsat's own schedule is the first, so the schedule chosen is never worse
than eqsat's on that proxy), then runs the best one with the full ILP. With both time limits 0 and an ILP node
limit (the clock-free budget) every ILP, the short ones included, is the full one without a clock: the result does
not depend on the machine's speed or load. No trained policy is needed (``rlflow optimize --method eqsat-rl --agent
POLICY.json`` runs a learned one). The tree search's time is part of the optimisation time. The result, weight-only
nodes folded, is checked equal to the original under onnxruntime before anything is written, and checked never
slower as every search stage's is.

Reads these config keys: seed, device, cost.*, eqsat.* (eqsat.rl_leaves: the tree search's leaves).
Writes OUT (the optimised ONNX) and TRACE (JSON "rlflow.search-trace/2": cost before/after, e-graph and extraction
statistics, the tree search's leaves and seconds, config values used, max output difference), atomically.

"""

from __future__ import annotations

import argparse

from rlflow.stages.search_common import run_stage

HELP = ("equality saturation with a tree search over its rule-family schedule (eqsat-rl); verified optimised ONNX "
        "and trace (pipeline stage search_eqsat_rl)")
SET_EXAMPLE = "eqsat.rl_leaves=4"


def run(args: argparse.Namespace) -> int:
    return run_stage(args, "eqsat-rl", "search_eqsat_rl")
