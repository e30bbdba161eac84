"""Random rollouts in the rewrite environment: the episodes (JSON), and optionally the graph of every step in a
compact side file (the environment is deterministic, so a graph can also be re-materialised by replaying its
episode's actions: :func:`replay`; the encoder replays a sample of episodes to check a stored file).

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

Graphs file ``rlflow.rollout-graphs/1`` (npz; G graphs: every step of every episode, episodes in file order, the
first graph and the graph after each action), the observation's graph (:mod:`rlflow.env.observation`) packed::

    format        str                     rlflow.rollout-graphs/1
    node_types    str  [F - 1]            the observation's node types (their one-hot order)
    episodes      str                     :func:`episodes_digest` of the episodes the graphs belong to
    graph_nodes   int32   [G]             nodes per graph
    graph_edges   int32   [G]             edges per graph
    node_type     int16   [sum V]         index into node_types (the one-hot column)
    node_runtime  float32 [sum V]         the node feature runtime_ms (0 for inputs and weights)
    edges         float32 [sum E, R]      edge features (the value's shape, right-aligned)
    edge_links    int32   [sum E, 2]      producer -> reader, node indices within the graph

About 1 KB per graph compressed (bert at paper size), against ~10 ms per replayed step.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from rlflow.agents.random_agent import RandomAgent
from rlflow.cost import METRIC_NAMES
from rlflow.env.graph_rewrite import GraphRewriteEnv
from rlflow.env.observation import MAX_RANK, NODE_TYPES
from rlflow.errors import RLFlowError
from rlflow.graph.ir import Graph

FORMAT = "rlflow.rollouts/1"
GRAPHS_FORMAT = "rlflow.rollout-graphs/1"
GRAPH_ARRAYS = ("node_type", "node_runtime", "edges", "edge_links")    # :func:`pack_graph`'s, concatenated


def rules_digest(rules: Sequence) -> dict:
    h = hashlib.blake2b(digest_size=8)
    for r in rules:
        h.update(r.id.encode() + b"\0")
    return {"count": len(rules), "digest": h.hexdigest()}


def _sparse(counts: np.ndarray) -> list[list[int]]:
    nz = np.flatnonzero(counts)
    return [[int(k), int(counts[k])] for k in nz]


def collect(env: GraphRewriteEnv, episodes: int, stop_prob: float, seed: Sequence[int] | int,
            progress: bool = False, actor=None, graphs: list | None = None) -> list[dict]:
    """``episodes`` random-agent episodes (seeded: the same seed gives the same episodes). ``actor``, instead of
    the random agent: ``reset()`` before each episode, ``act(obs) -> action`` and ``observe(action)`` after each
    step (the controller's iterated model-based training collects its own episodes this way). ``graphs``, when
    given, gets the :func:`pack_graph` of every observed graph appended (for :func:`graph_arrays`)."""
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
        if graphs is not None:
            graphs.append(pack_graph(obs["graph"]))
        ep = {"index": index, "actions": [], "metrics": [[info[k] for k in METRIC_NAMES]],
              "counts": [_sparse(info["counts"])], "valid": [], "done": []}
        terminated = truncated = False
        while not (terminated or truncated):
            action = act(obs)
            obs, _, terminated, truncated, info = env.step(action)
            if graphs is not None:
                graphs.append(pack_graph(obs["graph"]))
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


# ------------------------------------------------------------------------------------------- stored graphs
def pack_graph(g) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """An observation's graph (``GraphInstance``: one-hot node types + runtime, edges, links) ->
    (node_type int16 [V], node_runtime float32 [V], edges float32 [E, R], edge_links int32 [E, 2])."""
    nodes = np.asarray(g.nodes)
    return (nodes[:, :-1].argmax(1).astype(np.int16), nodes[:, -1].astype(np.float32),
            np.asarray(g.edges, np.float32), np.asarray(g.edge_links).astype(np.int32).reshape(-1, 2))


def episodes_digest(episodes: Sequence[dict]) -> str:
    """A digest of the episodes' actions, in order (ties a graphs file to its rollouts)."""
    h = hashlib.blake2b(digest_size=8)
    for ep in episodes:
        h.update(np.asarray(ep["actions"], np.int64).reshape(-1, 2).tobytes() + b"|")
    return h.hexdigest()


def graph_arrays(packed: Sequence[tuple], episodes: Sequence[dict]) -> dict[str, np.ndarray]:
    """A graphs file's arrays: the packed graphs of ``episodes`` (every step, in order; :func:`pack_graph`)."""
    want = sum(len(ep["actions"]) + 1 for ep in episodes)
    if len(packed) != want:
        raise ValueError(f"{len(packed)} graphs for {len(episodes)} episodes of {want} steps")
    arrays = {
        "format": np.array(GRAPHS_FORMAT),
        "node_types": np.array(NODE_TYPES),
        "episodes": np.array(episodes_digest(episodes)),
        "graph_nodes": np.array([len(p[0]) for p in packed], np.int32),
        "graph_edges": np.array([len(p[2]) for p in packed], np.int32),
    }
    empty = (np.zeros(0, np.int16), np.zeros(0, np.float32), np.zeros((0, MAX_RANK), np.float32),
             np.zeros((0, 2), np.int32))
    for i, name in enumerate(GRAPH_ARRAYS):
        arrays[name] = np.concatenate([p[i] for p in packed]) if packed else empty[i]
    return arrays


def read_graphs(path: Path | str) -> dict[str, np.ndarray]:
    """A graphs file's arrays, checked for format and node types (one-line RLFlowError otherwise)."""
    from rlflow.atomic import read_npz

    arrays = read_npz(path, "no such rollout graphs file", "not a rollout graphs file")
    if str(arrays.get("format", "")) != GRAPHS_FORMAT:
        raise RLFlowError(f"{path}: not a {GRAPHS_FORMAT} file")
    if tuple(np.asarray(arrays.get("node_types", ())).tolist()) != NODE_TYPES:
        raise RLFlowError(f"{path}: written with other node types than this version's; collect the rollouts again")
    return arrays


def join_graphs(parts: Sequence[dict[str, np.ndarray]], episodes: Sequence[dict]) -> dict[str, np.ndarray]:
    """Graphs files' arrays (e.g. shards, in order) as one, for ``episodes`` (all of theirs, in that order)."""
    out = dict(parts[0])
    out["episodes"] = np.array(episodes_digest(episodes))
    for k in ("graph_nodes", "graph_edges", *GRAPH_ARRAYS):
        out[k] = np.concatenate([p[k] for p in parts])
    return out


def check_graphs(arrays: dict[str, np.ndarray], episodes: Sequence[dict], source: str) -> None:
    """One-line RLFlowError (naming ``source``) unless a graphs file's arrays hold the graphs of ``episodes``: the
    digest of their actions, consistent counts, and each graph's node runtimes summing to its step's runtime."""
    if str(arrays["episodes"]) != episodes_digest(episodes):
        raise RLFlowError(f"{source}: stored for other episodes than the rollouts file's; collect the rollouts again")
    nv, types = arrays["graph_nodes"].astype(np.int64), arrays["node_type"]
    lengths = [len(ep["actions"]) + 1 for ep in episodes]
    if len(nv) != sum(lengths) or nv.sum() != len(types) or len(arrays["node_runtime"]) != len(types) \
            or arrays["graph_edges"].sum() != len(arrays["edges"]) \
            or len(arrays["edges"]) != len(arrays["edge_links"]) \
            or (len(types) and not 0 <= int(types.min()) <= int(types.max()) < len(NODE_TYPES)):
        raise RLFlowError(f"{source}: its graph, node and edge counts do not add up; collect the rollouts again")
    vo = np.concatenate([[0], np.cumsum(nv)])
    runtime = arrays["node_runtime"]
    sums = np.array([runtime[a:b].sum(dtype=np.float64) for a, b in zip(vo[:-1], vo[1:])])
    want = np.array([m[0] for ep, n in zip(episodes, lengths) for m in ep["metrics"][:n]], np.float64)
    if len(want) != len(sums):
        raise RLFlowError(f"{source}: the rollouts file lacks the metrics of some steps")
    bad = np.flatnonzero(~np.isclose(sums, want, rtol=1e-5, atol=1e-9))
    if len(bad):
        g = int(bad[0])
        e = int(np.searchsorted(np.cumsum(lengths), g, side="right"))
        t = g - int(np.sum(lengths[:e]))
        raise RLFlowError(f"{source}: episode {e}, step {t}: the stored graph's node runtimes sum to "
                          f"{sums[g]:.6g} ms, the rollouts file has {want[g]:.6g} ms; collect the rollouts again")


def unpack_graphs(arrays: dict[str, np.ndarray], episodes: Sequence[dict], source: str) -> Iterator[list]:
    """The graphs of ``episodes`` from a graphs file's arrays (checked first: :func:`check_graphs`): per episode,
    lazily, its T+1 observation graphs (``GraphInstance``), as the environment gave them."""
    from gymnasium import spaces

    check_graphs(arrays, episodes, source)
    vo = np.concatenate([[0], np.cumsum(arrays["graph_nodes"], dtype=np.int64)])
    eo = np.concatenate([[0], np.cumsum(arrays["graph_edges"], dtype=np.int64)])
    types, runtime, edges = arrays["node_type"], arrays["node_runtime"], arrays["edges"]
    links = arrays["edge_links"].astype(np.int64)
    width = len(NODE_TYPES) + 1

    def graph(i: int):
        a, b = vo[i], vo[i + 1]
        nodes = np.zeros((b - a, width), np.float32)
        nodes[np.arange(b - a), types[a:b]] = 1.0
        nodes[:, -1] = runtime[a:b]
        return spaces.GraphInstance(nodes, edges[eo[i]:eo[i + 1]], links[eo[i]:eo[i + 1]])

    starts = np.concatenate([[0], np.cumsum([len(ep["actions"]) + 1 for ep in episodes])])
    return ([graph(i) for i in range(a, b)] for a, b in zip(starts[:-1], starts[1:]))
