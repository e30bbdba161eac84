"""One model-free agent for several models (stage ``train_multi_model``): X-RLflow names multi-graph training --
one agent for many models -- as the open problem; this is its model-free form.

1. :func:`train_shared_encoder`: one graph encoder learns from the random rollouts of every training model, each
   episode replayed (and checked) in its own model's environment, with the ``encoder`` config as train_encoder.
2. :func:`train_shared_policy`: PPO (config ``ppo``) trains the hierarchical heads on real environments of all the
   training models at once (``multi_model.envs_per_model`` each), the shared encoder's z as input. The policy
   is checkpointed after every update to ``OUT.partial``; a killed run resumes there.

The stage then runs the agent, with no training on them, on every training model and every held-out model beside
greedy search (:func:`rlflow.agents.zero_shot.score_graph`). Real interactions are counted as for every agent
(:func:`rlflow.agents.driver.real_interactions`): the rollouts the encoder learned from, the training steps, and
the steps of its runs on the training models (the held-out runs are the test, reported apart).
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Sequence

from rlflow.config import get


def train_shared_encoder(problems: dict, rollouts: dict[str, dict], config: dict, seed: int, ckpt,
                         progress: bool = False, log: Callable[[str], None] = print, live=None,
                         stored: dict | None = None):
    """The encoder of every model in ``problems`` (name -> :class:`rlflow.problem.Problem`), trained on the
    episodes of each one's rollouts file ``rollouts[name]`` (``rlflow.rollouts/1``, checked against the rules
    and env settings), as a :class:`rlflow.agents.encoder_training.EncoderResult`, and the episodes in the order
    it saw them. ``stored[name]``, where given, is the model's rollout graphs file: its graphs are used
    (``encoder.replay_check`` episodes replayed to check them) instead of replaying every episode."""
    from rlflow.agents.encoder_training import check_rollouts, from_stored, materialise, train_encoder
    from rlflow.agents.rollouts import read_graphs, unpack_graphs
    from rlflow.env import make_env

    cfg = dict(get(config, "encoder"))
    graphs, episodes, worst, replayed_episodes, first_env = [], [], 0.0, 0, None
    for name, p in problems.items():
        env = make_env(config, p.graph, p.rules, p.cost, reward=False)
        first_env = first_env or env
        source = f"the rollouts of {name}"
        check_rollouts(rollouts[name], p.rules, env.max_steps, env.max_locations, source)
        eps = rollouts[name]["episodes"]
        path = (stored or {}).get(name)
        if path is not None:
            g, check = from_stored(env, eps, unpack_graphs(read_graphs(path), eps, str(path)),
                                   int(cfg["replay_check"]), seed, progress, source, str(path))
            how = f"from {path}, {check['replayed_episodes']} of them replayed to check them"
        else:
            g, check = materialise(env, eps, progress, source)
            how = "replayed"
        graphs += g
        episodes += eps
        worst = max(worst, check["max_metric_rel_diff"])
        replayed_episodes += check["replayed_episodes"]
        log(f"{name}: {len(eps)} rollout episodes ({sum(len(e['actions']) for e in eps)} steps), graphs {how}")
    replayed = (graphs, {"max_metric_rel_diff": worst, "count_mismatch_steps": 0,
                         "replayed_episodes": replayed_episodes})
    result = train_encoder(first_env, episodes, cfg, seed, problems[next(iter(problems))].device, ckpt,
                           progress=progress, live=live, replayed=replayed,
                           on_epoch=lambda e, loss, s: log(f"encoder epoch {e}/{cfg['epochs']}: loss {loss:.4f} "
                                                           f"({s:.1f} s)"))
    return result, episodes


def train_shared_policy(problems: Sequence, encoder, config: dict, seed: int, ckpt, progress: bool = False,
                        log: Callable[[str], None] = print, live=None,
                        latency_meter=None) -> tuple[object, dict, list[dict], int, float]:
    """PPO on real environments of every problem (see the module docstring). Returns the policy, its constructor
    arguments, the per-update curve, the real steps of training and the training seconds. ``latency_meter``: the
    e2e reward's measurement (None unless ``env.reward.name`` is e2e)."""
    import torch
    from tqdm import tqdm

    from rlflow.agents.driver import METHODS, PPO_CURVE, RealEnvs
    from rlflow.agents.logging import EpisodeStats
    from rlflow.agents.ppo import PPOConfig, train
    from rlflow.nn.policy import HierarchicalPolicy

    section = get(config, "multi_model")
    policy_args = {"in_dim": encoder.config["z_dim"], "n_xfers": len(problems[0].rules),
                   "max_locations": get(config, "env.max_locations"), "hidden": get(config, "ppo.hidden"),
                   "count_features": get(config, "ppo.count_features")}
    policy = HierarchicalPolicy(**policy_args)
    world = RealEnvs(list(problems), encoder, int(section["envs_per_model"]) * len(problems), latency_meter)
    done, curve, seconds = 0, [], 0.0
    state = ckpt.load()
    if state is not None:
        policy.load_state_dict(state["policy"])
        done, curve, seconds = int(state["updates"]), list(state["curve"]), float(state["training_seconds"])
        world.restore(state)
        log(f"resuming after update {done}")
    names = {**METHODS["model_free"]["curve"], **PPO_CURVE}
    if live is not None:
        live.replay(curve, "update", names)
    updates = int(section["updates"])
    gen = torch.Generator().manual_seed(seed + done)
    venv = EpisodeStats(world.vector_env(gen))
    bar = tqdm(total=updates, initial=done, desc="train_multi_model (real envs)", unit="update", file=sys.stderr,
               mininterval=1.0, leave=False, disable=None if progress else True)
    t0 = time.perf_counter()

    def on_update(k: int, logs: dict) -> None:
        n = done + k + 1
        row = {"update": n, "interactions": world.real_steps(), **logs, **venv.pop()}
        curve.append(row)
        if live is not None:
            live.log_row(row, "update", names)
        bar.update(1)
        ckpt.save({"policy": policy.state_dict(), "updates": n, "curve": curve,
                   "training_interactions": world.real_steps(),
                   "training_seconds": seconds + time.perf_counter() - t0})
        if n % 10 == 0 or n == updates:
            log(f"update {n}/{updates}: mean reward {logs['mean_reward']:.4f}, {world.real_steps()} real "
                "interactions in training")

    cfg = PPOConfig.from_config(get(config, "ppo"), int(section["steps_per_update"]))
    if done < updates:
        train(venv, policy, cfg, updates - done, gen, on_update)
    bar.close()
    return policy, policy_args, curve, world.real_steps(), seconds + time.perf_counter() - t0
