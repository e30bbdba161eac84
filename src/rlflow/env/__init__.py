"""The rewrite environment (Gymnasium id ``rlflow/GraphRewrite-v0``) and its reward functions, and the XLA
pass-ordering environment ``rlflow/XlaPassOrder-v0`` (:mod:`rlflow.env.xla_pass_order`).

    import gymnasium as gym
    env = gym.make("rlflow/GraphRewrite-v0")                # no other import needed
    env = gym.make("rlflow/GraphRewrite-v0", graph="results/bert/model.onnx", rules="results/rules/rules.json")
    envs = gym.make_vec("rlflow/GraphRewrite-v0", num_envs=4, vectorization_mode="sync", graph=..., rules=...)

Registration. Importing this package registers the id (:func:`register_envs`). Without that import: the
distribution declares :func:`register_envs` in the ``gymnasium.envs`` entry-point group, which Gymnasium 0.26 to
0.29 load when ``gymnasium`` is imported; Gymnasium 1.0 dropped that loader, so the installed package also ships a
start-up hook (``rlflow-gymnasium.pth``, :mod:`rlflow._gym_hook`) that calls :func:`register_envs` as soon as
``gymnasium`` has been imported. The module-prefixed id ``"rlflow.env:rlflow/GraphRewrite-v0"`` works as well.

With no arguments the env is a small working default: the tiny BERT of the model zoo (``data/tiny-bert.onnx``),
the builtin rules and the analytic CPU cost model (no measured files), so ``gym.make(ENV_ID)`` and Gymnasium's
env checker work out of the box.

This package imports gymnasium and nothing heavy: the environment class, rewards and :func:`make_env` load on
first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

ENV_ID = "rlflow/GraphRewrite-v0"
ENTRY_POINT = "rlflow.env.graph_rewrite:GraphRewriteEnv"
XLA_ENV_ID = "rlflow/XlaPassOrder-v0"
XLA_ENTRY_POINT = "rlflow.env.xla_pass_order:XlaPassOrderEnv"

if TYPE_CHECKING:
    from rlflow.env.graph_rewrite import GraphRewriteEnv
    from rlflow.env.rewards import REWARDS, Reward, make_reward

__all__ = ["ENV_ID", "XLA_ENV_ID", "GraphRewriteEnv", "REWARDS", "Reward", "make_reward", "make_env", "register_envs"]

_LAZY = {"GraphRewriteEnv": "rlflow.env.graph_rewrite", "REWARDS": "rlflow.env.rewards",
         "Reward": "rlflow.env.rewards", "make_reward": "rlflow.env.rewards"}


def register_envs() -> None:
    """Register ``rlflow/GraphRewrite-v0`` and ``rlflow/XlaPassOrder-v0`` with Gymnasium (once; the classes are
    imported when an env is made)."""
    from gymnasium.envs.registration import register, registry

    if ENV_ID not in registry:
        register(id=ENV_ID, entry_point=ENTRY_POINT)
    if XLA_ENV_ID not in registry:
        register(id=XLA_ENV_ID, entry_point=XLA_ENTRY_POINT)


register_envs()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_env(config: dict, graph, rules, cost_model=None, reward: bool = True, latency_meter=None) -> GraphRewriteEnv:
    """The environment as ``config`` describes it (env.max_steps, env.max_locations, env.reward);
    ``latency_meter``: the e2e reward's measurement (rlflow.evaluation.protocol.latency_meter)."""
    from rlflow.env.graph_rewrite import GraphRewriteEnv

    env_cfg = config.get("env", {})
    return GraphRewriteEnv(graph, rules, cost_model, env_cfg.get("reward") if reward else "delta",
                           max_steps=env_cfg.get("max_steps", 50), max_locations=env_cfg.get("max_locations", 200),
                           latency_meter=latency_meter)
