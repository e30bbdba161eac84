"""``rlflow/GraphRewrite-v0``: rewrite a computation graph by applying verified substitution rules.

Action ``(xfer_id, location)``: apply rule ``xfer_id`` at its ``location``-th match (matches are ordered
deterministically by their nodes' positions in the graph). ``xfer_id == N`` (the number of rules) is the NO-OP:
it ends the episode. An action the masks forbid (a rule with no match, a location past the rule's matches) is
invalid: it earns the reward's ``invalid_penalty`` and leaves the graph unchanged. After ``max_steps`` steps the
episode is truncated.

Observation (a dict, as in the RLFlow paper):
  ``graph``          the graph (``gymnasium.spaces.Graph``, see :mod:`rlflow.env.observation`)
  ``global``         the graph's metrics [runtime_ms, flops, bytes, launches]
  ``xfer_mask``      (N+1,) int8: 1 where the rule has a match; the NO-OP is always valid
  ``location_mask``  (N+1, L) int8: row k has 1 at the first min(matches of k, L) locations; L = max_locations

``info`` holds the new graph's metrics (``runtime_ms``, ``flops``, ``bytes``, ``launches``, and ``latency_ratio``
when the reward measures real latency: the graph's latency over the episode's first graph's, from
``latency_meter``, 1 where no difference is detected), ``counts`` (matches per rule, not truncated at L), ``valid``, ``noop``,
``rule`` (the id applied) and ``step``, so a recorded episode can be re-scored with any reward.

:meth:`peek` tells which graph a rewrite would give without taking the step (the agents' evaluation episodes use
it to never step back to a graph they have seen). Looking is a real interaction too: it counts in
``total_steps`` like a step, and a step that takes the rewrite just looked at reuses it and is not counted again.

The environment is deterministic: the same actions give the same graphs (structural hash) and metrics.

Defaults: no ``graph`` is :data:`DEFAULT_GRAPH` (the model zoo's tiny BERT, shipped with the package); no ``rules``
the builtin rules (:func:`rlflow.rewrite.builtin.builtin_rules`, as written: the generate_rules stage verifies
them, the tests check each); no ``cost_model`` the analytic CPU roofline, which needs no measured files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from rlflow.cost import METRIC_NAMES, AnalyticCost, CostModel
from rlflow.env.observation import MAX_RANK, NODE_FEATURES, graph_features
from rlflow.env.rewards import Reward, make_reward
from rlflow.graph.ir import Graph
from rlflow.rewrite.matcher import MatchIndex
from rlflow.rewrite.rule import Rule


F32_MAX = float(np.finfo(np.float32).max)  # features are non-negative and finite (not inf: env_checker)

#: the graph of an env made without one: the zoo's tiny BERT (regenerate with ``rlflow export-model --config
#: config.yaml --config tests/configs/tiny.yaml --model bert --out src/rlflow/env/data/tiny-bert.onnx``)
DEFAULT_GRAPH = Path(__file__).parent / "data" / "tiny-bert.onnx"


def default_rules() -> list[Rule]:
    """The rules of an env made without any: the builtin rules."""
    from rlflow.rewrite.builtin import builtin_rules

    return [rule for rule, _ in builtin_rules()]


class GraphRewriteEnv(gym.Env):
    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, graph: Graph | str | Path | None = None, rules: Sequence[Rule] | str | Path | None = None,
                 cost_model: CostModel | None = None, reward: Reward | dict | str | None = None,
                 max_steps: int = 50, max_locations: int = 200, render_mode: str | None = None,
                 latency_meter=None):
        if graph is None:
            graph = DEFAULT_GRAPH
        if rules is None:
            rules = default_rules()
        if isinstance(graph, (str, Path)):
            from rlflow.graph.onnx_io import load_onnx

            graph = load_onnx(graph)
        if isinstance(rules, (str, Path)):
            from rlflow.rewrite.rule import load_rules

            rules = load_rules(rules)
        if max_steps < 1 or max_locations < 1:
            raise ValueError("max_steps and max_locations must be >= 1")
        self.rules = list(rules)
        self.n_xfers = len(self.rules)
        self.noop = self.n_xfers
        self.cost = cost_model or AnalyticCost("cpu")
        self.reward_fn = make_reward(reward)
        self.max_steps, self.max_locations = int(max_steps), int(max_locations)
        self.render_mode = render_mode
        if self.reward_fn.needs_latency and latency_meter is None:
            from rlflow.errors import RLFlowError

            raise RLFlowError(f"the {self.reward_fn.name} reward measures real latency: give the env a latency_meter "
                              "(rlflow.evaluation.protocol.latency_meter; rlflow.env.make_env takes one)")
        self.latency_meter = latency_meter
        """``meter(first_graph, graph) -> {"ratio", "ci_low", "ci_high", "verdict"}``: the graph's latency over the
        first graph's under the measurement protocol (injected: the protocol lives above this floor)."""

        self.initial_index = MatchIndex(graph, self.rules)
        self.initial_metrics = self._metrics(graph, measure=None)  # the first graph: latency ratio 1 by definition
        self._initial_node_costs = self._node_costs
        self.action_space = spaces.MultiDiscrete([self.n_xfers + 1, self.max_locations])
        self.observation_space = spaces.Dict({
            "graph": spaces.Graph(node_space=spaces.Box(0.0, F32_MAX, (NODE_FEATURES,), np.float32),
                                  edge_space=spaces.Box(0.0, F32_MAX, (MAX_RANK,), np.float32)),
            "global": spaces.Box(0.0, F32_MAX, (len(METRIC_NAMES),), np.float64),
            "xfer_mask": spaces.MultiBinary(self.n_xfers + 1),
            "location_mask": spaces.MultiBinary((self.n_xfers + 1, self.max_locations)),
        })
        self._loc_range = np.arange(self.max_locations)
        self._set_index(self.initial_index)
        self.metrics = self.initial_metrics
        self.steps = 0
        #: every step taken since the env was made, over all episodes: the real-environment interactions an
        #: agent used (rlflow.agents.driver counts them from here)
        self.total_steps = 0
        self._stale_latency = False
        self._peeked: tuple[int, int, MatchIndex] | None = None  # the last rewrite looked at (peek), not taken

    # ------------------------------------------------------------------ state
    @property
    def graph(self) -> Graph:
        return self.index.graph

    def counts(self) -> np.ndarray:
        """Matches per rule on the current graph, (N,) int64 (not truncated at max_locations)."""
        return self._counts

    def _set_index(self, index: MatchIndex) -> None:
        self.index = index
        self._counts = np.array(list(map(len, index.matches)), np.int64)

    def masks(self, counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(xfer_mask (N+1,), location_mask (N+1, L)) as int8, from the match counts."""
        counts = self.counts() if counts is None else counts
        full = np.append(np.minimum(counts, self.max_locations), 1)  # NO-OP: one location (0)
        loc = (self._loc_range[None, :] < full[:, None]).astype(np.int8)
        return (full > 0).astype(np.int8), loc

    def _metrics(self, graph: Graph, measure: bool | None) -> dict[str, float]:
        self._node_costs = self.cost.node_costs(graph)  # reused by the observation
        m = dict(zip(METRIC_NAMES, map(sum, zip(*self._node_costs)))) if self._node_costs else \
            dict.fromkeys(METRIC_NAMES, 0.0)
        if self.reward_fn.needs_latency:
            if measure is None:  # the first graph: the reference of every measurement
                m["latency_ratio"] = 1.0
            else:
                m["latency_ratio"] = self._measure_latency(graph) if measure else self.metrics["latency_ratio"]
        return m

    def _measure_latency(self, graph: Graph) -> float:
        """The graph's latency over the first graph's; 1 unless the protocol calls it faster or slower."""
        found = self.latency_meter(self.initial_index.graph, graph)
        return float(found["ratio"]) if found["verdict"] in ("faster", "slower") else 1.0

    def _observation(self, counts: np.ndarray) -> dict[str, Any]:
        runtimes = [c[0] for c in self._node_costs]
        nodes, edges, links = graph_features(self.graph, runtimes)
        xfer_mask, loc_mask = self.masks(counts)
        return {
            "graph": spaces.GraphInstance(nodes, edges, links),
            "global": np.array([self.metrics[k] for k in METRIC_NAMES], np.float64),
            "xfer_mask": xfer_mask,
            "location_mask": loc_mask,
        }

    def _info(self, counts: np.ndarray, **extra: Any) -> dict[str, Any]:
        return {**self.metrics, "counts": counts.copy(), "step": self.steps, **extra}  # users keep infos

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._set_index(self.initial_index)
        self.metrics = self.initial_metrics
        self._node_costs = self._initial_node_costs
        self.steps = 0
        self._stale_latency = False
        self._peeked = None
        counts = self.counts()
        return self._observation(counts), self._info(counts, valid=True, noop=False, rule=None)

    def peek(self, action) -> str | None:
        """The structural hash of the graph that ``action`` would give (:meth:`rlflow.graph.ir.Graph.structural_hash`),
        without taking the step; None for the NO-OP or an invalid action (they leave the graph as it is). Counts
        one real interaction (``total_steps``); :meth:`step` with the same action next takes the rewrite looked at
        without counting it again."""
        xfer, loc = int(action[0]), int(action[1])
        if not (0 <= xfer < self.n_xfers and 0 <= loc < min(self._counts[xfer], self.max_locations)):
            return None
        self.total_steps += 1
        index = self.index.apply(xfer, loc)
        self._peeked = (xfer, loc, index)
        return index.graph.structural_hash()

    def step(self, action):
        xfer, loc = int(action[0]), int(action[1])
        peeked, self._peeked = self._peeked, None
        looked = peeked is not None and peeked[:2] == (xfer, loc)
        self.steps += 1
        self.total_steps += 0 if looked else 1
        truncated = self.steps >= self.max_steps
        counts = self.counts()
        prev = self.metrics
        if xfer == self.noop:
            extra = {"valid": True, "noop": True, "rule": None}
            terminated, reward = True, 0.0
            if self._stale_latency:  # e2e: the episode ends; score the changes since the last measurement
                self.metrics = {**prev, "latency_ratio": self._measure_latency(self.graph)}
                reward = float(self.reward_fn(prev, self.metrics, self.initial_metrics))
        elif not (0 <= xfer < self.n_xfers and 0 <= loc < min(counts[xfer], self.max_locations)):
            extra = {"valid": False, "noop": False, "rule": None}
            terminated, reward = False, self.reward_fn.invalid_penalty
        else:
            self._set_index(peeked[2] if looked else self.index.apply(xfer, loc))
            counts = self.counts()
            terminated = False
            measure = self.reward_fn.needs_latency and (truncated or self.steps % self.reward_fn.every == 0)
            self.metrics = self._metrics(self.graph, measure)
            self._stale_latency = self.reward_fn.needs_latency and not measure
            reward = float(self.reward_fn(prev, self.metrics, self.initial_metrics))
            extra = {"valid": True, "noop": False, "rule": self.rules[xfer].id}
        return (self._observation(counts), reward, terminated, truncated and not terminated,
                self._info(counts, **extra))

    def render(self):
        if self.render_mode == "ansi":
            m = self.metrics
            return (f"step {self.steps}: {len(self.graph)} nodes, runtime {m['runtime_ms']:.3f} ms, "
                    f"{m['flops'] / 1e9:.3f} GFLOPs, {m['bytes'] / 1e6:.1f} MB, {int(m['launches'])} launches")
        return None
