"""Step time of the rewrite environment (rlflow/GraphRewrite-v0) and random-agent throughput.

One step = apply the rule at the location + update every rule's matches + new masks + cost metrics + the
observation (graph features). Steps come from the random agent of the rollouts (valid actions only, so every
step rewrites the graph), over several episodes from the original graph.

  python benchmarks/env_step.py --model bert                       # paper size (results/bert/model.onnx if present)
  python benchmarks/env_step.py --model resnet50 --episodes 200    # also time 200 random-agent episodes

Goals (issue C) on a 2-core CPU: bert <= 10 ms, resnet50 <= 20 ms per step (the RLFlow paper's TASO-based
environment: 850 ms on ResNet-50); >= 200 bert episodes in <= 2 minutes. The last line is
``env_step_ms_median=<x>``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rlflow.agents.random_agent import RandomAgent  # noqa: E402
from rlflow.agents.rollouts import collect  # noqa: E402
from rlflow.config import load_config  # noqa: E402
from rlflow.cost import make_cost_model  # noqa: E402
from rlflow.env import make_env  # noqa: E402
from rlflow.graph import load_onnx, zoo  # noqa: E402
from rlflow.rewrite import load_rules  # noqa: E402


def load_model(name: str, tiny: bool):
    path = ROOT / "results" / name / "model.onnx"
    if path.is_file() and not tiny:
        return load_onnx(path), str(path)
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / f"{name}.onnx"
        zoo.export_model(name, p, zoo.TINY_SIZES[name] if tiny else None)
        return load_onnx(p), "exported " + ("tiny" if tiny else "default") + " size"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert", choices=zoo.MODEL_NAMES)
    ap.add_argument("--rules", default=str(ROOT / "results/rules/rules.json"))
    ap.add_argument("--config", default=str(ROOT / "config.yaml"))
    ap.add_argument("--costs", default=None, help="cost cache of `rlflow measure-costs` (tables, calibration)")
    ap.add_argument("--target", default=None, help="cost target (default: torch-eager with --costs, else analytic); "
                    "ort-cpu without --costs learns the fusions and times the model's kernels first")
    ap.add_argument("--steps", type=int, default=300, help="timed steps (default 300)")
    ap.add_argument("--episodes", type=int, default=0, help="also time this many random-agent episodes")
    ap.add_argument("--tiny", action="store_true", help="tiny model sizes (quick check)")
    args = ap.parse_args()

    config = load_config(args.config)
    graph, source = load_model(args.model, args.tiny)
    rules = load_rules(args.rules)
    target = args.target or ("torch-eager" if args.costs else "analytic")
    cost = make_cost_model(config, "cpu", args.costs, kind=target)
    if cost.name == "ort-cpu" and not args.costs:
        from rlflow.cost.calibration import load_or_measure

        cost.set_calibration(load_or_measure("ort", "cpu"))
        cost.learn([graph])
        cost.measure([graph])
    env = make_env(config, graph, rules, cost, reward=True)
    agent = RandomAgent(stop_prob=0.0, rng=np.random.default_rng(0))

    times, episodes = [], 0
    obs, _ = env.reset()
    while len(times) < args.steps:
        action = agent.act(obs["xfer_mask"], obs["location_mask"])
        if action[0] == env.noop:  # no rule matches: start again
            obs, _ = env.reset()
            episodes += 1
            continue
        t0 = time.perf_counter()
        obs, _, terminated, truncated, info = env.step(action)
        times.append((time.perf_counter() - t0) * 1e3)
        if terminated or truncated:
            obs, _ = env.reset()
            episodes += 1
    q1, med, q3 = np.percentile(times, [25, 50, 75])
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"model {args.model} ({source}): {len(graph.nodes)} nodes, {len(rules)} rules, "
          f"{sum(env.initial_index.counts())} (rule, location) pairs at the start; cost target {cost.name} ({cost.label}); "
          f"max_steps {env.max_steps}")
    print(f"{len(times)} steps over {episodes + 1} episodes: median {med:.2f} ms, IQR {q3 - q1:.2f} ms, "
          f"p90 {np.percentile(times, 90):.2f} ms, max {max(times):.2f} ms, mean {statistics.mean(times):.2f} ms")
    if args.episodes:
        stop = config["rollouts"]["stop_prob"]
        t0 = time.perf_counter()
        eps = collect(env, args.episodes, stop, seed=[0, 0])
        secs = time.perf_counter() - t0
        steps = sum(len(e["actions"]) for e in eps)
        print(f"random agent (stop_prob {stop}): {args.episodes} episodes, {steps} steps in {secs:.1f} s "
              f"({args.episodes / secs:.2f} episodes/s, one process)")
        print(f"random_agent_episodes={args.episodes} random_agent_seconds={secs:.1f}")
    print(f"env_step_ms_median={med:.2f}")


if __name__ == "__main__":
    main()
