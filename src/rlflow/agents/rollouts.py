"""Random rollouts in the rewrite environment, stored without graphs (the environment is deterministic, so a
graph is re-materialised by replaying its episode's actions: :func:`replay`).

File format ``rlflow.rollouts/1`` (one JSON object)::

    {format, model, shards: [k...], seed, rules: {count, digest}, env: {max_steps, max_locations},
     cost: {model, device, ...}, metric_names: [runtime_ms, flops, bytes, launches],
     episodes: [{shard, index,
                 actions:    [[xfer, location], ...]                  T actions (the last may be the NO-OP)
                 metrics:    [[runtime_ms, flops, bytes, launches], ...]   T+1 rows: the graph before each step
                                                                           and after the last
                 counts:     [[[xfer, matches], ...], ...]            T+1 rows: rules with a match (sparse)
                 valid:      [bool, ...]                              T
                 done:       [bool, ...]                              T: the episode ended at this step
                 terminated: bool, truncated: bool, final_hash: str}],
     stats: {...}}

Rewards are not stored: any reward class re-scores an episode from its metrics.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Iterator, Sequence

import numpy as np

from rlflow.agents.random_agent import RandomAgent
from rlflow.cost import METRIC_NAMES
from rlflow.env.graph_rewrite import GraphRewriteEnv
from rlflow.graph.ir import Graph

FORMAT = "rlflow.rollouts/1"


def rules_digest(rules: Sequence) -> dict:
    h = hashlib.blake2b(digest_size=8)
    for r in rules:
        h.update(r.id.encode() + b"\0")
    return {"count": len(rules), "digest": h.hexdigest()}


def _sparse(counts: np.ndarray) -> list[list[int]]:
    nz = np.flatnonzero(counts)
    return [[int(k), int(counts[k])] for k in nz]


def collect(env: GraphRewriteEnv, episodes: int, stop_prob: float, seed: Sequence[int] | int,
            progress: bool = False, actor=None) -> list[dict]:
    """``episodes`` random-agent episodes (seeded: the same seed gives the same episodes). ``actor``, instead of
    the random agent: ``reset()`` before each episode, ``act(obs) -> action`` and ``observe(action)`` after each
    step (the controller's iterated model-based training collects its own episodes this way)."""
    rng = np.random.default_rng(seed)
    if actor is None:
        agent = RandomAgent(stop_prob, rng)
        act, observe, reset = (lambda obs: agent.act(obs["xfer_mask"], obs["location_mask"])), None, None
    else:
        act, observe, reset = actor.act, actor.observe, actor.reset
    out = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=episodes, desc="episodes", unit="ep", file=sys.stderr, mininterval=1.0, disable=None)
    for index in range(episodes):
        if reset is not None:
            reset()
        obs, info = env.reset()
        ep = {"index": index, "actions": [], "metrics": [[info[k] for k in METRIC_NAMES]],
              "counts": [_sparse(info["counts"])], "valid": [], "done": []}
        terminated = truncated = False
        while not (terminated or truncated):
            action = act(obs)
            obs, _, terminated, truncated, info = env.step(action)
            if observe is not None:
                observe(action)
            ep["actions"].append([int(action[0]), int(action[1])])
            ep["metrics"].append([info[k] for k in METRIC_NAMES])
            ep["counts"].append(_sparse(info["counts"]))
            ep["valid"].append(bool(info["valid"]))
            ep["done"].append(bool(terminated or truncated))
        ep["terminated"], ep["truncated"] = bool(terminated), bool(truncated)
        ep["final_hash"] = env.graph.structural_hash()
        out.append(ep)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return out


def replay(env: GraphRewriteEnv, actions: Sequence[Sequence[int]]) -> Iterator[Graph]:
    """The graphs of an episode: the first graph, then the graph after each action."""
    env.reset()
    yield env.graph
    for a in actions:
        env.step(a)
        yield env.graph


def summarise(episodes: Sequence[dict], seconds: float | None = None) -> dict:
    """Episode count, steps, lengths, invalid steps, and the best runtime reached (ms and % of the first)."""
    steps = sum(len(e["actions"]) for e in episodes)
    first = episodes[0]["metrics"][0][0] if episodes else 0.0
    best = min((m[0] for e in episodes for m in e["metrics"]), default=first)
    stats = {
        "episodes": len(episodes),
        "steps": steps,
        "mean_length": steps / len(episodes) if episodes else 0.0,
        "terminated": sum(e["terminated"] for e in episodes),
        "truncated": sum(e["truncated"] for e in episodes),
        "invalid_steps": sum(not v for e in episodes for v in e["valid"]),
        "initial_runtime_ms": first,
        "best_runtime_ms": best,
        "best_improvement_pct": (first - best) / first * 100 if first else 0.0,
    }
    if seconds is not None:
        stats["seconds"] = seconds
        stats["episodes_per_second"] = len(episodes) / seconds if seconds > 0 else None
    return stats
