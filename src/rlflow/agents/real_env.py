"""Real rewrite environments seen through the graph encoder, for the agents: a batched :class:`VectorEnv`
(PPO's interface) for the model-free agent, and evaluation episodes for any trained policy. Every real
environment step is counted (``interactions``): real-env interactions are a headline figure."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from rlflow.cost import METRIC_NAMES
from rlflow.env.graph_rewrite import GraphRewriteEnv
from rlflow.nn.graph_data import batch, to_data


@torch.no_grad()
def encode(encoder, observations: Sequence[dict], device: str = "cpu") -> torch.Tensor:
    """Observations of real environments -> z [B, Z] (the encoder in eval mode)."""
    encoder.eval()
    return encoder(batch([to_data(o) for o in observations]).to(device)).cpu()


def mask_tensors(observations: Sequence[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    xm = torch.from_numpy(np.stack([o["xfer_mask"] for o in observations])).bool()
    lm = torch.from_numpy(np.stack([o["location_mask"] for o in observations])).bool()
    return xm, lm


class RealVectorEnv:
    """B real environments behind the encoder: features = z of each current graph. Ended episodes restart."""

    def __init__(self, envs: Sequence[GraphRewriteEnv], encoder, device: str = "cpu"):
        self.envs, self.encoder, self.device = list(envs), encoder, device
        self.num_envs = len(self.envs)
        self.interactions = 0
        self.best_runtime = float("inf")
        self.episode_returns: list[float] = []
        self._returns = [0.0] * self.num_envs

    def _observe(self) -> dict[str, torch.Tensor]:
        xm, lm = mask_tensors(self.obs)
        return {"features": encode(self.encoder, self.obs, self.device), "xfer_mask": xm, "location_mask": lm}

    def reset(self) -> dict[str, torch.Tensor]:
        self.obs = [env.reset()[0] for env in self.envs]
        return self._observe()

    def step_batch(self, xfer: torch.Tensor, loc: torch.Tensor):
        rewards, dones = [], []
        for i, env in enumerate(self.envs):
            obs, reward, terminated, truncated, info = env.step((int(xfer[i]), int(loc[i])))
            self.interactions += 1
            self.best_runtime = min(self.best_runtime, info["runtime_ms"])
            self._returns[i] += reward
            done = terminated or truncated
            if done:
                self.episode_returns.append(self._returns[i])
                self._returns[i] = 0.0
                obs, _ = env.reset()
            self.obs[i] = obs
            rewards.append(reward)
            dones.append(done)
        return self._observe(), torch.tensor(rewards, dtype=torch.float32), torch.tensor(dones)


@torch.no_grad()
def run_episode(env: GraphRewriteEnv, choose: Callable[[dict, torch.Tensor, torch.Tensor], tuple[int, int]],
                after_step: Callable[[dict, tuple[int, int]], None] | None = None) -> dict:
    """One episode from the original graph. ``choose(obs, xfer_mask, location_mask) -> action``; the best
    graph seen (lowest estimated runtime) is kept. Returns actions, metrics, steps, the best graph and its
    metrics."""
    obs, info = env.reset()
    best = {k: info[k] for k in METRIC_NAMES}
    best_graph, best_step = env.graph, 0
    actions, metrics = [], [best]
    done = False
    while not done:
        xm, lm = mask_tensors([obs])
        action = choose(obs, xm, lm)
        obs, _, terminated, truncated, info = env.step(action)
        if after_step is not None:
            after_step(obs, action)
        actions.append(list(action))
        m = {k: info[k] for k in METRIC_NAMES}
        metrics.append(m)
        if m["runtime_ms"] < best["runtime_ms"]:
            best, best_graph, best_step = m, env.graph, len(actions)
        done = terminated or truncated
    return {"actions": actions, "metrics": metrics, "steps": len(actions), "best": best, "best_graph": best_graph,
            "best_step": best_step, "initial": metrics[0]}


def summarise_run(result: dict) -> dict:
    """The JSON-ready part of :func:`run_episode`'s result, with the runtime improvement in percent."""
    a, b = result["initial"]["runtime_ms"], result["best"]["runtime_ms"]
    return {"initial": result["initial"], "best": result["best"], "best_step": result["best_step"],
            "steps": result["steps"], "improvement_pct": (a - b) / a * 100 if a else 0.0,
            "actions": result["actions"]}
