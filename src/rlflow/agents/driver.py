"""The one driver of the agent-training stages: ``train_controller`` (and its sweeps ``sweep_temperature`` and
``sweep_reward``, which run it with one key fixed) and ``train_model_free`` are argument parsing plus one call to
:func:`run_agent_stage`, which

1. loads the problem (model, rules, cost model) and the trained encoder, seeds everything;
2. builds the environment PPO trains in: the dream (the world model only; RLFlow's controller) or real rewrite
   environments behind the encoder (the model-free baseline);
3. trains the hierarchical policy with PPO, checkpointing to ``OUT.partial`` (a killed run resumes there) and
   logging its curves (dvclive);
4. lets the trained agent optimise the model in the real environment (:meth:`Agent.optimise`);
5. checks the best graph equal to the original under onnxruntime and writes it, its trace, the metrics and the
   self-contained agent checkpoint.

Real-environment interactions are counted one way for every agent (:func:`real_interactions`): every real env
step whose data trained or selected anything the agent uses: the rollouts its encoder (and world model) learned
from, the real steps of training, and the real steps of its optimisation run; each counted by the environments
themselves (``GraphRewriteEnv.total_steps``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlflow.config import get
from rlflow.cost.platform import resolve_platform, resolved_reward
from rlflow.errors import RLFlowError

#: how each agent trains: config section, how often the policy is checkpointed (updates), and the dvclive name
#: of each PPO-update row key
METHODS = {
    "rlflow": {"stage": "train_controller", "section": "controller", "save_every": 10, "where": "dream",
               "curve": {"mean_reward": "dream/reward", "episode_return": "dream/episode_return",
                         "disagreement": "dream/disagreement",
                         "episode_length": "dream/episode_length", "episodes": "dream/episodes"}},
    "model_free": {"stage": "train_model_free", "section": "model_free", "save_every": 1, "where": "real env",
                   "curve": {"mean_reward": "real/reward", "episode_return": "real/episode_return",
                             "episode_length": "real/episode_length", "episodes": "real/episodes",
                             "interactions": "real/interactions"}},
}
PPO_CURVE = {"clip": "loss/clip", "value": "loss/value", "entropy": "loss/entropy", "clip_fraction": "loss/clip_fraction"}


@dataclass
class AgentFiles:
    """The files of one agent-training job (the stage's inputs and outputs)."""

    onnx: Path
    rules: Path
    encoder: Path
    out: Path              # the agent checkpoint (self-contained; ``rlflow optimize --method rlflow --agent``)
    metrics: Path
    optimised: Path        # the best graph, verified (ONNX)
    trace: Path            # its trace (rlflow.search-trace/2)
    costs: Path | None = None
    logs: Path | None = None          # dvclive folder (optional)
    latents: Path | None = None       # the controller: latents.npz (train_encoder)
    world_model: Path | None = None   # the controller: the world model (train_world_model)

    def inputs(self) -> list[Path]:
        return [p for p in (self.onnx, self.rules, self.costs, self.encoder, self.latents, self.world_model) if p]


def real_interactions(rollouts: int, training: int, evaluation: int) -> dict[str, int]:
    """The real-environment interactions of an agent, split by what they served, and their total."""
    return {"rollouts": int(rollouts), "training": int(training), "evaluation": int(evaluation),
            "total": int(rollouts) + int(training) + int(evaluation)}


def snapshot_updates(updates: int, episodes: int) -> set[int]:
    """The PPO updates after which the policy is kept for the real evaluation (config ``eval_policies:
    snapshots``): ``episodes`` of them, evenly spaced, the last the final update (fewer when there are fewer
    updates)."""
    return {round(updates * i / episodes) for i in range(1, episodes + 1)} - {0}


def describe_cost(problem, costs_path) -> dict:
    """The cost model as the search traces describe it."""
    d = dict(problem.cost.describe())
    if costs_path is not None:
        d["cache"] = str(costs_path)
    table = getattr(problem.cost, "table", None)
    if table is not None:
        d["measured_signatures"] = len(table)
    return d


class _Dream:
    """The controller's training world: the dream of the world model, from the first rollout step's z (and with
    ``controller.branch_starts`` > 0 that share of its episodes from a real graph of the world model's data, part
    way through its episode: :func:`rlflow.env.dream.data_starts`).

    Iterated model-based training (``controller.iterations`` > 1): at each iteration boundary :meth:`refit` runs
    the controller as it is now in a real environment for ``controller.collect_episodes`` sampled episodes (each
    step a real interaction, counted), adds their steps (encoded by the encoder) to the world model's data and
    trains the world model again on all of it (config section world_model, a new seed per iteration); PPO then
    goes on in the new model's dream."""

    def __init__(self, problem, files: AgentFiles, encoder, section: dict, max_steps: int, max_locations: int,
                 reward, wm_config: dict | None = None):
        import torch

        from rlflow.agents.world_model import load_latents, load_world_model

        if files.latents is None or files.world_model is None:
            raise RLFlowError("train_controller needs --latents and --world-model")
        self.wm = load_world_model(files.world_model, "cpu")
        self.wm.eval()
        lat = load_latents(files.latents)
        if int(lat["n_xfers"]) != len(problem.rules):
            raise RLFlowError(f"{files.latents}: made with {int(lat['n_xfers'])} rules, {files.rules} has "
                              f"{len(problem.rules)}")
        if int(lat["lengths"].sum()) != encoder.rollout_steps:
            raise RLFlowError(f"{files.latents}: {int(lat['lengths'].sum())} rollout steps, the encoder "
                              f"{files.encoder} learned from {encoder.rollout_steps}: not from the same train_encoder run")
        self.start = (torch.from_numpy(lat["z"][0, 0]).float(), torch.from_numpy(lat["metrics"][0, 0]).double(),
                      torch.from_numpy(lat["counts"][0, 0]).float())
        self.args = (reward, max_steps, max_locations, section["temperature"], section["num_envs"])
        self.penalty = float(section.get("disagreement_penalty", 0.0))
        self.branch = float(section.get("branch_starts", 0.0))
        self.in_dim = self.start[0].shape[-1] + self.wm.hidden_size
        self.problem, self.encoder, self.latents, self.wm_config = problem, encoder, lat, wm_config
        self.data = lat  # the world model's data: the rollouts, and after a refit the collected episodes too
        self.collect_episodes = int(section.get("collect_episodes", 0))
        self.collected: list[dict] = []  # the real episodes of the iterations so far
        self.iteration = 0

    def refit(self, policy, seed: int, progress: bool = False) -> dict:
        """One iteration of model-based training (see the class docstring); its figures."""
        from rlflow.agents.controller import ControllerActor
        from rlflow.agents.rollouts import collect
        from rlflow.agents.world_model import evaluate, train
        from rlflow.env import make_env
        import torch

        self.iteration += 1
        p = self.problem
        env = make_env(p.config, p.graph, p.rules, p.cost)
        actor = ControllerActor(policy, self.encoder, self.wm, p.device, False,
                                torch.Generator().manual_seed(seed + self.iteration))
        self.collected += collect(env, self.collect_episodes, 0.0, seed + self.iteration, actor=actor)
        data = self.data = self._data(env)
        res = train(data, self.wm_config, seed + self.iteration, p.device, progress=progress)
        self.wm = res["model"].to("cpu").eval()
        quality = evaluate(self.wm, data, res["heldout_episodes"], "cpu")
        return {"iteration": self.iteration, "real_episodes": len(self.collected),
                "real_steps": self.real_steps(), "heldout_reward_rmse": quality.get("reward_rmse"),
                "heldout_false_change_rate": quality.get("false_change_rate")}

    def _data(self, env) -> dict:
        """The rollouts' latents and the collected episodes' steps (training episodes), as one data set."""
        import numpy as np

        from rlflow.agents.encoder_training import encode, latents_arrays, materialise
        from rlflow.agents.world_model import merge_latents

        graphs, _ = materialise(env, self.collected, source="the controller's real episodes")
        flat = encode(self.encoder, [g for seq in graphs for g in seq], self.problem.device, 64)
        ends = np.cumsum([len(seq) for seq in graphs])[:-1]
        lat = self.latents
        new = latents_arrays(self.collected, np.split(flat, ends), np.zeros(len(self.collected), bool),
                             lat["z"].shape[1] - 1, int(lat["n_xfers"]), int(lat["max_locations"]), int(lat["z_dim"]))
        return merge_latents(lat, new)

    def state(self) -> dict:
        """What a resumed run needs: the collected episodes and the current world model."""
        return {"iteration": self.iteration, "collected": self.collected,
                "world_model": self.wm.state_dict() if self.iteration else None}

    def restore(self, state: dict) -> None:
        """The collected episodes (their steps are this world's real steps) and the world model of a saved run."""
        self.iteration, self.collected = int(state.get("iteration", 0)), list(state.get("collected", []))
        if self.iteration:
            from rlflow.nn.mdnrnn import make_world_model

            self.wm = make_world_model(**self.wm.config)
            self.wm.load_state_dict(state["world_model"])
            self.wm.eval()

    def vector_env(self, generator):
        from rlflow.env.dream import DreamEnv, data_starts

        reward, max_steps, max_locations, tau, n = self.args
        if self.branch > 0 and self.collected and self.data is self.latents:  # resumed after a refit
            from rlflow.env import make_env

            p = self.problem
            self.data = self._data(make_env(p.config, p.graph, p.rules, p.cost))
        starts = data_starts(self.wm, self.data, max_steps) if self.branch > 0 else None
        self.env = DreamEnv(self.wm, *self.start, reward, max_steps, max_locations, tau, n, generator=generator,
                            disagreement_penalty=self.penalty, starts=starts, branch=self.branch)
        return self.env

    def update_stats(self) -> dict:
        """An ensemble's mean disagreement over the moves since the last call (nothing for one world model)."""
        d = self.env.mean_disagreement()
        self.env.disagreement_sum, self.env.disagreement_moves = 0.0, 0
        return {} if d is None else {"disagreement": d}

    def real_steps(self) -> int:
        """Real steps of training: those of the collected episodes (the dream itself takes none)."""
        return sum(len(e["actions"]) for e in self.collected)


class RealEnvs:
    """The model-free agent's training world: ``num_envs`` real rewrite environments behind the encoder, of the
    problems in turn (one problem: all of it; the multi-model agent: its models, round robin)."""

    def __init__(self, problems, encoder, num_envs: int, latency_meter=None):
        from rlflow.env import make_env

        self.encoder, self.device = encoder, problems[0].device
        self.envs = [make_env(p.config, p.graph, p.rules, p.cost, latency_meter=latency_meter)
                     for p in (problems[i % len(problems)] for i in range(num_envs))]
        self.wm, self.in_dim = None, encoder.config["z_dim"]
        self.iteration, self.before = 0, 0

    def vector_env(self, generator):
        from rlflow.agents.real_env import RealVectorEnv

        return RealVectorEnv(self.envs, self.encoder, self.device)

    def real_steps(self) -> int:
        """Real steps of training: those before a resume and those of these environments."""
        return self.before + sum(env.total_steps for env in self.envs)

    def update_stats(self) -> dict:
        return {}

    def state(self) -> dict:
        return {}

    def restore(self, state: dict) -> None:
        self.before = int(state["training_interactions"])


def _progress_bar(enabled: bool, total: int, initial: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="update", file=sys.stderr, mininterval=1.0,
                leave=False, disable=None if enabled else True)


def run_agent_stage(method: str, model: str, config: dict, files: AgentFiles, progress: bool = True,
                    speed_check=None, latency_meter=None) -> dict:
    """Train the agent of ``method`` ("rlflow": the controller in the dream; "model_free": PPO on the real env),
    let it optimise the model, verify and write every output (see the module docstring); returns the metrics.
    ``speed_check(device)`` gives the never-slower check of the written graph (the stages pass the measurement
    protocol's, :func:`rlflow.search.output.verify_and_write`); None: no check. ``latency_meter(device)`` gives
    the e2e reward's measurement for the real environments (the stages pass the protocol's); None: none."""
    import torch

    from rlflow.agents.checkpoint import Agent, Checkpointer, fingerprint, load_encoder, rules_fingerprint
    from rlflow.agents.logging import EpisodeStats, TrainingLog
    from rlflow.agents.ppo import PPOConfig, train
    from rlflow.agents.real_env import agent_summary, summarise_run
    from rlflow.atomic import write_text
    from rlflow.env.rewards import make_reward
    from rlflow.nn.policy import HierarchicalPolicy
    from rlflow.problem import load_problem, seed_for_training
    from rlflow.search.output import verify_and_write

    spec = METHODS[method]
    label = spec["stage"]
    t0 = time.perf_counter()
    for p in (files.out, files.metrics, files.optimised, files.trace):
        if p.is_dir():
            raise RLFlowError(f"{p}: is a folder, expected a file path")
    problem = load_problem(config, files.onnx, files.rules, files.costs)
    seed, device = seed_for_training(problem), problem.device
    section = get(config, spec["section"])
    max_steps, max_locations = get(config, "env.max_steps"), get(config, "env.max_locations")
    platform = resolve_platform(config)
    reward = make_reward(resolved_reward(config, platform))
    encoder = load_encoder(files.encoder, device)
    world = (_Dream(problem, files, encoder, section, max_steps, max_locations, reward, get(config, "world_model"))
             if method == "rlflow"
             else RealEnvs([problem], encoder, section["num_envs"],
                           None if latency_meter is None or not reward.needs_latency else latency_meter(device)))

    used = {"seed": seed, "device": get(config, "device"), "cost.target": platform.target,
            "env.reward": resolved_reward(config, platform), "ppo": get(config, "ppo"), spec["section"]: section,
            "env.max_steps": max_steps, "env.max_locations": max_locations,
            "env.no_revisit": get(config, "env.no_revisit")}
    if method == "rlflow":  # iterated model-based training trains the world model again
        used["world_model"] = get(config, "world_model")
    ckpt = Checkpointer(files.out, fingerprint({k: v for k, v in used.items() if k not in ("device", "cost.target")},
                                              files.inputs()))
    policy_args = {"in_dim": world.in_dim, "n_xfers": len(problem.rules), "max_locations": max_locations,
                   "hidden": get(config, "ppo.hidden"),
                   "count_features": get(config, "ppo.count_features")}
    policy = HierarchicalPolicy(**policy_args)
    done, curve, train_s, dream_before, refits, snapshots = 0, [], 0.0, 0, [], {}
    state = ckpt.load()
    if state is not None:
        policy.load_state_dict(state["policy"])
        done, curve, train_s = state["updates"], state["curve"], state["training_seconds"]
        dream_before, refits = state["dream_steps"], list(state.get("refits", []))
        snapshots = dict(state.get("snapshots", {}))
        world.restore(state)
        print(f"{label}: resuming after update {done}", flush=True)

    names = {**spec["curve"], **PPO_CURVE}
    live = TrainingLog(files.logs, params=used)
    live.replay(curve, "update", names)
    updates = section["updates"]
    iterations = int(section.get("iterations", 1)) if method == "rlflow" else 1
    # the updates after which the controller collects real episodes and the world model is trained again
    bounds = sorted({round(updates * i / iterations) for i in range(1, iterations)} - {0, updates})
    snapshot_at = snapshot_updates(updates, section["eval_episodes"]) \
        if section.get("eval_policies", "final") == "snapshots" else set()
    print(f"{label}: {model}: PPO in the {spec['where']} x{section['num_envs']}, reward {reward!r}, "
          f"{updates - done} updates of {section['steps_per_update']} steps"
          + (f"; world model refitted after updates {', '.join(map(str, bounds))}" if bounds else ""), flush=True)

    gen = torch.Generator().manual_seed(seed + done)
    venv = EpisodeStats(world.vector_env(gen))
    dream_steps = lambda: dream_before + (venv.steps_taken if method == "rlflow" else 0)  # noqa: E731
    training_interactions = world.real_steps
    bar = _progress_bar(progress, updates, done, f"{label} ({spec['where']})")
    t_train = time.perf_counter()

    def save(n: int) -> None:
        ckpt.save({"policy": policy.state_dict(), "updates": n, "curve": curve, "dream_steps": dream_steps(),
                   "training_interactions": training_interactions(), "refits": refits, "snapshots": snapshots,
                   **world.state(),
                   "training_seconds": train_s + time.perf_counter() - t_train})

    def on_update(k: int, logs: dict) -> None:
        n = done + k + 1
        row = {"update": n, "interactions": training_interactions(), **logs, **venv.pop(), **world.update_stats()}
        curve.append(row)
        live.log_row(row, "update", names)
        bar.update(1)
        bar.set_postfix(reward=f"{logs['mean_reward']:.4f}", refresh=False)
        if n in snapshot_at:
            snapshots[n] = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        if n % spec["save_every"] == 0 or n == updates or n in bounds or n in snapshot_at:
            save(n)
            print(f"{label}: update {n}/{updates}: mean reward in the {spec['where']} {logs['mean_reward']:.4f}, "
                  f"{training_interactions()} real interactions in training", flush=True)

    cfg = PPOConfig.from_config(get(config, "ppo"), section["steps_per_update"], minibatch=section.get("minibatch"))
    while True:
        # the refits due by now (a resumed run may have stopped between an iteration's training and its refit)
        while world.iteration < sum(b <= done for b in bounds):
            dream_before += venv.steps_taken
            refits.append(world.refit(policy, seed, progress))
            for n in [n for n in snapshots if n <= done]:  # their h came from the world model just replaced
                del snapshots[n]
            r = refits[-1]
            print(f"{label}: iteration {r['iteration']}: {r['real_episodes']} real episodes of the controller so "
                  f"far ({r['real_steps']} steps), world model trained again (held-out reward RMSE "
                  f"{r['heldout_reward_rmse']})", flush=True)
            venv = EpisodeStats(world.vector_env(gen))
            save(done)
        if done >= updates:
            break
        target = next((b for b in bounds if b > done), updates)
        train(venv, policy, cfg, target - done, gen, on_update)
        done = target
    bar.close()
    train_s += time.perf_counter() - t_train

    # the trained agent optimises the model in the real environment
    # with snapshots the agent kept is the best snapshot, run as in its evaluation episode: greedily, once
    agent = Agent(method, policy, policy_args, encoder, rules_fingerprint(problem.rules),
                  {"max_steps": max_steps, "max_locations": max_locations,
                   "episodes": 1 if snapshots else section["eval_episodes"],
                   "no_revisit": get(config, "env.no_revisit"),
                   "plan_min_saving": section["plan_min_saving"] if method == "rlflow" and section["plan"] else None},
                  world_model=world.wm, config=used,
                  info={"model": model, "cost": problem.cost.describe(), "trained_seconds": train_s})
    kept = sorted(snapshots)
    t_optimise = time.perf_counter()
    result, episode = agent.optimise(problem.graph, problem.rules, problem.cost, device,
                                     snapshots=[snapshots[n] for n in kept] or None)
    real = summarise_run(episode)
    if kept:
        real["snapshots"] = kept
        real["snapshot_kept"] = kept[episode["best_episode"]]
        real["snapshot_best_runtime_ms"] = episode["episode_best_runtime_ms"]
    interactions = real_interactions(encoder.rollout_steps, training_interactions(), real["steps"])
    metrics = {"model": model, "method": method, "platform": platform.as_dict(), "reward": repr(reward),
               "real": real,
               "real_interactions": interactions, "dream_steps": dream_steps(), "curve": curve,
               "training_seconds": train_s}
    if method == "rlflow":
        metrics["temperature"] = section["temperature"]
        metrics["iterations"] = refits
        # the kept episode's steps that the one-step plan with the world model chose (controller.plan)
        metrics["plan"] = {"min_saving": agent.env["plan_min_saving"], "planned_steps": episode.get("planned_steps", 0),
                           "episode_steps": len(episode["actions"])}
    extra = {"model": model, "onnx": str(files.onnx), "rules": str(files.rules), "num_rules": len(problem.rules),
             "device": device, "cost_model": problem.cost.name, "cost": describe_cost(problem, files.costs),
             "config": used, "platform": platform.as_dict(), "agent": str(files.out), "reward": repr(reward),
             "training_seconds": train_s,
             "dream_steps": dream_steps(), "real_interactions": interactions}
    t_check = time.perf_counter()
    diff, written = verify_and_write(problem.graph, result, files.optimised, files.trace, extra, seed=seed,
                                     device=device, speed_check=None if speed_check is None else speed_check(device),
                                     log=lambda line: print(f"{label}: {line}", flush=True))
    # where this run's time went (a GPU box verifies sim-* graphs on the GPU, which a CPU box cannot)
    metrics["phase_seconds"] = {"setup": t_train - t0, "training": t_optimise - t_train,
                                "optimisation": t_check - t_optimise, "checks": time.perf_counter() - t_check}
    if "speed_check" in written:
        metrics["speed_check"] = written["speed_check"]
    ckpt.finish(agent.payload())
    metrics["optimised"] = {"speedup": result.speedup, "rules_applied": len(result.trace),
                            "optimisation_seconds": result.seconds, "max_rel_diff": diff}
    metrics["seconds"] = time.perf_counter() - t0
    write_text(files.metrics, json.dumps(metrics, indent=1, default=float) + "\n")
    live.summary({"real/runtime_ms_before": real["initial"]["runtime_ms"],
                  "real/runtime_ms_after": result.final.runtime_ms, "real/speedup": result.speedup,
                  "real/improvement_pct": real["improvement_pct"], "real/steps": real["steps"],
                  "real/optimisation_seconds": result.seconds, "real_interactions": interactions["total"],
                  "dream_steps": dream_steps(), "training_seconds": train_s})
    live.close()
    print(agent_summary(result, diff, label))
    print(f"{label}: real run: runtime {real['initial']['runtime_ms']:.3f} -> {real['best']['runtime_ms']:.3f} ms "
          f"({real['improvement_pct']:.2f}%), {real['steps']} real steps in {result.seconds:.2f} s; real interactions "
          f"in all {interactions['total']} ({interactions['rollouts']} rollouts, {interactions['training']} "
          f"training, {interactions['evaluation']} evaluation; {dream_steps()} dream steps); wrote {files.out}, "
          f"{files.optimised}, {files.trace}; {metrics['seconds']:.1f} s", flush=True)
    return metrics
