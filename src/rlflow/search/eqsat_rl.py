"""eqsat-rl: equality saturation whose rule schedule an agent chooses, then the same ILP extraction as eqsat.

    policy, history = train_policy({"resnet18": g1, "bert": g2}, rules, cost, EqsatBudget(node_limit=5000))
    result = eqsat_rl_search(graph, rules, cost, policy, EqsatBudget(node_limit=5000))   # the learned agent
    result = tree_search(graph, rules, cost, EqsatBudget(node_limit=5000))               # MCTS over schedules
    result = random_schedule_search(graph, rules, cost, EqsatBudget(node_limit=5000), seed=0)

Which rules to run, in what order, within a node budget, is a phase-ordering problem (the open question of the
X-RLflow authors; MCTS-GEB, He et al. 2023, attacks it with tree search). eqsat's backoff scheduler runs every
rule in every iteration until the e-graph fills its node limit; on a model it cannot saturate, the rewrites that
fill the e-graph first crowd out the rest.

**Families.** The rules are grouped into :data:`FAMILIES` (:func:`family_of`): the multi-pattern (two-root)
rules; the reorders (:func:`is_reorder`: the target has exactly the source's ops, as commuting, reassociating or
moving an op does: they change nothing by themselves, only enable other rewrites, and they fill an e-graph with
equivalent graphs of equal cost, which is what makes the ILP slow); then by the first of conv, matmul,
concat-split, transpose, elementwise ops the source holds, else other. A family is present on a graph if one of
its rules has every source op in the graph.

**Actions.** In each runner iteration the agent picks one action (:func:`action_names`): ``all`` (every family:
what eqsat runs), ``only:F`` (family F alone), ``no:F`` (every family but F) or ``stop`` (saturation ends
here and the e-graph as it is goes to the ILP: a smaller e-graph the ILP can solve within its time limit can hold
a cheaper graph than the bigger one it cannot). The chosen families' rules then run
under eqsat's backoff scheduler (its match limits and bans: :class:`FamilyScheduler` is a
:class:`~rlflow.search.eqsat.runner.BackoffScheduler`), and multi-pattern rules in at most ``multi_iterations``
iterations, the first ones in which the agent chooses them (eqsat: the first ones), so an agent that always
picks ``all`` is eqsat. When an
iteration that did not run every family changes nothing, the next one runs ``all`` (forced, not the agent's
choice), so saturation only stops once no rule of any family matches anything new; from then on the agent
chooses between ``all`` and ``stop`` only (a restricted action has had its fixpoint: alternating it with forced
``all`` iterations would only spend iterations).

**Agents.** All run under the same :class:`EqsatBudget` (node, iteration and time limits, the ILP's time and
node limits) as eqsat, and extract with the same ILP:

- the learned policy (:class:`LinearPolicy`): a softmax over actions, linear in the iteration's features
  (:meth:`FamilyScheduler.features`: iteration, e-graph size and growth against the node limit, whether a
  restricted action reached its fixpoint, each family's share of the last iteration's merges, and the input
  graph's op mix and size, :func:`graph_features`), absent families' actions masked; trained
  (:func:`train_policy`) on some models with the ILP's cost (under a short time limit: the cheap proxy) as the
  reward, its gain over eqsat's schedule on the same model: first each constant schedule (one action
  throughout) and the best of them stopping at their fixpoint are scored and the policy starts from the best,
  then REINFORCE; or, per model (:func:`train_per_model`), each training model's own best schedule, which one
  policy then imitates (the models' op mixes tell it which to play: transformers on one target can need
  opposite schedules); used greedily (argmax);
- a tree search (:func:`tree_search`): UCT over the first ``depth`` iterations' actions (the rest: the last
  action again), each
  leaf the whole saturation scored by the same cheap proxy (MCTS-GEB scores leaves cheaply too); eqsat's own
  schedule is the first leaf, so the proxy of the schedule chosen is never worse than eqsat's;
- random schedules (:func:`random_schedule_search`): a uniformly random present action per iteration.

Everything is deterministic for a given seed (unless a time limit cuts saturation or the ILP; a clock-free
budget, :attr:`EqsatBudget.clock_free`, has none, its proxy included).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from rlflow.cost.model import CostModel
from rlflow.errors import RLFlowError
from rlflow.jsondoc import read_document
from rlflow.graph.ir import Graph
from rlflow.rewrite.rule import Rule
from rlflow.search.eqsat import BackoffScheduler, EGraph, Pattern, Runner, eqsat_search
from rlflow.search.eqsat.runner import BAN_LENGTH, RULE_MATCH_LIMIT
from rlflow.search.result import SearchResult

#: the rule families, in the order of the actions and features
FAMILIES = ("multi", "reorder", "conv", "matmul", "concat-split", "transpose", "elementwise", "other")
_FAMILY_OPS = (("conv", {"Conv"}), ("matmul", {"MatMul", "Gemm"}), ("concat-split", {"Concat", "Split"}),
               ("transpose", {"Transpose"}), ("elementwise", {"Add", "Sub", "Mul", "Div", "ScalarMul"}))
POLICY_FORMAT = "rlflow.eqsat-rl-policy/3"
STOP = "stop"  # the action that ends saturation
#: the input graph's features (:func:`graph_features`): each op group's share of its nodes, other ops', its size
N_GRAPH_FEATURES = len(_FAMILY_OPS) + 2
#: the features of an iteration (:meth:`FamilyScheduler.features`): 1, iteration, size, growth, released, shares,
#: then the input graph's
N_FEATURES = 5 + len(FAMILIES) + N_GRAPH_FEATURES
RELEASED = 4  # the index of the feature that is 1 once a restricted action reached its fixpoint


def is_reorder(rule: Rule) -> bool:
    """True if the rule's target has exactly its source's ops (commuting, reassociating or moving ops): it changes
    no op count by itself and only helps by enabling other rewrites."""
    return Counter(n.op for n in rule.src) == Counter(n.op for n in rule.dst)


def family_of(p: Pattern) -> str:
    """The family of a rule's source pattern (see the module docstring)."""
    if p.multi:
        return "multi"
    if is_reorder(p.rule):
        return "reorder"
    ops = {n.op for n in p.src}
    for name, fam_ops in _FAMILY_OPS:
        if ops & fam_ops:
            return name
    return "other"


def graph_features(graph: Graph) -> np.ndarray:
    """What the policy sees of the input graph, the same in every iteration: shape (N_GRAPH_FEATURES,) =
    (len(_FAMILY_OPS) + 2,): the share of its nodes in each op group of the families (conv, matmul, concat-split,
    transpose, elementwise), the share of the other nodes, and log10(nodes) / 4. Models with different op mixes
    (a BERT, a GPT-2, a CNN) can so get different schedules."""
    ops = [n.op for n in graph.nodes]
    n = max(len(ops), 1)
    shares = [sum(op in group for op in ops) / n for _, group in _FAMILY_OPS]
    return np.array([*shares, 1.0 - sum(shares), math.log10(n) / 4])


def action_names() -> list[str]:
    """Every action: ``all``, then ``only:F`` and ``no:F`` per family F of :data:`FAMILIES`, then ``stop``."""
    return ["all"] + [f"only:{f}" for f in FAMILIES] + [f"no:{f}" for f in FAMILIES] + [STOP]


def action_families(action: str) -> frozenset[str]:
    """The families an action runs (``stop``: none)."""
    if action == "all":
        return frozenset(FAMILIES)
    if action == STOP:
        return frozenset()
    kind, _, fam = action.partition(":")
    if fam not in FAMILIES or kind not in ("only", "no"):
        raise RLFlowError(f"unknown eqsat-rl action {action!r} (all, only:F, no:F or stop; F one of "
                          f"{', '.join(FAMILIES)})")
    return frozenset({fam}) if kind == "only" else frozenset(FAMILIES) - {fam}


def present_families(graph: Graph, rules: Sequence[Rule]) -> frozenset[str]:
    """The families with a rule whose every source op the graph has (the others cannot match)."""
    ops = {n.op for n in graph.nodes}
    return frozenset(family_of(p) for p in map(Pattern, rules) if p.joined and {n.op for n in p.src} <= ops)


def action_mask(present: frozenset[str], first: bool = False) -> np.ndarray:
    """Per action of :func:`action_names`: True for ``all``, for ``stop`` unless ``first`` (the first iteration:
    stopping there would extract the input), and for the others if they run a present family and differ from
    ``all`` on them (``only:F``/``no:F`` of an absent F would repeat ``all`` or run nothing). Shape (A,)."""
    out = []
    for a in action_names():
        fams = action_families(a) & present
        out.append(a == "all" or (a == STOP and not first) or (bool(fams) and fams != present))
    return np.array(out)


@dataclass(frozen=True)
class EqsatBudget:
    """The budget every schedule runs under (eqsat's settings: the config's eqsat section)."""

    node_limit: int = 50_000       # e-nodes
    iter_limit: int = 15           # runner iterations
    time_limit_s: float = 60.0     # saturation seconds (0 = none)
    ilp_time_limit_s: float = 60.0  # the ILP's seconds (0 = none)
    multi_iterations: int = 2      # iterations in which multi-pattern rules may run
    ilp_node_limit: int = 0        # the ILP's branch-and-bound nodes per solve (0 = none)

    def __post_init__(self):
        if self.node_limit < 1 or self.iter_limit < 1 or self.time_limit_s < 0 or self.ilp_time_limit_s < 0 \
                or self.multi_iterations < 0 or self.ilp_node_limit < 0:
            raise RLFlowError("eqsat-rl: need node_limit >= 1, iter_limit >= 1, time limits >= 0, "
                              "multi_iterations >= 0 and ilp_node_limit >= 0")

    @property
    def clock_free(self) -> bool:
        """No clock (saturation and ILP time limits 0) and an ILP node limit: every schedule's answer is a pure
        function of the inputs, whatever the machine's speed and load."""
        return not self.time_limit_s and not self.ilp_time_limit_s and self.ilp_node_limit > 0

    def search_kwargs(self) -> dict:
        return {"node_limit": self.node_limit, "iter_limit": self.iter_limit, "time_limit_s": self.time_limit_s,
                "ilp_time_limit_s": self.ilp_time_limit_s, "multi_iterations": self.multi_iterations,
                "ilp_node_limit": self.ilp_node_limit}


#: choose(iteration, features (D,), mask (A,)) -> action index
Chooser = Callable[[int, np.ndarray, np.ndarray], int]


class FamilyScheduler(BackoffScheduler):
    """eqsat's backoff scheduler restricted, in each iteration, to the families of the action ``choose`` picks
    (see the module docstring); the action ``stop`` ends saturation (:meth:`stop`). ``schedule`` keeps the action
    names run, forced ``all`` iterations included, and ``stop`` last if the agent stopped; ``decisions`` keeps
    (features, action, mask) per iteration the agent chose."""

    def __init__(self, choose: Chooser, present: frozenset[str], budget: EqsatBudget,
                 graph_x: np.ndarray | None = None):
        super().__init__(budget.multi_iterations, match_limit_base=RULE_MATCH_LIMIT, ban_length=BAN_LENGTH)
        self.choose, self.present, self.budget = choose, present, budget
        self.graph_x = np.zeros(N_GRAPH_FEATURES) if graph_x is None else graph_x  # graph_features(input)
        self.result: SearchResult | None = None  # run_schedule's result, once it ran
        self.mask, self.first_mask = action_mask(present), action_mask(present, first=True)
        self.actions = action_names()
        self.decisions: list[tuple[np.ndarray, int, np.ndarray]] = []
        self.schedule: list[str] = []
        self.runner: Runner | None = None
        self._force_all = False
        self.released = False  # a restricted action reached its fixpoint: from then on only ``all`` or ``stop``
        self.late_mask = np.array([a in ("all", STOP) for a in self.actions])
        self._family: dict[str, str] = {}
        self._pending: str | None = None  # the action decided in stop(), run by the select() that follows
        self.multi_runs = 0  # iterations in which multi-pattern rules ran

    def start(self, runner: Runner) -> None:
        self.runner = runner
        self._family = {p.rule.id: family_of(p) for p in runner.patterns}

    def features(self, iteration: int, egraph: EGraph) -> np.ndarray:
        """The agent's view of an iteration, shape (N_FEATURES,) = (5 + len(FAMILIES) + N_GRAPH_FEATURES,): 1,
        iteration / iter_limit, e-nodes / node_limit, the last iteration's growth / node_limit, 1 once released (a
        restricted action reached its fixpoint: only ``all`` and ``stop`` are allowed from then on) else 0, each
        family's share of the last iteration's merges, then the input graph's :func:`graph_features`."""
        records = self.runner.iterations if self.runner is not None else []
        before = records[-2].nodes if len(records) >= 2 else egraph.n_nodes
        growth = (records[-1].nodes - before) if records else 0
        fired = np.zeros(len(FAMILIES))
        if records:
            for rid, n in records[-1].fired.items():
                fired[FAMILIES.index(self._family[rid])] += n
        share = fired / fired.sum() if fired.sum() else fired
        return np.concatenate([[1.0, iteration / self.budget.iter_limit, egraph.n_nodes / self.budget.node_limit,
                                growth / self.budget.node_limit, float(self.released)], share, self.graph_x])

    def _decide(self, iteration: int, egraph: EGraph) -> str:
        if self._force_all:
            action = "all"
            self._force_all = False
        else:
            x = self.features(iteration, egraph)
            mask = self.late_mask if self.released else self.mask if iteration else self.first_mask
            a = int(self.choose(iteration, x, mask))
            if not (0 <= a < len(self.actions)) or not mask[a]:
                raise RLFlowError(f"eqsat-rl: the agent chose action {a}, not one allowed here")
            self.decisions.append((x, a, mask))
            action = self.actions[a]
        self.schedule.append(action)
        return action

    def stop(self, iteration: int, egraph: EGraph) -> bool:
        self._pending = self._decide(iteration, egraph)
        return self._pending == STOP

    def select(self, iteration: int, egraph: EGraph, patterns: Sequence[Pattern]) -> list[Pattern]:
        action = self._pending if self._pending is not None else self._decide(iteration, egraph)
        self._pending = None
        fams = action_families(action)
        multi_ok = self.multi_runs < self.multi_iterations
        out = [p for p in patterns if self._family[p.rule.id] in fams and (multi_ok or not p.multi)
               and iteration >= self._ban(p).until]
        self.multi_runs += any(p.multi for p in out)
        return out

    def can_stop(self, iteration: int) -> bool:
        if self.schedule and self.schedule[-1] != "all":  # only some families ran: the others may still match
            self._force_all = self.released = True
            return False
        return super().can_stop(iteration)


def run_schedule(graph: Graph, rules: Sequence[Rule], cost: CostModel, choose: Chooser, budget: EqsatBudget,
                 extraction: str = "ilp", method: str = "eqsat-rl") -> tuple[SearchResult, FamilyScheduler]:
    """Saturate ``graph`` under ``budget`` with the schedule ``choose`` picks, then extract (``ilp``, or
    ``greedy``: the cheap proxy). The result's stats add ``schedule`` (the actions run) and ``families``."""
    if not rules:
        raise RLFlowError("eqsat-rl: no rules")
    usable = [r for r in rules if r.min_opset <= graph.opset]
    sched = FamilyScheduler(choose, present_families(graph, usable), budget, graph_features(graph))
    r = eqsat_search(graph, rules, cost, extraction=extraction, scheduler=sched, method=method,
                     **budget.search_kwargs())
    r.stats.update(schedule=list(sched.schedule), families=sorted(sched.present))
    r.settings.update(method=method)
    sched.result = r
    return r, sched


def _fixed(actions: Sequence[str]) -> Chooser:
    """The chooser that plays ``actions`` in order, then the last of them again (none: ``all``); ``all`` where
    the action is not allowed. The chooser is asked only for the agent's own iterations (not forced ones)."""
    names = action_names()
    idx = [names.index(a) for a in actions] or [0]
    return lambda it, x, mask: idx[min(it, len(idx) - 1)] if mask[idx[min(it, len(idx) - 1)]] else 0


# ---------------------------------------------------------------------------------------------- learned policy

def softmax_masked(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Softmax over the allowed actions. logits (..., A), mask (A,) or (..., A) bool -> probabilities (..., A)."""
    z = np.where(mask, logits, -np.inf)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def reinforce_loss(weights: np.ndarray, features: np.ndarray, actions: np.ndarray, mask: np.ndarray,
                   advantage: float) -> float:
    """REINFORCE's loss of one episode: ``-advantage * sum_t log pi(a_t | x_t)``, pi = softmax_masked(W x).
    weights (A, D), features (T, D), actions (T,) int, mask (A,) or (T, A) bool (the actions allowed at each
    step); returns a scalar."""
    p = softmax_masked(features @ weights.T, mask)
    return float(-advantage * np.log(p[np.arange(len(actions)), actions]).sum())


def reinforce_grad(weights: np.ndarray, features: np.ndarray, actions: np.ndarray, mask: np.ndarray,
                   advantage: float) -> np.ndarray:
    """The gradient of :func:`reinforce_loss` with respect to ``weights``: ``-advantage * sum_t (onehot(a_t) -
    pi_t) x_t^T``. Shapes as there; returns (A, D)."""
    p = softmax_masked(features @ weights.T, mask)
    onehot = np.zeros_like(p)
    onehot[np.arange(len(actions)), actions] = 1.0
    return -advantage * (onehot - p).T @ features


def imitation_loss(weights: np.ndarray, features: np.ndarray, actions: np.ndarray, mask: np.ndarray,
                   l2: float = 0.0) -> float:
    """The cross-entropy of pi = softmax_masked(W x) on demonstrated decisions, their mean, plus ``l2 / 2 *
    |W|^2``: :func:`reinforce_loss` with advantage 1 / T. weights (A, D), features (T, D), actions (T,) int, mask
    (A,) or (T, A) bool; returns a scalar."""
    n = max(len(actions), 1)
    return reinforce_loss(weights, features, actions, mask, 1.0 / n) + 0.5 * l2 * float((weights ** 2).sum())


def imitation_grad(weights: np.ndarray, features: np.ndarray, actions: np.ndarray, mask: np.ndarray,
                   l2: float = 0.0) -> np.ndarray:
    """The gradient of :func:`imitation_loss` with respect to ``weights``. Shapes as there; returns (A, D)."""
    n = max(len(actions), 1)
    return reinforce_grad(weights, features, actions, mask, 1.0 / n) + l2 * weights


def fit_imitation(features: np.ndarray, actions: np.ndarray, mask: np.ndarray, l2: float = 1e-6) -> np.ndarray:
    """Weights (A, D) whose greedy policy picks the demonstrated ``actions``: :func:`imitation_loss` minimised by
    L-BFGS on standardised features (the graph features differ by a few thousandths between some models, so
    raw features would leave the fit ill-conditioned), the standardisation then folded into the weights so that
    they apply to raw features (the first feature is the constant 1: it carries the offsets). features (T, D),
    actions (T,) int, mask (T, A) bool."""
    from scipy.optimize import minimize

    a_n, d = mask.shape[-1], features.shape[-1]
    mu, sd = features.mean(axis=0), features.std(axis=0)
    scale = np.divide(1.0, sd, out=np.zeros_like(sd), where=sd > 1e-12)  # (a feature constant here: 0)
    mu[0], scale[0] = 0.0, 1.0  # (the constant feature stays 1)
    z = (features - mu) * scale

    def f(w):
        w = w.reshape(a_n, d)
        return imitation_loss(w, z, actions, mask, l2), imitation_grad(w, z, actions, mask, l2).ravel()

    w = minimize(f, np.zeros(a_n * d), jac=True, method="L-BFGS-B", options={"maxiter": 5000}).x.reshape(a_n, d)
    out = w * scale
    out[:, 0] = w[:, 0] - (w * scale * mu).sum(axis=1)
    return out


@dataclass
class LinearPolicy:
    """A softmax over :func:`action_names`, linear in :meth:`FamilyScheduler.features`; ``weights`` (A, D)."""

    weights: np.ndarray
    info: dict = field(default_factory=dict)

    @classmethod
    def untrained(cls) -> "LinearPolicy":
        return cls(np.zeros((len(action_names()), N_FEATURES)))

    def greedy(self) -> Chooser:
        """The most probable allowed action (ties: the first, ``all`` before the others)."""
        return lambda it, x, mask: int(np.argmax(softmax_masked(self.weights @ x, mask)))

    def sampler(self, rng: np.random.Generator) -> Chooser:
        return lambda it, x, mask: int(rng.choice(len(mask), p=softmax_masked(self.weights @ x, mask)))

    def save(self, path: str | Path) -> None:
        from rlflow.atomic import write_text

        info = {k: v for k, v in self.info.items() if not k.startswith("_")}  # (in-memory results: not saved)
        doc = {"format": POLICY_FORMAT, "families": list(FAMILIES), "actions": action_names(),
               "weights": self.weights.tolist(), "info": info}
        write_text(Path(path), json.dumps(doc, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "LinearPolicy":
        path = Path(path)
        try:
            doc = read_document(path, POLICY_FORMAT, "an eqsat-rl policy")
        except RLFlowError:
            if str(_peek_format(path)).startswith(POLICY_FORMAT.rpartition("/")[0] + "/"):
                raise RLFlowError(f"{path}: an eqsat-rl policy of an older rlflow (its features differ from this "
                                  f"version's {POLICY_FORMAT}): train it again") from None
            raise
        w = np.asarray(doc.get("weights"), dtype=float)
        if doc.get("actions") != action_names() or w.shape != (len(action_names()), N_FEATURES):
            raise RLFlowError(f"{path}: an eqsat-rl policy for other actions or features than this version's")
        return cls(w, doc.get("info", {}))


def _peek_format(path: Path) -> object:
    """The ``format`` field of a JSON file, or None where it has none or cannot be read."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc.get("format") if isinstance(doc, dict) else None


#: the ILP's time limit (s) in the cheap proxy of a schedule's cost
PROXY_ILP_S = 3.0
#: the training reward's weight on time: a schedule in half of eqsat's time earns what 0.5% of the input's cost does
TIME_WEIGHT = 0.01


@dataclass(frozen=True)
class TrainConfig:
    """REINFORCE on the training models (see :func:`train_policy`)."""

    epochs: int = 6        # each: one sampled episode and one greedy evaluation per training model
    lr: float = 0.5        # step size on the normalised advantages
    all_bias: float = 2.0  # the initial logit of the start action (the others 0): sampling explores near it
    seed: int = 0
    proxy_ilp_s: float = PROXY_ILP_S  # the ILP's seconds in the rewards (the budget's own limit: no proxy;
    #                                   a clock-free budget's rewards use its own ILP: see proxy_cost)
    time_weight: float = TIME_WEIGHT  # the reward's weight on optimisation time (see train_policy)
    constant_start: bool = True  # score every constant schedule first and start from the best (see train_policy)
    late_candidates: int = 3  # the best constant schedules also scored stopping at their fixpoint
    per_model: bool = False  # each training model's own best schedule, then one policy imitating them all
    #                          (train_per_model; REINFORCE's epochs are not run)
    actions: tuple[str, ...] = ()  # the constant schedules scored (empty: every action but stop)
    openers: bool = False  # per model, also "A once, then all" for each action A scored (see train_per_model)
    stop_after: tuple[int, ...] = ()  # per model, eqsat's schedule and the stop_candidates cheapest others also
    #                                    ended after k iterations, for each k (see train_per_model)
    stop_candidates: int = 2


def _tighter(a: float, b: float) -> float:
    """The tighter of two limits, 0 meaning none."""
    return min(a, b) if a and b else a or b


def proxy_cost(graph: Graph, rules: Sequence[Rule], cost: CostModel, choose: Chooser, budget: EqsatBudget,
               ilp_s: float = PROXY_ILP_S) -> tuple[float, float, FamilyScheduler]:
    """The cheap proxy of a schedule: the cost (ms) of the graph the ILP extracts in at most ``ilp_s`` seconds
    (0: no limit; the budget's ILP time limit if that is shorter, its node limit kept) after saturating with it
    (the greedy extraction, cheaper still, kept the input's cost on most tiny zoo models, where the ILP found a
    gain: too flat to steer by), the seconds it took, and the scheduler. A clock-free budget
    (:attr:`EqsatBudget.clock_free`) gets no ILP clock here either: its own ILP, so that the schedules chosen by
    its proxy do not depend on the machine's speed and load."""
    short = budget if budget.clock_free else \
        replace(budget, ilp_time_limit_s=_tighter(budget.ilp_time_limit_s, ilp_s))
    r, sched = run_schedule(graph, rules, cost, choose, short)
    return r.final.runtime_ms, r.seconds, sched


def train_policy(graphs: Mapping[str, Graph], rules: Sequence[Rule], cost: CostModel | Mapping[str, CostModel],
                 budget: EqsatBudget, config: TrainConfig = TrainConfig(), log: Callable[[str], None] | None = None
                 ) -> tuple[LinearPolicy, list[dict]]:
    """Train a policy on ``graphs``; ``cost`` is one cost model, or one per model (a measured target's cost cache
    is a model's own). Per model the reward of an episode is (proxy cost of eqsat's schedule - the episode's) /
    the input's cost; if that is not negative, plus ``config.time_weight`` x (eqsat's schedule's seconds - the
    episode's) / eqsat's (a schedule as cheap as eqsat's in half its time earns what 0.5% of the input's cost
    does, at the default; a costlier graph earns nothing for its speed, so a positive reward is never a costlier
    graph). Rewards with time in them vary with the machine's load; ``time_weight`` 0 makes training
    deterministic for a seed (unless a time limit binds).

    With ``config.constant_start`` every constant schedule is scored first (:func:`constant_rewards`: one
    action throughout, a bandit over the actions). The ``config.late_candidates`` best of them (``all`` aside)
    are scored once more stopping at their fixpoint ("A, then stop": A until it is no longer allowed, the forced
    ``all`` iteration, then ``stop``; :func:`late_stop`). If the best of all these has a positive mean reward the
    policy starts from it (A's logit ``all_bias`` on the constant feature; a late stop adds ``stop``'s logit
    ``all_bias`` on the released feature, so it stops only once released), else from eqsat's schedule
    (``all``). Then REINFORCE: the
    advantage is the reward less the model's mean reward so far, normalised over the epoch. After each epoch
    the greedy policy is scored on every training model (the mean reward); the best policy so far (the
    starting one first) is returned, with one history row per epoch. The policy's ``info`` keeps the constant
    schedules' rewards."""
    if not graphs:
        raise RLFlowError("eqsat-rl: train_policy needs at least one training graph")
    if any(k < 1 for k in config.stop_after) or config.stop_candidates < 0:
        raise RLFlowError("eqsat-rl: stop_after needs iteration counts >= 1 and stop_candidates >= 0")
    t0 = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    policy = LinearPolicy.untrained()
    policy.weights[0, 0] = config.all_bias
    costs = dict(cost) if isinstance(cost, Mapping) else dict.fromkeys(graphs, cost)
    missing = sorted(set(graphs) - set(costs))
    if missing:
        raise RLFlowError(f"eqsat-rl: train_policy has no cost model for {', '.join(missing)}")
    score_of = lambda m, choose: proxy_cost(graphs[m], rules, costs[m], choose, budget,  # noqa: E731
                                            config.proxy_ilp_s)
    refs = {m: score_of(m, _fixed([])) for m in graphs}
    ref = {m: refs[m][:2] for m in graphs}
    initial = {m: costs[m].graph_metrics(g).runtime_ms for m, g in graphs.items()}

    def reward(m: str, c: float, t: float) -> float:
        gain = (ref[m][0] - c) / initial[m]
        return gain + config.time_weight * (ref[m][1] - t) / max(ref[m][1], 1e-9) if gain >= 0 else gain

    if config.per_model:
        return train_per_model(graphs, rules, score_of, reward, {m: r[2] for m, r in refs.items()}, budget,
                               config, t0, log)

    best, best_score = policy.weights.copy(), 0.0  # the initial greedy policy is eqsat's schedule: reward 0
    constant: dict[str, float] = {}
    if config.constant_start:
        constant = constant_rewards(graphs, rules, score_of, reward, log)
        ranked = sorted((a for a in constant if a != "all"), key=lambda a: -constant[a])
        for start in ranked[:config.late_candidates]:
            late = f"{start}, then stop"
            constant[late] = float(np.mean([reward(m, *score_of(m, late_stop(start))[:2]) for m in graphs]))
            if log:
                log(f"eqsat-rl schedule {late}: mean reward {constant[late]:+.4f}")
        best_name = max(constant, key=lambda a: (constant[a], a == "all"))  # (ties: eqsat's schedule)
        if constant[best_name] > 0:
            start = best_name.removesuffix(", then stop")
            policy.weights[:, 0] = 0.0
            policy.weights[action_names().index(start), 0] = config.all_bias
            if best_name != start:
                policy.weights[action_names().index(STOP), RELEASED] = config.all_bias
            best, best_score = policy.weights.copy(), constant[best_name]
    means: dict[str, list[float]] = {m: [] for m in graphs}
    history = []
    for epoch in range(config.epochs):
        episodes = []
        for m in graphs:
            c, t, sched = score_of(m, policy.sampler(rng))
            r = reward(m, c, t)
            base = float(np.mean(means[m])) if means[m] else 0.0
            means[m].append(r)
            episodes.append((r - base, sched))
        adv = np.array([a for a, _ in episodes])
        scale = adv.std() if adv.std() > 0 else 1.0
        grad, loss = np.zeros_like(policy.weights), 0.0
        for a, sched in episodes:
            if sched.decisions:
                x = np.stack([d[0] for d in sched.decisions])
                acts = np.array([d[1] for d in sched.decisions])
                masks = np.stack([d[2] for d in sched.decisions])
                grad += reinforce_grad(policy.weights, x, acts, masks, a / scale)
                loss += reinforce_loss(policy.weights, x, acts, masks, a / scale)
        policy.weights -= config.lr * grad / len(episodes)
        score = float(np.mean([reward(m, *score_of(m, policy.greedy())[:2]) for m in graphs]))
        if score > best_score:
            best, best_score = policy.weights.copy(), score
        row = {"epoch": epoch, "loss": loss / len(episodes), "sampled_reward": float(np.mean([means[m][-1] for m in graphs])),
               "greedy_reward": score, "best_greedy_reward": best_score, "seconds": time.perf_counter() - t0}
        history.append(row)
        if log:
            log(f"eqsat-rl epoch {epoch}: sampled reward {row['sampled_reward']:+.4f}, greedy {score:+.4f} "
                f"(best {best_score:+.4f}), {row['seconds']:.0f} s")
    info = {"trained_on": sorted(graphs), "budget": asdict(budget), "train": asdict(config),
            "train_seconds": time.perf_counter() - t0, "best_greedy_reward": best_score,
            "constant_rewards": constant}
    return LinearPolicy(best, info), history


def late_stop(action: str) -> Chooser:
    """The schedule "``action``, then stop": ``action`` while it is allowed, ``stop`` once released (``all``
    where neither is allowed: the first iteration of a model without ``action``'s families)."""
    names = action_names()
    a, stop = names.index(action), names.index(STOP)
    return lambda it, x, mask: a if mask[a] else stop if (mask[stop] and x[RELEASED]) else 0


def constant_rewards(graphs: Mapping[str, Graph], rules: Sequence[Rule],
                     score_of: Callable[[str, Chooser], tuple[float, float, FamilyScheduler]],
                     reward: Callable[[str, float, float], float], log: Callable[[str], None] | None = None
                     ) -> dict[str, float]:
    """The mean reward over ``graphs`` of each constant schedule: one action (not ``stop``) in every iteration,
    ``all`` where the action is not allowed on a model (so ``all`` itself is eqsat's schedule, reward 0).
    Actions allowed on no training model are left out."""
    names = action_names()
    present = {m: present_families(g, [r for r in rules if r.min_opset <= g.opset]) for m, g in graphs.items()}
    out: dict[str, float] = {}
    for a, name in enumerate(names):
        if name == STOP or not any(action_mask(p)[a] for p in present.values()):
            continue
        choose = _constant(a)
        out[name] = 0.0 if name == "all" else float(np.mean([reward(m, *score_of(m, choose)[:2]) for m in graphs]))
        if log:
            log(f"eqsat-rl constant schedule {name}: mean reward {out[name]:+.4f}")
    return out


def stop_after(choose: Chooser, k: int) -> Chooser:
    """``choose``'s schedule ended after ``k`` iterations: ``stop`` from iteration ``k`` on (``k`` >= 1: stopping
    before the first iteration would extract the input)."""
    if k < 1:
        raise RLFlowError(f"eqsat-rl: stop after {k} iterations: need at least 1")
    s = action_names().index(STOP)
    return lambda it, x, mask: s if it >= k and mask[s] else choose(it, x, mask)


def opener(action: str) -> Chooser:
    """The schedule "``action`` once, then all": ``action`` in the first iteration (``all`` if it is not allowed
    there), eqsat's schedule after it."""
    return _fixed([action, "all"])


def _constant(a: int) -> Chooser:
    """The constant schedule of action index ``a``: ``a`` wherever it is allowed, else ``all``."""
    return lambda it, x, mask: a if mask[a] else 0


def train_per_model(graphs: Mapping[str, Graph], rules: Sequence[Rule],
                    score_of: Callable[[str, Chooser], tuple[float, float, FamilyScheduler]],
                    reward: Callable[[str, float, float], float], refs: Mapping[str, FamilyScheduler],
                    budget: EqsatBudget, config: TrainConfig, t0: float,
                    log: Callable[[str], None] | None = None) -> tuple[LinearPolicy, list[dict]]:
    """:func:`train_policy` with ``config.per_model``: per training model, every constant schedule of
    ``config.actions`` (all of them if empty) allowed on it is scored, and its ``config.late_candidates`` best
    once more stopping at their fixpoint, and with ``config.openers`` each of those actions also as an opener
    (:func:`opener`: once, then eqsat's schedule); the model's own best schedule is the one with the highest reward
    (eqsat's, ``all``, unless one beats it). With ``config.stop_after``, eqsat's schedule and the
    ``config.stop_candidates`` schedules scored so far that extract the cheapest graphs are scored again ended
    after k iterations (:func:`stop_after`) for each k given, where they ran longer: a smaller e-graph is quicker
    to extract, and with a node-limited ILP it can hold a cheaper graph than the full one. Then one policy
    imitates every model's best episode
    (:func:`fit_imitation` on the decisions and their features, the input graph's op mix among them: models with
    different op mixes get different schedules). A model whose decisions the policy does not all reproduce is
    scored again with the policy (its reward is the policy's, not the demonstration's). ``refs`` are eqsat's
    schedules' schedulers. The policy's ``info["per_model"]`` keeps per model: the schedule imitated and its
    reward, the actions run, whether the imitation is exact, every constant schedule's reward and the imitated
    episode's decisions (``demonstration``: features, action index, allowed action indices); its
    scheduler's ``result`` (the graph) stays in ``info`` only in memory under ``"_results"`` (not saved)."""
    names = action_names()
    wanted = [a for a in (config.actions or names) if a != STOP]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise RLFlowError(f"eqsat-rl: unknown action(s) {', '.join(unknown)} (all, only:F, no:F; F one of "
                          f"{', '.join(FAMILIES)})")
    best: dict[str, tuple[str, float, FamilyScheduler]] = {}
    table: dict[str, dict[str, float]] = {}
    for m, g in graphs.items():
        mask = action_mask(present_families(g, [r for r in rules if r.min_opset <= g.opset]))
        rewards, scheds, choosers, ms = {"all": 0.0}, {"all": refs[m]}, {"all": _fixed([])}, {}

        def score(label: str, choose: Chooser) -> None:  # (model m's schedule ``label``; used in this iteration)
            ms[label], t, scheds[label] = score_of(m, choose)
            rewards[label], choosers[label] = reward(m, ms[label], t), choose
            if log:
                log(f"eqsat-rl {m}: schedule {label}: reward {rewards[label]:+.4f} ({t:.1f} s)")

        allowed = [a for a in wanted if a != "all" and mask[names.index(a)]]
        for name in allowed:
            score(name, _constant(names.index(name)))
        for start in sorted(allowed, key=lambda a: -rewards[a])[:config.late_candidates]:
            score(f"{start}, then stop", late_stop(start))
        for name in (allowed if config.openers else ()):
            score(f"{name} once, then all", opener(name))
        if config.stop_after:
            cheapest = sorted(ms, key=lambda a: (ms[a], -rewards[a]))
            for base in ["all"] + cheapest[:config.stop_candidates]:
                ran = len([a for a in scheds[base].schedule if a != STOP])
                for k in sorted({k for k in config.stop_after if k < ran}):
                    score(f"{base}, stop after {k}", stop_after(choosers[base], k))
        name = max(rewards, key=lambda a: (rewards[a], a == "all"))  # (ties: eqsat's schedule)
        best[m], table[m] = (name, rewards[name], scheds[name]), rewards
    demos = [sched.decisions for _, _, sched in best.values() if sched.decisions]
    if demos:
        x = np.stack([d[0] for ds in demos for d in ds])
        acts = np.array([d[1] for ds in demos for d in ds])
        masks = np.stack([d[2] for ds in demos for d in ds])
        policy = LinearPolicy(fit_imitation(x, acts, masks))
    else:
        policy = LinearPolicy.untrained()
    greedy = policy.greedy()
    per_model, results = {}, {}
    for m, (name, r, sched) in best.items():
        exact = all(greedy(0, x, mask) == a for x, a, mask in sched.decisions)
        if not exact:  # the policy does something else on this model: score what it does
            c, t, sched = score_of(m, greedy)
            r = reward(m, c, t)
        demo = best[m][2].decisions
        per_model[m] = {"imitated": name, "reward": r, "exact": exact, "schedule": list(sched.schedule),
                        "constant_rewards": table[m],
                        "demonstration": [{"features": x.tolist(), "action": int(a),
                                           "allowed": np.flatnonzero(k).tolist()} for x, a, k in demo]}
        results[m] = (getattr(refs[m], "result", None), getattr(sched, "result", None))
        if log:
            log(f"eqsat-rl {m}: imitates {name} (reward {r:+.4f}{'' if exact else ', not exactly: rescored'})")
    score = float(np.mean([v["reward"] for v in per_model.values()]))
    scored = dict.fromkeys(a for t in table.values() for a in t)  # every schedule scored on some model
    mean = {a: float(np.mean([t.get(a, 0.0) for t in table.values()])) for a in scored}
    info = {"trained_on": sorted(graphs), "budget": asdict(budget), "train": asdict(config),
            "train_seconds": time.perf_counter() - t0, "best_greedy_reward": score, "constant_rewards": mean,
            "per_model": per_model, "_results": results}
    return LinearPolicy(policy.weights, info), []


def eqsat_rl_search(graph: Graph, rules: Sequence[Rule], cost: CostModel, policy: LinearPolicy,
                    budget: EqsatBudget, extraction: str = "ilp") -> SearchResult:
    """The learned agent's schedule (greedy), then the ILP (or ``extraction``): the method ``eqsat-rl``."""
    r, _ = run_schedule(graph, rules, cost, policy.greedy(), budget, extraction, method="eqsat-rl")
    r.stats["policy_trained_on"] = policy.info.get("trained_on")
    return r


def random_schedule_search(graph: Graph, rules: Sequence[Rule], cost: CostModel, budget: EqsatBudget,
                           seed: int = 0) -> SearchResult:
    """A uniformly random allowed action per iteration (seeded), then the ILP."""
    rng = np.random.default_rng(seed)
    choose = lambda it, x, mask: int(rng.choice(np.flatnonzero(mask)))  # noqa: E731
    return run_schedule(graph, rules, cost, choose, budget, method="eqsat-random")[0]


# ------------------------------------------------------------------------------------------------ tree search

def tree_search(graph: Graph, rules: Sequence[Rule], cost: CostModel, budget: EqsatBudget, depth: int = 3,
                simulations: int = 16, c_uct: float = 1.0, seed: int = 0, extraction: str = "ilp") -> SearchResult:
    """UCT over the actions of the first ``depth`` iterations (MCTS-GEB style; see the module docstring; a
    ``stop`` ends its branch): ``simulations`` leaves, each scored by :func:`proxy_cost` (value: the input's cost over the leaf's, so
    higher is better), a leaf seen before not run again; then the best leaf's schedule with the ILP. The
    result's seconds include the search; stats add ``tree_simulations``, ``tree_seconds``, ``tree_best_proxy_ms``."""
    if depth < 1 or simulations < 1:
        raise RLFlowError("eqsat-rl tree search: need depth >= 1 and simulations >= 1")
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    usable = [r for r in rules if r.min_opset <= graph.opset]
    allowed = np.flatnonzero(action_mask(present_families(graph, usable)))
    names = action_names()
    c0 = cost.graph_metrics(graph).runtime_ms
    visits: dict[tuple, int] = {}
    value: dict[tuple, float] = {}
    leaves: dict[tuple, float] = {}

    def evaluate(prefix: tuple) -> float:
        if prefix not in leaves:
            leaves[prefix] = proxy_cost(graph, rules, cost, _fixed([names[a] for a in prefix]), budget)[0]
        return c0 / leaves[prefix] if leaves[prefix] > 0 else 1.0

    order = [0] + [a for a in allowed if a != 0]
    stop = names.index(STOP)
    for sim in range(simulations):
        path, prefix = [()], ()
        while len(prefix) < depth and stop not in prefix:
            moves = order if prefix else [a for a in order if a != stop]  # (no stop before the first iteration)
            untried = [a for a in moves if prefix + (a,) not in visits]
            if untried:  # expand: ``all`` first (eqsat's schedule is the first leaf), then in random order
                a = untried[0] if sim == 0 else int(rng.choice(untried))
                prefix += (a,)
                path.append(prefix)
                break
            n = visits[prefix]
            prefix += (max(moves, key=lambda b: value[prefix + (b,)] / visits[prefix + (b,)]
                           + c_uct * math.sqrt(math.log(n) / visits[prefix + (b,)])),)
            path.append(prefix)
        # the rest of the schedule: the last action again (``all`` throughout is eqsat's), unless it stopped
        leaf = prefix if stop in prefix else prefix + prefix[-1:] * (depth - len(prefix))
        v = evaluate(leaf)
        for p in path:
            visits[p] = visits.get(p, 0) + 1
            value[p] = value.get(p, 0.0) + v
    best = min(leaves, key=lambda p: (leaves[p], p))
    t_tree = time.perf_counter() - t0
    r, _ = run_schedule(graph, rules, cost, _fixed([names[a] for a in best]), budget, extraction,
                        method="eqsat-mcts")
    r.seconds = time.perf_counter() - t0
    r.stats.update(tree_simulations=len(leaves), tree_seconds=t_tree, tree_best_proxy_ms=leaves[best])
    return r
