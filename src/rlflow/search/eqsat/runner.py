"""The runner (egg's run.rs): iterations of match, apply, rebuild, under a scheduler and limits.

    runner = Runner(egraph, rules, BackoffScheduler(multi_iterations=2), node_limit=50_000, iter_limit=15)
    runner.run()                   # or runner.step() per iteration, deciding between steps
    runner.stop_reason             # StopReason.SATURATED, NODE_LIMIT, ITERATION_LIMIT or TIME_LIMIT
    runner.iterations              # one IterationRecord per iteration: what ran, matched, applied, sizes, times

**One iteration.** The scheduler selects the rules to search (:meth:`Scheduler.select`); each selected rule's new
matches are found and checked, all before any is applied (as egg does: the matches of an iteration are those of
the e-graph as the iteration found it); then they are applied in order until the e-graph reaches the node limit,
the e-graph is rebuilt, and Tensat's cycle filtering (:meth:`EGraph.remove_cycles`) runs. A rule that finds more
new matches than the scheduler's :meth:`Scheduler.match_limit` applies none of them (they stay unseen, to be
found again later) and the scheduler is told (:meth:`Scheduler.over_limit`).

**Semi-naive matching.** A single-root rule that saw every match last iteration only looks for matches rooted
within its pattern's depth above what changed since (identical results, about 3x faster on BERT): a match of such
a rule is new only if one of its op instances was added or changed class since the last iteration began.

**Stopping.** Before an iteration if the scheduler ends saturation there (:meth:`Scheduler.stop`: an agent's
``stop`` action), at the node limit (reached while applying, or after the rebuild), at the time limit (checked after
each rule's search and after the rebuild), at the iteration limit, or saturated: an iteration changed nothing (no
merge, no new e-node or e-class) and the scheduler agrees (:meth:`Scheduler.can_stop`: the backoff scheduler
first lifts its bans and runs the banned rules again).

**Schedulers.** :class:`BackoffScheduler` is egg's backoff scheduler with Tensat's limit on multi-pattern rules:
multi-pattern rules run only in the first ``multi_iterations`` iterations (their matches grow with the square of
the graph), and a rule that matches too often is banned for a while (multi-pattern rules are exempt: a ban would
outlast their iterations). Any other policy, such as an agent choosing which rules run in each iteration, is a
subclass of :class:`Scheduler` overriding :meth:`Scheduler.select`.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from rlflow.rewrite.rule import Rule
from rlflow.search.eqsat.egraph import EGraph, Key
from rlflow.search.eqsat.pattern import Binding, Index, Pattern, apply_match, check, find_bindings

#: the backoff scheduler's defaults: a rule with more than RULE_MATCH_LIMIT << n new matches in one iteration, n
#: its bans so far, applies none of them and is banned for BAN_LENGTH << n iterations. Without it, add
#: associativity and commutativity filled ViT's e-graph to the 50,000-node limit in 4 iterations (17,645 and 4,002
#: applications) and its ILP found no answer in time.
RULE_MATCH_LIMIT = 1_000
BAN_LENGTH = 5


class StopReason(enum.StrEnum):
    """Why saturation stopped (the values are the strings SearchResult.stop_reason and the report use)."""

    SATURATED = "saturated"
    NODE_LIMIT = "node_limit"
    ITERATION_LIMIT = "iteration_limit"
    TIME_LIMIT = "time_limit"
    SCHEDULER = "scheduler"  # the scheduler ended saturation (Scheduler.stop)


@dataclass(frozen=True)
class IterationRecord:
    """What one iteration did (egg's Iteration)."""

    iteration: int
    rules_run: tuple[str, ...]        # the rules searched (by Rule.id: names repeat across variants), in order
    rules_over_limit: tuple[str, ...]  # searched rules that found more than their match limit: none applied
    matches: int                      # new matches that passed the whole-match checks
    applied: int                      # matches applied (their targets added and merged)
    merges: int                       # unions that changed the e-graph
    filtered: int                     # matches not applied: the target needs an e-node cycle filtering removed
    fired: dict[str, int]             # rule id -> applications that merged something
    cycle_enodes_removed: int
    nodes: int                        # e-nodes after the iteration
    classes: int                      # e-classes after the iteration
    search_s: float
    apply_s: float
    rebuild_s: float                  # rebuild and cycle filtering

    @property
    def seconds(self) -> float:
        return self.search_s + self.apply_s + self.rebuild_s


class Scheduler:
    """Which rules run in each iteration (egg's RewriteScheduler). This base runs every rule every iteration,
    without a match limit; subclasses override what they decide."""

    def start(self, runner: "Runner") -> None:
        """Called once by the runner that this scheduler drives, before its first iteration (a scheduler that
        reads the iteration records keeps ``runner``)."""

    def stop(self, iteration: int, egraph: EGraph) -> bool:
        """End saturation before ``iteration`` (0-based)? :meth:`Runner.run` asks before each iteration; this
        base never does."""
        return False

    def select(self, iteration: int, egraph: EGraph, patterns: Sequence[Pattern]) -> Sequence[Pattern]:
        """The rules to search in ``iteration`` (0-based), in the order their matches are applied."""
        return patterns

    def match_limit(self, iteration: int, pattern: Pattern) -> float:
        """The most new matches ``pattern`` may apply in ``iteration``; with more it applies none."""
        return math.inf

    def over_limit(self, iteration: int, pattern: Pattern) -> None:
        """``pattern`` found more than its match limit in ``iteration`` (none of its matches is applied)."""

    def can_stop(self, iteration: int) -> bool:
        """``iteration`` changed nothing: may saturation stop? (False: run another iteration.)"""
        return True


@dataclass
class _Ban:
    times: int = 0   # bans so far
    until: int = 0   # the first iteration the rule runs again


@dataclass
class BackoffScheduler(Scheduler):
    """egg's backoff scheduler, and multi-pattern rules only in the first ``multi_iterations`` iterations (see
    the module docstring)."""

    multi_iterations: int = 2
    match_limit_base: int = RULE_MATCH_LIMIT
    ban_length: int = BAN_LENGTH
    bans: dict[str, _Ban] = field(default_factory=dict)  # rule id -> its bans

    def select(self, iteration: int, egraph: EGraph, patterns: Sequence[Pattern]) -> list[Pattern]:
        return [p for p in patterns if not (p.multi and iteration >= self.multi_iterations)
                and iteration >= self._ban(p).until]

    def match_limit(self, iteration: int, pattern: Pattern) -> float:
        # multi-pattern rules are limited by multi_iterations instead: a ban would outlast them
        return math.inf if pattern.multi else self.match_limit_base << self._ban(pattern).times

    def over_limit(self, iteration: int, pattern: Pattern) -> None:
        ban = self.bans.setdefault(pattern.rule.id, _Ban())
        ban.until = iteration + 1 + (self.ban_length << ban.times)
        ban.times += 1

    def can_stop(self, iteration: int) -> bool:
        if not any(b.until > iteration for b in self.bans.values()):
            return True
        for b in self.bans.values():  # nothing else to do: the banned rules run next
            b.until = 0
        return False

    def _ban(self, p: Pattern) -> _Ban:
        return self.bans.get(p.rule.id) or _Ban()


@dataclass
class _Found:
    """One iteration's search: the checked matches to apply, in order, and what ran."""

    todo: list[tuple[Pattern, Binding, tuple[dict, dict]]] = field(default_factory=list)
    rules_run: list[str] = field(default_factory=list)
    over_limit: list[str] = field(default_factory=list)


@dataclass
class _Applied:
    applied: int = 0
    merges: int = 0
    filtered: int = 0
    fired: dict[str, int] = field(default_factory=dict)
    hit_node_limit: bool = False


class Runner:
    """Equality saturation of ``egraph`` by ``rules`` (those whose source roots are joined: :attr:`patterns`) under
    ``scheduler`` (see the module docstring).
    ``deadline`` is a :func:`time.perf_counter` time; ``semi_naive`` False matches every rule against the whole
    e-graph in every iteration (the same result, slower: tests)."""

    def __init__(self, egraph: EGraph, rules: Sequence[Rule], scheduler: Scheduler | None = None, *,
                 node_limit: int = 50_000, iter_limit: int = 15, deadline: float = math.inf,
                 semi_naive: bool = True) -> None:
        self.egraph = egraph
        # a rule whose source is unconnected ops sharing no variable (two independent Relus, two convs on different
        # inputs) is left out: it matches every pair of e-nodes of its ops, and its targets make new e-nodes of
        # those ops that pair again (on a tiny squeezenet the two Relu batchings filled the e-graph to the node
        # limit in two iterations and the ILP found no optimum in 60 s); the graph searches and the agents use them
        self.patterns = [p for p in map(Pattern, rules) if p.joined]
        self.scheduler = scheduler if scheduler is not None else BackoffScheduler()
        self.node_limit, self.iter_limit, self.deadline = node_limit, iter_limit, deadline
        self.semi_naive = semi_naive
        self.iterations: list[IterationRecord] = []
        self.stop_reason: StopReason | None = None
        self._seen: set[tuple] = set()         # the matches found so far (Binding.key)
        self._prev: dict[Key, int] = {}        # the e-graph's e-nodes when the last iteration began
        self._complete: dict[str, int] = {}    # rule id -> the last iteration in which it ran on every match
        self._max_depth = max((p.depth for p in self.patterns), default=0)
        self.scheduler.start(self)

    def run(self) -> StopReason:
        """Iterate until a stop reason; returns it. Before each iteration the scheduler may end saturation
        (:meth:`Scheduler.stop`; :meth:`step` alone does not ask it)."""
        if self.stop_reason is None and len(self.iterations) >= self.iter_limit:
            self.stop_reason = StopReason.ITERATION_LIMIT
        while self.stop_reason is None:
            if self.scheduler.stop(len(self.iterations), self.egraph):
                self.stop_reason = StopReason.SCHEDULER
                break
            self.step()
        return self.stop_reason

    def step(self) -> IterationRecord:
        """One iteration; sets :attr:`stop_reason` if saturation ends with it."""
        if self.stop_reason is not None:
            raise RuntimeError(f"eqsat: the runner has stopped ({self.stop_reason.value})")
        eg, it = self.egraph, len(self.iterations)
        size = (eg.n_nodes, len(eg.parent))
        t0 = time.perf_counter()
        found = self._search(it)
        t1 = time.perf_counter()
        done = self._apply(found)
        t2 = time.perf_counter()
        eg.rebuild()
        removed = eg.remove_cycles()
        t3 = time.perf_counter()
        record = IterationRecord(
            iteration=it, rules_run=tuple(found.rules_run), rules_over_limit=tuple(found.over_limit),
            matches=len(found.todo), applied=done.applied, merges=done.merges, filtered=done.filtered,
            fired=done.fired, cycle_enodes_removed=removed, nodes=eg.n_nodes, classes=eg.n_classes,
            search_s=t1 - t0, apply_s=t2 - t1, rebuild_s=t3 - t2)
        self.iterations.append(record)
        self.stop_reason = self._stop(it, size, done)
        if self.stop_reason is None and len(self.iterations) >= self.iter_limit:
            self.stop_reason = StopReason.ITERATION_LIMIT
        return record

    def _search(self, it: int) -> _Found:
        """The new, checked matches of the rules the scheduler selects."""
        eg = self.egraph
        ix = Index(eg)
        near = None
        if self._prev and self.semi_naive:
            near = ix.near({c for key, c in eg.memo.items() if self._prev.get(key) != c}, self._max_depth)
        self._prev = dict(eg.memo)
        out = _Found()
        for p in self.scheduler.select(it, eg, self.patterns):
            out.rules_run.append(p.rule.id)
            fresh = self._fresh(p, ix, near, it)
            if fresh is None:
                out.over_limit.append(p.rule.id)
            else:
                for key, binding in fresh:
                    self._seen.add(key)
                    checked = check(eg, ix, p, binding)
                    if checked is not None:
                        out.todo.append((p, binding, checked))
            if time.perf_counter() > self.deadline:
                break
        return out

    def _fresh(self, p: Pattern, ix: Index, near: list | None, it: int) -> list[tuple[tuple, Binding]] | None:
        """``p``'s matches not seen before, each with its key (only near what changed, if ``p`` saw every match
        last iteration), or None if there are more than the scheduler's limit (they stay unseen, to be found
        again later)."""
        limit = self.scheduler.match_limit(it, p)
        first = near[p.depth] if near is not None and not p.multi and self._complete.get(p.rule.id) == it - 1 \
            else None
        fresh: list[tuple[tuple, Binding]] = []
        for binding in find_bindings(self.egraph, ix, p, first):
            key = binding.key(p.rule.id)
            if key not in self._seen:
                fresh.append((key, binding))
                if len(fresh) > limit:
                    self.scheduler.over_limit(it, p)
                    return None
        self._complete[p.rule.id] = it
        return fresh

    def _apply(self, found: _Found) -> _Applied:
        """Apply the matches in order until the e-graph reaches the node limit."""
        eg, out = self.egraph, _Applied()
        for p, binding, (refs, dt) in found.todo:
            if eg.n_nodes >= self.node_limit:
                out.hit_node_limit = True
                break
            merged = apply_match(eg, p, binding, refs, dt)
            if merged is None:
                out.filtered += 1
                continue
            out.applied += 1
            out.merges += merged
            if merged:
                out.fired[p.rule.id] = out.fired.get(p.rule.id, 0) + 1
        return out

    def _stop(self, it: int, size: tuple[int, int], done: _Applied) -> StopReason | None:
        eg = self.egraph
        if done.hit_node_limit:
            return StopReason.NODE_LIMIT
        if time.perf_counter() > self.deadline:
            return StopReason.TIME_LIMIT
        if eg.n_nodes >= self.node_limit:
            return StopReason.NODE_LIMIT
        changed = done.merges or (eg.n_nodes, len(eg.parent)) != size
        if not changed and self.scheduler.can_stop(it):  # nothing changed (no match, or none new)
            return StopReason.SATURATED
        return None
