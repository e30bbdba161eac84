"""Train RLFlow's controller in the dream, then let it optimise the model in the real environment (stage
train_controller; the sweep stages sweep_temperature and sweep_reward run this same code with one key fixed).

PPO with the hierarchical masked heads (rule, then location) on input [z, h] is trained ONLY in the dream
(rlflow.env.dream: the world model, temperature controller.temperature, reward env.reward on predicted metric
deltas, horizon env.max_steps). Then it runs in the real environment from the original graph
(controller.eval_episodes episodes: the first greedy, the others sampled, seeded); the best graph seen,
weight-only nodes folded, is checked equal to the original under onnxruntime and written.
Real-environment interactions = the rollouts' steps (the world model's data) + this run's steps; training used
none.

Reads: seed, device, cost.model, cost.peak, env.max_steps, env.max_locations, env.reward, ppo.*, controller.*.
Writes, atomically:
  --out        the agent checkpoint, self-contained: policy, encoder and world model (states + constructor
               arguments), the rule set's fingerprint, the env settings, the config
               (`rlflow optimize IN.onnx --out OUT.onnx --method rlflow --agent controller.pt` runs it)
  --optimised  the best graph (ONNX), verified
  --trace      its trace, the searches' format (rlflow.search-trace/1, method "rlflow"): the rewrites up to the
               best step, cost before/after; `seconds` = the real run (the optimisation time), plus
               training_seconds, real_interactions {rollouts, training, evaluation, total}, max_rel_diff
  --metrics    dream curve, the real run, interactions, seconds
  --logs       dvclive folder: per PPO update the dream's reward, episode return and length, the PPO losses
               (rlflow.agents.logging; rebuilt from the start, with the saved curve, when a run resumes)
The policy is checkpointed every 10 updates to OUT.partial; a killed run, rerun with the same inputs and
config, resumes there.

Changing only the temperature or a reward parameter reruns this stage (and train_model_free for the reward),
nothing upstream: the temperature sweep of RLFlow's Table 3 is a matter of config.

Example:
  rlflow train-controller --config config.yaml --model bert --onnx results/bert/model.onnx \\
      --rules results/rules/rules.json --costs results/costs/auto/bert.json \\
      --encoder results/bert/encoder/encoder.pt --latents results/bert/encoder/latents.npz \\
      --world-model results/bert/world_model/world_model.pt --out results/bert/controller/controller.pt \\
      --metrics results/bert/controller/metrics.json --optimised results/bert/controller/model.onnx \\
      --trace results/bert/controller/trace.json --logs results/bert/controller/live
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlflow.config import get
from rlflow.errors import RLFlowError
from rlflow.stages.common import add_config_arguments, add_problem_arguments, load_seeded_problem

NAME = "train-controller"
HELP = "train the controller in the dream, let it optimise the model in the real env (pipeline stage train_controller)"

#: PPO-update row keys -> dvclive metric names
CURVE_NAMES = {"mean_reward": "dream/reward", "episode_return": "dream/episode_return",
               "episode_length": "dream/episode_length", "episodes": "dream/episodes", "clip": "loss/clip",
               "value": "loss/value", "entropy": "loss/entropy", "clip_fraction": "loss/clip_fraction"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "controller.temperature=1.0")
    add_problem_arguments(parser)
    parser.add_argument("--encoder", required=True, type=Path, help="encoder checkpoint (train_encoder)")
    parser.add_argument("--latents", required=True, type=Path, help="latents.npz (train_encoder)")
    parser.add_argument("--world-model", required=True, type=Path, help="world-model checkpoint (train_world_model)")
    parser.add_argument("--out", required=True, type=Path, help="agent checkpoint to write")
    parser.add_argument("--metrics", required=True, type=Path, help="metrics JSON to write")
    parser.add_argument("--optimised", required=True, type=Path, metavar="ONNX",
                        help="the best graph of the real run, verified (ONNX) to write")
    parser.add_argument("--trace", required=True, type=Path, metavar="JSON",
                        help="its trace (rlflow.search-trace/1) to write")
    parser.add_argument("--logs", type=Path, metavar="DIR",
                        help="dvclive folder: dream reward, episode return/length, PPO losses per update "
                             "(the pipeline gives it; without it: no curves)")


def check_output_paths(args: argparse.Namespace) -> None:
    for p in (args.out, args.metrics, args.optimised, args.trace):
        if p.is_dir():
            raise RLFlowError(f"{p}: is a folder, expected a file path")


def describe_cost(problem, costs_path) -> dict:
    """The cost model as the search traces describe it."""
    d = dict(problem.cost.describe())
    if costs_path is not None:
        d["cache"] = str(costs_path)
    table = getattr(problem.cost, "table", None)
    if table is not None:
        d["measured_signatures"] = len(table)
    return d


def progress_bar(enabled: bool, total: int, initial: int, desc: str):
    import sys

    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="update", file=sys.stderr, mininterval=1.0,
                leave=False, disable=None if enabled else True)


def run(args: argparse.Namespace) -> int:
    import torch

    from rlflow.agents.checkpoint import Agent, Checkpointer, fingerprint, rules_fingerprint
    from rlflow.agents.logging import EpisodeStats, TrainingLog
    from rlflow.agents.ppo import PPOConfig, train
    from rlflow.agents.real_env import agent_summary, summarise_run
    from rlflow.agents.world_model import load_latents, load_world_model
    from rlflow.atomic import write_text
    from rlflow.env.dream import DreamEnv
    from rlflow.env.rewards import make_reward
    from rlflow.nn.policy import HierarchicalPolicy
    from rlflow.search.output import verify_and_write
    from rlflow.stages.train_encoder import load_encoder

    t0 = time.perf_counter()
    check_output_paths(args)
    problem = load_seeded_problem(args)
    config, device = problem.config, problem.device
    seed = get(config, "seed")
    ctl = get(config, "controller")
    max_steps, max_locations = get(config, "env.max_steps"), get(config, "env.max_locations")
    encoder = load_encoder(args.encoder, device)
    wm = load_world_model(args.world_model, "cpu")
    lat = load_latents(args.latents)
    if int(lat["n_xfers"]) != len(problem.rules):
        raise RLFlowError(f"{args.latents}: made with {int(lat['n_xfers'])} rules, {args.rules} has "
                          f"{len(problem.rules)}")
    start_z = torch.from_numpy(lat["z"][0, 0]).float()
    start_metrics = torch.from_numpy(lat["metrics"][0, 0]).double()
    start_counts = torch.from_numpy(lat["counts"][0, 0]).float()
    reward = make_reward(get(config, "env.reward"))
    # the dream's own minibatch size where the config sets one (controller.minibatch; dream samples are cheap)
    cfg = PPOConfig.from_config(get(config, "ppo"), ctl["steps_per_update"], minibatch=ctl.get("minibatch"))
    used = {"seed": seed, "device": get(config, "device"), "cost.model": get(config, "cost.model"),
            "env.reward": get(config, "env.reward"), "ppo": get(config, "ppo"), "controller": ctl,
            "env.max_steps": max_steps, "env.max_locations": max_locations}
    ckpt = Checkpointer(args.out, fingerprint({k: v for k, v in used.items() if k not in ("device", "cost.model")},
                                             [args.world_model, args.latents]))
    state = ckpt.load()
    policy_args = {"in_dim": start_z.shape[-1] + wm.hidden_size, "n_xfers": len(problem.rules),
                   "max_locations": max_locations, "hidden": get(config, "ppo.hidden")}
    policy = HierarchicalPolicy(**policy_args)
    done_updates, curve, train_s, dream_steps = 0, [], 0.0, 0
    if state is not None:
        policy.load_state_dict(state["policy"])
        done_updates, curve = state["updates"], state["curve"]
        train_s, dream_steps = state.get("training_seconds", 0.0), state.get("dream_steps", 0)
        print(f"train_controller: resuming after update {done_updates}", flush=True)

    live = TrainingLog(args.logs, params=used)
    live.replay(curve, "update", CURVE_NAMES)
    remaining = ctl["updates"] - done_updates
    print(f"train_controller: {args.model}: dream x{ctl['num_envs']}, tau {ctl['temperature']}, reward "
          f"{reward!r}, {remaining} updates of {ctl['steps_per_update']} steps", flush=True)

    # the dream (rlflow.agents.controller.train_in_dream, with the episodes recorded for the curves)
    gen = torch.Generator().manual_seed(seed + done_updates)
    dream = EpisodeStats(DreamEnv(wm, start_z, start_metrics, start_counts, reward, max_steps, max_locations,
                                  ctl["temperature"], ctl["num_envs"], generator=gen))
    wm.eval()
    bar = progress_bar(not args.no_progress, ctl["updates"], done_updates, "controller (dream)")
    t_train = time.perf_counter()

    def on_update(k, logs):
        n = done_updates + k + 1
        row = {"update": n, **logs, **dream.pop()}
        curve.append(row)
        live.log_row(row, "update", CURVE_NAMES)
        bar.update(1)
        bar.set_postfix(reward=f"{logs['mean_reward']:.4f}", refresh=False)
        if n % 10 == 0 or n == ctl["updates"]:
            ckpt.save({"policy": policy.state_dict(), "updates": n, "curve": curve, "dream_steps":
                       dream_steps + dream.steps_taken, "training_seconds": train_s + time.perf_counter() - t_train})
            print(f"train_controller: update {n}/{ctl['updates']}: mean dream reward {logs['mean_reward']:.4f}",
                  flush=True)

    train(dream, policy, cfg, remaining, gen, on_update)
    bar.close()
    train_s += time.perf_counter() - t_train
    dream_steps += dream.steps_taken

    # the trained agent optimises the model in the real environment
    agent = Agent("rlflow", policy, policy_args, encoder, rules_fingerprint(problem.rules),
                  {"max_steps": max_steps, "max_locations": max_locations,
                   "episodes": ctl.get("eval_episodes", 1)}, world_model=wm, config=used,
                  info={"model": args.model, "cost": problem.cost.describe(), "trained_seconds": train_s})
    result, episode = agent.optimise(problem.graph, problem.rules, problem.cost, device)
    real = summarise_run(episode)
    rollout_steps = int(lat["lengths"].sum())
    interactions = {"rollouts": rollout_steps, "training": 0, "evaluation": real["steps"],
                    "total": rollout_steps + real["steps"]}
    extra = {"model": args.model, "onnx": str(args.onnx), "rules": str(args.rules), "num_rules": len(problem.rules),
             "device": device, "cost_model": problem.cost.name, "cost": describe_cost(problem, args.costs),
             "config": used, "agent": str(args.out), "temperature": ctl["temperature"], "reward": repr(reward),
             "training_seconds": train_s, "dream_steps": dream_steps, "real_interactions": interactions}
    diff, _ = verify_and_write(problem.graph, result, args.optimised, args.trace, extra, seed=seed, device=device)
    ckpt.finish(agent.payload())
    metrics = {"model": args.model, "temperature": ctl["temperature"], "reward": repr(reward),
               "dream_steps": dream_steps, "real": real, "real_interactions": interactions, "curve": curve,
               "optimised": {"speedup": result.speedup, "rules_applied": len(result.trace),
                             "optimisation_seconds": result.seconds, "max_rel_diff": diff},
               "training_seconds": train_s, "seconds": time.perf_counter() - t0}
    write_text(args.metrics, json.dumps(metrics, indent=1, default=float) + "\n")
    live.summary({"real/runtime_ms_before": real["initial"]["runtime_ms"],
                  "real/runtime_ms_after": result.final.runtime_ms, "real/speedup": result.speedup,
                  "real/improvement_pct": real["improvement_pct"], "real/steps": real["steps"],
                  "real/optimisation_seconds": result.seconds, "real_interactions": interactions["total"],
                  "dream_steps": dream_steps, "training_seconds": train_s})
    live.close()
    print(agent_summary(result, diff, "train_controller"))
    print(f"train_controller: real run: runtime {real['initial']['runtime_ms']:.3f} -> {real['best']['runtime_ms']:.3f}"
          f" ms ({real['improvement_pct']:.2f}%), {real['steps']} real steps in {result.seconds:.2f} s; real "
          f"interactions in all {interactions['total']} ({dream_steps} dream steps); wrote {args.out}, "
          f"{args.optimised}, {args.trace}; {metrics['seconds']:.1f} s", flush=True)
    return 0
