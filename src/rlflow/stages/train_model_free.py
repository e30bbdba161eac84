"""Train the model-free PPO baseline on the real environment, then let it optimise the model (stage
train_model_free).

The same PPO and hierarchical heads as the controller, on real environments (model_free.num_envs), with the
trained encoder's z of the real graph as input. Every real step is counted. Then a greedy run from the original
graph; the best graph seen, weight-only nodes folded, is checked equal to the original under onnxruntime and
written.

Reads: seed, device, cost.model, cost.peak, env.max_steps, env.max_locations, env.reward, ppo.*, model_free.*.
Writes, atomically:
  --out        the agent checkpoint, self-contained: policy and encoder (states + constructor arguments), the
               rule set's fingerprint, the env settings, the config (`rlflow optimize ... --method rlflow
               --agent model_free.pt` runs it)
  --optimised  the best graph (ONNX), verified
  --trace      its trace (rlflow.search-trace/1, method "model_free"; `seconds` = the real run, plus
               training_seconds, real_interactions {training, evaluation, total}, max_rel_diff)
  --metrics    the reward curve, the real run, interactions, seconds
  --logs       dvclive folder: per PPO update the real reward, episode return and length, interactions so far,
               the PPO losses (rebuilt from the start, with the saved curve, when a run resumes)
The policy is checkpointed after every update to OUT.partial; a killed run resumes there.

Example:
  rlflow train-model-free --config config.yaml --model bert --onnx results/bert/model.onnx \\
      --rules results/rules/rules.json --costs results/costs/auto/bert.json \\
      --encoder results/bert/encoder/encoder.pt --out results/bert/model_free/model_free.pt \\
      --metrics results/bert/model_free/metrics.json --optimised results/bert/model_free/model.onnx \\
      --trace results/bert/model_free/trace.json --logs results/bert/model_free/live
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlflow.config import get
from rlflow.stages.common import add_config_arguments, add_problem_arguments, load_seeded_problem
from rlflow.stages.train_controller import check_output_paths, describe_cost, progress_bar

NAME = "train-model-free"
HELP = "train the model-free PPO baseline on the real env, let it optimise the model (pipeline stage train_model_free)"

#: PPO-update row keys -> dvclive metric names
CURVE_NAMES = {"mean_reward": "real/reward", "episode_return": "real/episode_return",
               "episode_length": "real/episode_length", "episodes": "real/episodes",
               "interactions": "real/interactions", "clip": "loss/clip", "value": "loss/value",
               "entropy": "loss/entropy", "clip_fraction": "loss/clip_fraction"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "model_free.updates=5")
    add_problem_arguments(parser)
    parser.add_argument("--encoder", required=True, type=Path, help="encoder checkpoint (train_encoder)")
    parser.add_argument("--out", required=True, type=Path, help="agent checkpoint to write")
    parser.add_argument("--metrics", required=True, type=Path, help="metrics JSON to write")
    parser.add_argument("--optimised", required=True, type=Path, metavar="ONNX",
                        help="the best graph of the real run, verified (ONNX) to write")
    parser.add_argument("--trace", required=True, type=Path, metavar="JSON",
                        help="its trace (rlflow.search-trace/1) to write")
    parser.add_argument("--logs", type=Path, metavar="DIR",
                        help="dvclive folder: real reward, episode return/length, interactions, PPO losses per "
                             "update (the pipeline gives it; without it: no curves)")


def run(args: argparse.Namespace) -> int:
    import torch

    from rlflow.agents.checkpoint import Agent, Checkpointer, fingerprint, rules_fingerprint
    from rlflow.agents.logging import EpisodeStats, TrainingLog
    from rlflow.agents.ppo import PPOConfig, train
    from rlflow.agents.real_env import RealVectorEnv, agent_summary, summarise_run
    from rlflow.atomic import write_text
    from rlflow.env import make_env
    from rlflow.nn.policy import HierarchicalPolicy
    from rlflow.search.output import verify_and_write
    from rlflow.stages.train_encoder import load_encoder

    t0 = time.perf_counter()
    check_output_paths(args)
    problem = load_seeded_problem(args)
    config, device = problem.config, problem.device
    seed = get(config, "seed")
    mf = get(config, "model_free")
    encoder = load_encoder(args.encoder, device)
    envs = [make_env(config, problem.graph, problem.rules, problem.cost, device=device) for _ in range(mf["num_envs"])]
    max_steps, max_locations = envs[0].max_steps, envs[0].max_locations
    used = {"seed": seed, "device": get(config, "device"), "cost.model": get(config, "cost.model"),
            "env.reward": get(config, "env.reward"), "ppo": get(config, "ppo"), "model_free": mf,
            "env.max_steps": get(config, "env.max_steps"), "env.max_locations": get(config, "env.max_locations")}
    ckpt = Checkpointer(args.out, fingerprint({k: v for k, v in used.items() if k not in ("device", "cost.model")},
                                             [args.encoder, args.onnx, args.rules]))
    z_dim = encoder.config["z_dim"]
    policy_args = {"in_dim": z_dim, "n_xfers": len(problem.rules), "max_locations": max_locations,
                   "hidden": get(config, "ppo.hidden")}
    policy = HierarchicalPolicy(**policy_args)
    state = ckpt.load()
    done_updates, curve, interactions, train_s = 0, [], 0, 0.0
    if state is not None:
        policy.load_state_dict(state["policy"])
        done_updates, curve, interactions = state["updates"], state["curve"], state["interactions"]
        train_s = state.get("training_seconds", 0.0)
        print(f"train_model_free: resuming after update {done_updates}", flush=True)
    live = TrainingLog(args.logs, params=used)
    live.replay(curve, "update", CURVE_NAMES)
    venv = EpisodeStats(RealVectorEnv(envs, encoder, device))
    bar = progress_bar(not args.no_progress, mf["updates"], done_updates, "model-free (real env)")
    t_train = time.perf_counter()

    def on_update(k, logs):
        n = interactions + venv.interactions
        row = {"update": done_updates + k + 1, "interactions": n, **logs, **venv.pop()}
        curve.append(row)
        live.log_row(row, "update", CURVE_NAMES)
        ckpt.save({"policy": policy.state_dict(), "updates": done_updates + k + 1, "curve": curve, "interactions": n,
                   "training_seconds": train_s + time.perf_counter() - t_train})
        bar.update(1)
        bar.set_postfix(reward=f"{logs['mean_reward']:.4f}", refresh=False)
        print(f"train_model_free: update {done_updates + k + 1}/{mf['updates']}: mean reward {logs['mean_reward']:.4f},"
              f" {n} real interactions", flush=True)

    train(venv, policy, PPOConfig.from_config(get(config, "ppo"), mf["steps_per_update"]), mf["updates"] - done_updates,
          torch.Generator().manual_seed(seed + done_updates), on_update)
    bar.close()
    train_s += time.perf_counter() - t_train
    training = interactions + venv.interactions

    agent = Agent("model_free", policy, policy_args, encoder, rules_fingerprint(problem.rules),
                  {"max_steps": max_steps, "max_locations": max_locations, "episodes": mf["eval_episodes"]},
                  config=used,
                  info={"model": args.model, "cost": problem.cost.describe(), "trained_seconds": train_s})
    result, episode = agent.optimise(problem.graph, problem.rules, problem.cost, device)
    real = summarise_run(episode)
    counts = {"training": training, "evaluation": real["steps"], "total": training + real["steps"]}
    extra = {"model": args.model, "onnx": str(args.onnx), "rules": str(args.rules), "num_rules": len(problem.rules),
             "device": device, "cost_model": problem.cost.name, "cost": describe_cost(problem, args.costs),
             "config": used, "agent": str(args.out), "reward": repr(envs[0].reward_fn), "training_seconds": train_s,
             "real_interactions": counts}
    diff, _ = verify_and_write(problem.graph, result, args.optimised, args.trace, extra, seed=seed, device=device)
    ckpt.finish(agent.payload())
    metrics = {"model": args.model, "reward": repr(envs[0].reward_fn), "real": real, "real_interactions": counts,
               "curve": curve,
               "optimised": {"speedup": result.speedup, "rules_applied": len(result.trace),
                             "optimisation_seconds": result.seconds, "max_rel_diff": diff},
               "training_seconds": train_s, "seconds": time.perf_counter() - t0}
    write_text(args.metrics, json.dumps(metrics, indent=1, default=float) + "\n")
    live.summary({"real/runtime_ms_before": real["initial"]["runtime_ms"],
                  "real/runtime_ms_after": result.final.runtime_ms, "real/speedup": result.speedup,
                  "real/improvement_pct": real["improvement_pct"], "real/steps": real["steps"],
                  "real/optimisation_seconds": result.seconds, "real_interactions": counts["total"],
                  "training_seconds": train_s})
    live.close()
    print(agent_summary(result, diff, "train_model_free"))
    print(f"train_model_free: real run: runtime {real['initial']['runtime_ms']:.3f} -> "
          f"{real['best']['runtime_ms']:.3f} ms ({real['improvement_pct']:.2f}%) in {result.seconds:.2f} s; real "
          f"interactions {counts['total']}; wrote {args.out}, {args.optimised}, {args.trace}; "
          f"{metrics['seconds']:.1f} s", flush=True)
    return 0
