"""Dream vs real environment: time per transition of the batched dream (the world model on torch) and of the
real rewrite environment, on the same model, with random valid actions.

  python benchmarks/dream_step.py --model bert \\
      --world-model results/bert/world_model/world_model.pt --latents results/bert/encoder/latents.npz

Goal (issue D): dream_vs_real_step_speedup >= 100 on bert (the RLFlow paper reports 85: ~10 ms vs ~850 ms).
The last line is ``dream_vs_real_step_speedup=<x>``: the real env's median time per ``env.step`` divided by the
dream's time per transition (one batched ``step_batch`` over ``--num-envs`` copies divided by the copies,
including the random choice of each copy's action; ``step_batch`` alone is printed too).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rlflow.agents.random_agent import RandomAgent  # noqa: E402
from rlflow.agents.world_model import load_latents, load_world_model  # noqa: E402
from rlflow.config import load_config  # noqa: E402
from rlflow.cost import AnalyticCost  # noqa: E402
from rlflow.env import make_env  # noqa: E402
from rlflow.env.dream import DreamEnv  # noqa: E402
from rlflow.env.rewards import make_reward  # noqa: E402
from rlflow.graph import load_onnx  # noqa: E402
from rlflow.rewrite import load_rules  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert")
    ap.add_argument("--world-model", required=True)
    ap.add_argument("--latents", required=True)
    ap.add_argument("--rules", default=str(ROOT / "results/rules/rules.json"))
    ap.add_argument("--num-envs", type=int, default=64, help="dream copies stepped together (default 64)")
    ap.add_argument("--steps", type=int, default=200, help="timed steps of each (default 200)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the same one core as the real environment's step, which is "
                         "single-threaded Python; 0 = torch's default. On a loaded shared machine more threads "
                         "than free cores make every small torch op wait for a descheduled thread)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_config(ROOT / "config.yaml")
    wm = load_world_model(args.world_model)
    lat = load_latents(args.latents)
    reward = make_reward("normalised")
    dream = DreamEnv(wm, torch.from_numpy(lat["z"][0, 0]), torch.from_numpy(lat["metrics"][0, 0]),
                     torch.from_numpy(lat["counts"][0, 0]).float(), reward, config["env"]["max_steps"],
                     int(lat["max_locations"]), temperature=1.0, num_envs=args.num_envs,
                     generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(0)
    obs = dream.reset()
    for phase in ("warm-up", "timed"):
        step_s = 0.0
        t0 = time.perf_counter()
        for _ in range(args.steps if phase == "timed" else 10):
            # a random valid rule per copy (uniform: the largest of uniform scores over the valid rules; the
            # NO-OP where none is valid), location 0. Choosing is timed too (the real side times env.step only)
            score = torch.rand(obs["xfer_mask"][:, :-1].shape, generator=gen)
            best, xfer = score.masked_fill_(~obs["xfer_mask"][:, :-1], -1.0).max(-1)
            xfer = torch.where(best >= 0, xfer, dream.n_xfers)
            loc = torch.zeros_like(xfer)
            t1 = time.perf_counter()
            obs, _, _ = dream.step_batch(xfer, loc)
            step_s += time.perf_counter() - t1
        dream_s = time.perf_counter() - t0
    dream_ms = dream_s * 1e3 / (args.steps * args.num_envs)

    graph = load_onnx(ROOT / "results" / args.model / "model.onnx")
    env = make_env(config, graph, load_rules(args.rules), AnalyticCost("cpu"), reward=False)
    agent = RandomAgent(0.0, np.random.default_rng(0))
    o, _ = env.reset()
    times = []
    while len(times) < args.steps:
        a = agent.act(o["xfer_mask"], o["location_mask"])
        if a[0] == env.noop:
            o, _ = env.reset()
            continue
        t0 = time.perf_counter()
        o, _, term, trunc, _ = env.step(a)
        times.append((time.perf_counter() - t0) * 1e3)
        if term or trunc:
            o, _ = env.reset()
    real_ms = float(np.median(times))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    print(f"dream: {args.num_envs} copies x {args.steps} steps: {dream_ms:.4f} ms per transition "
          f"({dream_s * 1e3 / args.steps:.2f} ms per batched step with the random choice; step_batch alone "
          f"{step_s * 1e3 / (args.steps * args.num_envs):.4f} ms per transition)")
    print(f"real env ({args.model}): median {real_ms:.2f} ms per step over {args.steps} steps")
    print(f"dream_vs_real_step_speedup={real_ms / dream_ms:.1f}")


if __name__ == "__main__":
    main()
