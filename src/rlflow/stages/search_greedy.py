"""Greedy search over the rules (pipeline stage search_greedy).

Apply the (rule, location) that lowers the estimated cost the most, and repeat until no rewrite lowers it
(ties: first rule, then first location; search.time_limit_s also stops it). The result, weight-only nodes
folded, is checked equal to the original under onnxruntime (random inputs, seed from the config) before
anything is written.

Reads these config keys: seed, device, cost.model, cost.peak, search.time_limit_s.
Writes OUT (the optimised ONNX) and TRACE (JSON "rlflow.search-trace/1": the rewrites applied in order with
the cost after each, cost before/after, statistics, config values used, max output difference), atomically.

Examples:
  rlflow search-greedy --config config.yaml --model bert --onnx results/bert/model.onnx \\
      --rules results/rules/rules.json --costs results/costs/auto/bert.json \\
      --out results/bert/greedy/model.onnx --trace results/bert/greedy/trace.json

Pipeline: Snakemake rule search_greedy (workflow/rules/search.smk) and dvc.yaml stage search_greedy run this;
both come from rlflow.pipeline.registry.STAGES["search_greedy"].
"""

from __future__ import annotations

import argparse

from rlflow.stages.search_common import add_stage_arguments, run_stage

NAME = "search-greedy"
HELP = "greedy search over the rules; verified optimised ONNX and trace (pipeline stage search_greedy)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser, "search.time_limit_s=600")


def run(args: argparse.Namespace) -> int:
    return run_stage(args, "greedy", "search_greedy")
