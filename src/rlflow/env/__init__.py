"""The rewrite environment (Gymnasium id ``rlflow/GraphRewrite-v0``) and its reward functions.

    import gymnasium as gym, rlflow.env
    env = gym.make("rlflow/GraphRewrite-v0", graph="results/bert/model.onnx", rules="results/rules/rules.json")
    envs = gym.make_vec("rlflow/GraphRewrite-v0", num_envs=4, vectorization_mode="sync", graph=..., rules=...)
"""

import gymnasium

from rlflow.env.graph_rewrite import GraphRewriteEnv
from rlflow.env.rewards import REWARDS, Reward, make_reward

ENV_ID = "rlflow/GraphRewrite-v0"

if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="rlflow.env.graph_rewrite:GraphRewriteEnv")

__all__ = ["ENV_ID", "GraphRewriteEnv", "REWARDS", "Reward", "make_reward", "make_env"]


def make_env(config: dict, graph, rules, cost_model=None, reward: bool = True, device: str = "cpu") -> GraphRewriteEnv:
    """The environment as ``config`` describes it (env.max_steps, env.max_locations, env.reward, run.*)."""
    env_cfg = config.get("env", {})
    run = config.get("run", {})
    return GraphRewriteEnv(graph, rules, cost_model, env_cfg.get("reward") if reward else "delta",
                           max_steps=env_cfg.get("max_steps", 50), max_locations=env_cfg.get("max_locations", 200),
                           latency_device=device, latency_warmup=run.get("warmup", 2),
                           latency_repeats=run.get("repeats", 10))
