"""Arguments and the run shared by the agent-training stages (train_controller, which the sweeps run too, and
train_model_free): both are argument parsing plus one call to :func:`rlflow.agents.driver.run_agent_stage`.
Kept apart from :mod:`rlflow.stages.common` so that only these stages depend on the agents' code."""

from __future__ import annotations

import argparse

from rlflow.config import load_config


def run_agent(args: argparse.Namespace, method: str) -> int:
    """An agent-training stage's run: :func:`rlflow.agents.driver.run_agent_stage` on its arguments."""
    from rlflow.agents.driver import AgentFiles, run_agent_stage

    files = AgentFiles(onnx=args.onnx, rules=args.rules, costs=args.costs, encoder=args.encoder, out=args.out,
                       metrics=args.metrics, optimised=args.optimised, trace=args.trace, logs=args.logs,
                       latents=getattr(args, "latents", None), world_model=getattr(args, "world_model", None))
    from rlflow.cost.platform import resolve_platform
    from rlflow.stages.search_common import e2e_meter, never_slower_check

    config = load_config(args.config, args.overrides)
    platform = resolve_platform(config)
    run_agent_stage(method, args.model, config, files, progress=not args.no_progress,
                    speed_check=lambda device: never_slower_check(config, platform),
                    latency_meter=lambda device: e2e_meter(config, platform))
    return 0
