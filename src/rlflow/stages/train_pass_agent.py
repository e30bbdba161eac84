"""Train one PPO XLA pass-ordering agent (pipeline stage ``train_pass_agent``; one job per ``xla.variants``).

The env is rlflow/XlaPassOrder-v0 over the HLO modules of every model in ``xla.train_models``
(``<--results-dir>/<model>/xla/module.hlo``, from stage export_hlo), or with ``xla.train_on=suite`` over the
training split of the HLO suite (``--manifest``, from stage export_hlo_suite); each episode picks one of them. Every step
is a real XLA pass in the crash-isolated worker. Variants (:mod:`rlflow.agents.pass_agent`): ``plain`` (the
op-count reward), ``shaped`` (+ potential-based shaping with the ``xla.shaping`` weights), ``shaped_costvf``
(shaped, and the value function also sees the cost features). PPO: config ``ppo`` (gamma, lr, clip, ...),
``xla.updates`` rounds of ``xla.steps_per_update`` steps, ``xla.hidden`` units, entropy-bonus weight
``xla.entropy`` (in place of ``ppo.c2``).

Writes ``--out`` (the agent's checkpoint, read by evaluate_passes and ``rlflow passes``) and ``--metrics``
(JSON: training modules and their op counts, env steps, episode returns, seconds, and with the runtime reward
the count, median and p90 seconds of its episode ends), each atomically.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HELP = "train one PPO XLA pass-ordering agent on the training models' HLO (pipeline stage train_pass_agent)"
SET_EXAMPLE = "xla.updates=2"


def training_modules(results: Path, models: list[str]) -> list[Path]:
    """The HLO module file of each training model; a missing one is a one-line error naming it."""
    from rlflow.errors import RLFlowError

    paths = [Path(results) / m / "xla" / "module.hlo" for m in models]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise RLFlowError(f"no HLO module {', '.join(missing)} (stage export_hlo of xla.train_models)")
    return paths


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from rlflow.agents.pass_agent import VARIANTS, train_ppo
    from rlflow.agents.ppo import PPOConfig
    from rlflow.atomic import atomic_path, write_text
    from rlflow.config import get, load_config
    from rlflow.env.xla_pass_order import make_xla_env
    from rlflow.errors import RLFlowError

    config = load_config(args.config, args.overrides)
    if args.variant not in VARIANTS:
        raise RLFlowError(f"unknown pass agent variant '{args.variant}' (choose from: {', '.join(VARIANTS)})")
    x = get(config, "xla")
    if x["train_on"] == "suite":
        from rlflow.xla.suite import split_paths

        if args.manifest is None:
            raise RLFlowError("xla.train_on=suite: give --manifest (the HLO suite's, stage export_hlo_suite)")
        paths = split_paths(args.manifest, "train")
        models = [p.stem for p in paths]
    else:
        models = list(x["train_models"])
        paths = training_modules(args.results_dir, models)
    seed = int(get(config, "seed"))
    cfg = PPOConfig.from_config(dict(get(config, "ppo")), int(x["steps_per_update"]), c2=float(x["entropy"]))
    t0 = time.perf_counter()
    env = make_xla_env(config, paths, shaping=args.variant != "plain", runtime_reward=True)
    try:
        initial = {}
        for i, m in enumerate(models):
            initial[m] = env.reset(options={"module": i})[1]["op_count"]
        print(f"train_pass_agent: {args.variant} on {', '.join(f'{m} ({n} ops)' for m, n in initial.items())}; "
              f"{x['updates']} updates x {x['steps_per_update']} steps, {len(env.passes)} passes", flush=True)
        agent = train_ppo(env, args.variant, cfg, int(x["updates"]), seed, dict(x.get("shaping") or {}),
                          int(x["hidden"]), log=lambda line: print(f"train_pass_agent: {line}", flush=True))
        steps, compiles, ends = env.total_steps, env.compiles, list(env.runtime_costs)
    finally:
        env.close()
    seconds = time.perf_counter() - t0
    returns = agent.returns
    metrics = {"format": "rlflow.xla-pass-agent-metrics/1", "variant": args.variant, "train_models": models,
               "initial_op_counts": initial, "passes": len(agent.passes), "updates": int(x["updates"]),
               "env_steps": steps, "xla_compiles": compiles, "episodes": len(returns),
               "mean_return_last10": sum(returns[-10:]) / len(returns[-10:]) if returns else None,
               "returns": returns, "seconds": seconds, "seed": seed,
               "runtime_ends": {"count": len(ends), "median_s": float(np.median(ends)),
                                "p90_s": float(np.percentile(ends, 90))} if ends else None}
    with atomic_path(args.out) as tmp:
        torch.save(agent.state(), tmp)
    write_text(args.metrics, json.dumps(metrics, indent=2) + "\n")
    if ends:
        print(f"train_pass_agent: runtime reward: {len(ends)} episode ends, median {np.median(ends):.2f} s, "
              f"p90 {np.percentile(ends, 90):.2f} s", flush=True)
    last = metrics["mean_return_last10"]
    print(f"train_pass_agent: wrote {args.out}: {steps} env steps, {len(returns)} episodes, mean return of the "
          f"last 10 {'n/a' if last is None else f'{last:.2f}'}, {seconds:.1f} s", flush=True)
    return 0
