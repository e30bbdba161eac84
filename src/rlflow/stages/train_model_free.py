"""Train the model-free PPO baseline on the real environment, then run it once (stage train_model_free).

The same PPO and hierarchical heads as the controller, on real environments (model_free.num_envs), with the
trained encoder's z of the real graph as input. Every real step is counted. Then a greedy run from the original
graph; the best graph seen is kept and reported.

Reads: seed, device, cost.model, cost.peak, env.max_steps, env.max_locations, env.reward, ppo.*, model_free.*.
Writes the policy checkpoint and metrics.json (returns per update, the real run, interactions), atomically.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlflow.config import get
from rlflow.stages.common import add_config_arguments, add_problem_arguments, load_problem

NAME = "train-model-free"
HELP = "train the model-free PPO baseline on the real env (pipeline stage train_model_free)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "model_free.updates=5")
    add_problem_arguments(parser)
    parser.add_argument("--encoder", required=True, type=Path, help="encoder checkpoint (train_encoder)")
    parser.add_argument("--out", required=True, type=Path, help="policy checkpoint to write")
    parser.add_argument("--metrics", required=True, type=Path, help="metrics JSON to write")


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from rlflow.agents.checkpoint import Checkpointer, fingerprint
    from rlflow.agents.model_free import run_model_free
    from rlflow.agents.ppo import PPOConfig, train
    from rlflow.agents.real_env import RealVectorEnv, summarise_run
    from rlflow.atomic import write_text
    from rlflow.env import make_env
    from rlflow.nn.policy import HierarchicalPolicy
    from rlflow.stages.train_encoder import load_encoder

    t0 = time.perf_counter()
    problem = load_problem(args)
    config, device = problem.config, problem.device
    seed = get(config, "seed")
    torch.manual_seed(seed)
    np.random.seed(seed)
    mf = get(config, "model_free")
    encoder = load_encoder(args.encoder, device)
    envs = [make_env(config, problem.graph, problem.rules, problem.cost, device=device) for _ in range(mf["num_envs"])]
    used = {"seed": seed, "env.reward": get(config, "env.reward"), "ppo": get(config, "ppo"), "model_free": mf,
            "env.max_steps": get(config, "env.max_steps"), "env.max_locations": get(config, "env.max_locations")}
    ckpt = Checkpointer(args.out, fingerprint(used, [args.encoder, args.onnx, args.rules]))
    z_dim = encoder.config["z_dim"]
    policy = HierarchicalPolicy(z_dim, len(problem.rules), envs[0].max_locations, get(config, "ppo.hidden"))
    state = ckpt.load()
    done_updates, curve, interactions = 0, [], 0
    if state is not None:
        policy.load_state_dict(state["policy"])
        done_updates, curve, interactions = state["updates"], state["curve"], state["interactions"]
        print(f"train_model_free: resuming after update {done_updates}", flush=True)
    venv = RealVectorEnv(envs, encoder, device)

    def on_update(k, logs):
        n = interactions + venv.interactions
        curve.append({"update": done_updates + k + 1, "interactions": n, **logs})
        ckpt.save({"policy": policy.state_dict(), "updates": done_updates + k + 1, "curve": curve, "interactions": n})
        print(f"train_model_free: update {done_updates + k + 1}/{mf['updates']}: mean reward {logs['mean_reward']:.4f},"
              f" {n} real interactions", flush=True)

    train(venv, policy, PPOConfig.from_config(get(config, "ppo"), mf["steps_per_update"]), mf["updates"] - done_updates,
          torch.Generator().manual_seed(seed + done_updates), on_update)
    training = interactions + venv.interactions
    env = make_env(config, problem.graph, problem.rules, problem.cost, reward=False, device=device)
    result = summarise_run(run_model_free(policy, encoder, env, device))
    metrics = {"model": args.model, "reward": repr(envs[0].reward_fn), "real": result,
               "real_interactions": {"training": training, "evaluation": result["steps"],
                                     "total": training + result["steps"]},
               "curve": curve, "seconds": time.perf_counter() - t0}
    ckpt.finish({"kind": "rlflow.model-free/1", "policy": policy.state_dict(), "config": used, "in_dim": z_dim,
                 "n_xfers": len(problem.rules)})
    write_text(args.metrics, json.dumps(metrics, indent=1, default=float) + "\n")
    print(f"train_model_free: real run: runtime {result['initial']['runtime_ms']:.3f} -> "
          f"{result['best']['runtime_ms']:.3f} ms ({result['improvement_pct']:.2f}%); real interactions "
          f"{metrics['real_interactions']['total']}; {metrics['seconds']:.1f} s", flush=True)
    return 0
