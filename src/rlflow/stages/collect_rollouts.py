"""Collect one shard of random-agent episodes in the rewrite environment (pipeline stage ``collect_rollouts``;
also ``rlflow rollouts``).

The random agent stops (NO-OP) with probability rollouts.stop_prob at each step, otherwise picks a rule with a
match uniformly, then one of its locations uniformly. Per episode the file keeps the actions, the metrics of
every graph, the match counts per rule and done flags -- not rewards (format: see rlflow/agents/rollouts.py).
With --graphs, the graph of every step goes to a compact side file (about 1 KB per graph), so that
train_encoder need not replay every episode to rebuild them. Shard K's episodes depend only on K, seed,
rollouts.episodes, rollouts.stop_prob, env.max_steps, env.max_locations and the cost model, so shards run in parallel and adding shards leaves the
others alone. Reward settings (env.reward) are not read.

Examples:
  rlflow collect-rollouts ... --set rollouts.episodes=20 --set cost.model=analytic      (no cost cache needed)

One job per model and shard id in rollouts.shards (a DVC matrix); merge_rollouts joins the shards.
"""

from __future__ import annotations

import argparse
import json
import time

from rlflow.config import get
from rlflow.errors import RLFlowError
from rlflow.stages.common import load_problem

ALIASES = ["rollouts"]
HELP = "collect one shard of random-agent episodes (pipeline stage collect_rollouts)"
SET_EXAMPLE = "rollouts.episodes=20"


def run(args: argparse.Namespace) -> int:
    from rlflow.agents.rollouts import FORMAT, collect, graph_arrays, rules_digest, summarise
    from rlflow.atomic import write_npz
    from rlflow.env import make_env

    if args.shard < 0:
        raise RLFlowError("--shard must be >= 0")
    problem = load_problem(args)
    config = problem.config
    seed, episodes, stop_prob = get(config, "seed"), get(config, "rollouts.episodes"), get(config, "rollouts.stop_prob")
    env = make_env(config, problem.graph, problem.rules, problem.cost, reward=False)
    print(f"collect_rollouts: {args.model} shard {args.shard}: {episodes} episodes, {len(problem.rules)} rules, "
          f"max_steps={env.max_steps}, stop_prob={stop_prob}, cost model {problem.cost.name}", flush=True)
    t0 = time.perf_counter()
    graphs = [] if args.graphs else None
    eps = collect(env, episodes, stop_prob, seed=[seed, args.shard], progress=not args.no_progress, graphs=graphs)
    seconds = time.perf_counter() - t0
    for e in eps:
        e["shard"] = args.shard
    stats = summarise(eps, seconds)
    doc = {
        "format": FORMAT,
        "model": args.model,
        "shards": [args.shard],
        "seed": seed,
        "rules": rules_digest(problem.rules),
        "env": {"max_steps": env.max_steps, "max_locations": env.max_locations},
        "cost": problem.cost.describe(),
        "metric_names": ["runtime_ms", "flops", "bytes", "launches"],
        "stop_prob": stop_prob,
        "stats": stats,
        "episodes": eps,
    }
    from rlflow.atomic import write_text

    if graphs is not None:
        write_npz(args.graphs, graph_arrays(graphs, eps))
    write_text(args.out, json.dumps(doc, separators=(",", ":")) + "\n")
    also = f" and {args.graphs}" if graphs is not None else ""
    print(f"collect_rollouts: wrote {args.out}{also}: {stats['episodes']} episodes, {stats['steps']} steps in "
          f"{seconds:.1f} s ({stats['episodes_per_second']:.1f} episodes/s); best runtime "
          f"{stats['best_runtime_ms']:.3f} ms ({stats['best_improvement_pct']:.2f}% below the original)", flush=True)
    return 0
