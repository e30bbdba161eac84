"""Real rewrite environments seen through the graph encoder, for the agents: a batched :class:`VectorEnv`
(PPO's interface) for the model-free agent, and evaluation episodes for any trained policy. Every real
environment step is counted by the environment itself (``GraphRewriteEnv.total_steps``): real-env interactions
are a headline figure."""

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
            obs, reward, terminated, truncated, info = env.step((int(xfer[i]), int(loc[i])))  # env.total_steps += 1
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


#: rewrites an agent may choose at one step that all give graphs seen earlier in the episode (``no_revisit``),
#: before the episode ends instead
REVISIT_TRIES = 16


@torch.no_grad()
def run_episode(env: GraphRewriteEnv, choose: Callable[[dict, torch.Tensor, torch.Tensor], tuple[int, int]],
                after_step: Callable[[dict, tuple[int, int]], None] | None = None, no_revisit: bool = False) -> dict:
    """One episode from the original graph. ``choose(obs, xfer_mask, location_mask) -> action``; the best
    graph seen (lowest estimated runtime) is kept. Returns actions, metrics, steps (the real interactions: the
    steps and, with ``no_revisit``, the looks turned down), the best graph and its metrics.

    ``no_revisit`` (config ``env.no_revisit``): the episode never steps back to a graph it has seen. Each rewrite
    chosen is first looked at (:meth:`GraphRewriteEnv.peek`, a counted interaction); one that gives a graph
    seen earlier is masked out and the agent chooses again, at most REVISIT_TRIES times, then the NO-OP ends
    the episode. Without it an agent can spend its horizon going round a circle of rewrites that change
    nothing (swapping two concats back and forth)."""
    obs, info = env.reset()
    start = env.total_steps
    seen = {env.graph.structural_hash()} if no_revisit else set()
    best = {k: info[k] for k in METRIC_NAMES}
    best_graph, best_step = env.graph, 0
    actions, metrics = [], [best]
    done, turned_down = False, 0
    while not done:
        xm, lm = mask_tensors([obs])
        if no_revisit:
            action, graph_hash, n = _first_unseen(env, choose, obs, xm, lm, seen)
            turned_down += n
        else:
            action, graph_hash = choose(obs, xm, lm), None
        obs, _, terminated, truncated, info = env.step(action)
        if graph_hash is not None:
            seen.add(graph_hash)
        if after_step is not None:
            after_step(obs, action)
        actions.append(list(action))
        m = {k: info[k] for k in METRIC_NAMES}
        metrics.append(m)
        if m["runtime_ms"] < best["runtime_ms"]:
            best, best_graph, best_step = m, env.graph, len(actions)
        done = terminated or truncated
    return {"actions": actions, "metrics": metrics, "steps": env.total_steps - start, "best": best,
            "best_graph": best_graph, "best_step": best_step, "initial": metrics[0], "turned_down": turned_down}


def _first_unseen(env: GraphRewriteEnv, choose, obs: dict, xm: torch.Tensor, lm: torch.Tensor,
                  seen: set[str]) -> tuple[tuple[int, int], str | None, int]:
    """The agent's first choice whose graph is not in ``seen`` (each looked at with ``env.peek``), the hash of
    that graph (None: the NO-OP or an invalid action, the graph stays) and how many were turned down; the
    NO-OP after REVISIT_TRIES choices that all were."""
    xm, lm = xm.clone(), lm.clone()
    for tries in range(REVISIT_TRIES):
        action = tuple(choose(obs, xm, lm))
        graph_hash = env.peek(action)
        if graph_hash is None or graph_hash not in seen:
            return action, graph_hash, tries
        xfer, loc = action
        lm[0, xfer, loc] = False
        xm[0, xfer] = bool(lm[0, xfer].any())
    return (env.noop, 0), None, REVISIT_TRIES


def run_episodes(one_episode: Callable[[bool, torch.Generator], dict], episodes: int = 1, greedy: bool = True,
                 seed: int = 0) -> dict:
    """``episodes`` real episodes of an agent from the original graph, ``one_episode(greedy, generator)`` each
    (returning :func:`run_episode`'s result): the first greedy (unless ``greedy`` is False), the others sampled
    from the policy (seeded by ``seed``). Both agents are evaluated this way, so their improvements compare.
    Returns the episode whose best graph is the fastest (the earliest on ties), except that ``steps`` counts the
    real steps of ALL episodes (each is a real-environment interaction), with ``episodes``, ``episode_steps`` and
    ``episode_best_runtime_ms`` (per episode) added."""
    if episodes < 1:
        raise ValueError("episodes must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    return best_run([one_episode(greedy and i == 0, gen) for i in range(episodes)])


def best_run(runs: list[dict]) -> dict:
    """Several real episodes (:func:`run_episode`'s results) as one run: the episode whose best graph is the
    fastest (the earliest on ties), with ``steps`` and ``turned_down`` summed over ALL of them (each step is a
    real-environment interaction) and ``best_episode``, ``episodes``, ``episode_steps`` and
    ``episode_best_runtime_ms`` (per episode) added."""
    if not runs:
        raise ValueError("best_run: no episodes")
    best = min(range(len(runs)), key=lambda i: (runs[i]["best"]["runtime_ms"], i))
    return {**runs[best], "steps": sum(r["steps"] for r in runs), "best_episode": best, "episodes": len(runs),
            "turned_down": sum(r.get("turned_down", 0) for r in runs),
            "episode_steps": [r["steps"] for r in runs],
            "episode_best_runtime_ms": [r["best"]["runtime_ms"] for r in runs]}


def summarise_run(result: dict) -> dict:
    """The JSON-ready part of :func:`run_episode`'s result, with the runtime improvement in percent."""
    a, b = result["initial"]["runtime_ms"], result["best"]["runtime_ms"]
    return {"initial": result["initial"], "best": result["best"], "best_step": result["best_step"],
            "steps": result["steps"], "improvement_pct": (a - b) / a * 100 if a else 0.0,
            "actions": result["actions"]}


def search_result(method: str, graph, rules, cost, run: dict, folded, final, seconds: float,
                  settings: dict | None = None):
    """An agent's real episode (:func:`run_episode`'s result) as a :class:`rlflow.search.result.SearchResult`,
    so that it is written, checked and read exactly like the searches' results (``trace.json``).

    ``folded``/``final``: the best graph with weight-only nodes folded, and its metrics. The trace lists the
    rewrites up to the best step (none if the agent found nothing better than the original): the actions are
    replayed on the original graph to name each rewrite's nodes, and the replay must reach the best graph.
    ``expansions`` counts the real steps (graphs the agent looked at, NO-OP included; of every episode when the
    run had several: ``run["steps"]``)."""
    from rlflow.errors import RLFlowError
    from rlflow.rewrite.matcher import MatchIndex
    from rlflow.search.result import SearchResult, TraceStep

    rules = list(rules)
    n = len(rules)
    index = MatchIndex(graph, rules)
    trace, invalid = [], 0
    for xfer, loc in run["actions"][:run["best_step"]]:
        if xfer == n:  # NO-OP: ends the episode (never before the best step; kept for safety)
            break
        ms = index.matches[xfer] if 0 <= xfer < n else []
        if not 0 <= loc < len(ms):
            invalid += 1  # the environment left the graph unchanged
            continue
        match = ms[loc]
        index = index.apply(xfer, loc)
        trace.append(TraceStep(rules[xfer].id, rules[xfer].name, int(loc), tuple(match.nodes),
                               cost.graph_metrics(index.graph)))
    if index.graph.structural_hash() != run["best_graph"].structural_hash():
        raise RLFlowError(f"{method}: replaying the agent's {len(trace)} rewrites did not give its best graph")
    actions = run["actions"]
    last = actions[-1][0] if actions else None
    stop = "noop" if last == n else "horizon"
    return SearchResult(
        method=method, graph=folded, initial=cost.graph_metrics(graph), final=final, trace=trace,
        expansions=run["steps"], seconds=seconds, generated=0, kept=len(trace), stop_reason=stop,
        nodes_before=len(graph.nodes), nodes_after=len(folded.nodes), settings=dict(settings or {}),
        stats={"real_steps": run["steps"], "episodes": run.get("episodes", 1),
               "best_episode": run.get("best_episode", 0), "best_step": run["best_step"], "invalid_actions": invalid,
               "revisits_turned_down": run.get("turned_down", 0)})


def agent_summary(result, diff: float, label: str) -> str:
    """A few lines for the terminal about an agent's optimised graph (:func:`search_result`)."""
    r = result
    lines = [f"{label}: cost {r.initial.runtime_ms:.4f} -> {r.final.runtime_ms:.4f} ms ({r.speedup:.3f}x), nodes "
             f"{r.nodes_before} -> {r.nodes_after}, {len(r.trace)} rewrites applied (best of {r.expansions} real "
             f"steps, stopped: {r.stop_reason}) in {r.seconds:.2f} s; max output difference {diff:.2e}"]
    from rlflow.search.output import rules_line

    return "\n".join(lines + rules_line(r, label))
