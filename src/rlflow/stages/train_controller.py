"""Train RLFlow's controller in the dream, then run it once in the real environment (stage train_controller).

PPO with the hierarchical masked heads (rule, then location) on input [z, h] is trained ONLY in the dream
(rlflow.env.dream: the world model, temperature controller.temperature, reward env.reward on predicted metric
deltas, horizon env.max_steps). Then it runs greedily in the real environment from the original graph; the
best graph seen is kept and reported. Real-environment interactions = the rollouts' steps (the world model's
data) + this evaluation's steps; training used none.

Reads: seed, device, cost.model, cost.peak, env.max_steps, env.max_locations, env.reward, ppo.*, controller.*.
Writes the controller checkpoint (policy state dict + config) and metrics.json (dream returns per update, the
real run's cost before/after and improvement, interactions), atomically. Resumes from its partial checkpoint.

Changing only the temperature or a reward parameter reruns this stage (and train_model_free for the reward),
nothing upstream: the temperature sweep of RLFlow's Table 3 is a matter of config.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlflow.config import get
from rlflow.stages.common import add_config_arguments, add_problem_arguments, load_problem

NAME = "train-controller"
HELP = "train the controller in the dream, run it in the real env (pipeline stage train_controller)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "controller.temperature=1.0")
    add_problem_arguments(parser)
    parser.add_argument("--encoder", required=True, type=Path, help="encoder checkpoint (train_encoder)")
    parser.add_argument("--latents", required=True, type=Path, help="latents.npz (train_encoder)")
    parser.add_argument("--world-model", required=True, type=Path, help="world-model checkpoint (train_world_model)")
    parser.add_argument("--out", required=True, type=Path, help="controller checkpoint to write")
    parser.add_argument("--metrics", required=True, type=Path, help="metrics JSON to write")


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from rlflow.agents.checkpoint import Checkpointer, fingerprint
    from rlflow.agents.controller import run_in_real_env, train_in_dream
    from rlflow.agents.ppo import PPOConfig
    from rlflow.agents.real_env import summarise_run
    from rlflow.agents.world_model import load_latents, load_world_model
    from rlflow.atomic import write_text
    from rlflow.env import make_env
    from rlflow.env.rewards import make_reward
    from rlflow.stages.train_encoder import load_encoder

    t0 = time.perf_counter()
    problem = load_problem(args)
    config, device = problem.config, problem.device
    seed = get(config, "seed")
    torch.manual_seed(seed)
    np.random.seed(seed)
    ctl = get(config, "controller")
    encoder = load_encoder(args.encoder, device)
    wm = load_world_model(args.world_model, "cpu")
    lat = load_latents(args.latents)
    start_z = torch.from_numpy(lat["z"][0, 0]).float()
    start_metrics = torch.from_numpy(lat["metrics"][0, 0]).double()
    start_counts = torch.from_numpy(lat["counts"][0, 0]).float()
    reward = make_reward(get(config, "env.reward"))
    cfg = PPOConfig.from_config(get(config, "ppo"), ctl["steps_per_update"])
    used = {"seed": seed, "env.reward": get(config, "env.reward"), "ppo": get(config, "ppo"), "controller": ctl,
            "env.max_steps": get(config, "env.max_steps"), "env.max_locations": get(config, "env.max_locations")}
    ckpt = Checkpointer(args.out, fingerprint(used, [args.world_model, args.latents]))
    state = ckpt.load()
    from rlflow.nn.policy import HierarchicalPolicy

    policy = HierarchicalPolicy(start_z.shape[-1] + wm.hidden_size, len(problem.rules), get(config, "env.max_locations"),
                                get(config, "ppo.hidden"))
    done_updates, curve = 0, []
    if state is not None:
        policy.load_state_dict(state["policy"])
        done_updates, curve = state["updates"], state["curve"]
        print(f"train_controller: resuming after update {done_updates}", flush=True)

    def on_update(k, logs):
        curve.append({"update": done_updates + k + 1, **logs})
        if (k + 1) % 10 == 0 or done_updates + k + 1 == ctl["updates"]:
            ckpt.save({"policy": policy.state_dict(), "updates": done_updates + k + 1, "curve": curve})
            print(f"train_controller: update {done_updates + k + 1}/{ctl['updates']}: mean dream reward "
                  f"{logs['mean_reward']:.4f}", flush=True)

    remaining = ctl["updates"] - done_updates
    print(f"train_controller: {args.model}: dream x{ctl['num_envs']}, tau {ctl['temperature']}, reward "
          f"{reward!r}, {remaining} updates of {ctl['steps_per_update']} steps", flush=True)
    _, dream = train_in_dream(wm, start_z, start_metrics, start_counts, reward, cfg, remaining, ctl["num_envs"],
                              get(config, "env.max_steps"), get(config, "env.max_locations"), ctl["temperature"],
                              seed=seed + done_updates, on_update=on_update, policy=policy)
    env = make_env(config, problem.graph, problem.rules, problem.cost, reward=False, device=device)
    result = summarise_run(run_in_real_env(policy, encoder, wm, env, device))
    rollout_steps = int(lat["lengths"].sum())
    metrics = {"model": args.model, "temperature": ctl["temperature"], "reward": repr(reward),
               "dream_steps": dream.steps_taken, "real": result,
               "real_interactions": {"rollouts": rollout_steps, "training": 0, "evaluation": result["steps"],
                                     "total": rollout_steps + result["steps"]},
               "curve": curve, "seconds": time.perf_counter() - t0}
    ckpt.finish({"kind": "rlflow.controller/1", "policy": policy.state_dict(), "config": used,
                 "in_dim": start_z.shape[-1] + wm.hidden_size, "n_xfers": len(problem.rules)})
    write_text(args.metrics, json.dumps(metrics, indent=1, default=float) + "\n")
    print(f"train_controller: real run: runtime {result['initial']['runtime_ms']:.3f} -> {result['best']['runtime_ms']:.3f}"
          f" ms ({result['improvement_pct']:.2f}%), {result['steps']} real steps; real interactions in all "
          f"{metrics['real_interactions']['total']} ({dream.steps_taken} dream steps); "
          f"{metrics['seconds']:.1f} s", flush=True)
    return 0
