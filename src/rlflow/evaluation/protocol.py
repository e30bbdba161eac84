"""The measurement protocol: is a graph faster than the original on a backend, by how much, and can we tell?

Every speed claim of the project goes through :func:`compare` (the evaluate stage, ``rlflow run --compare``,
``rlflow optimize``'s speed check and the ``e2e`` reward's measurements), so they all answer the same way.

Design (why). On a shared CPU, two onnxruntime sessions of the *same* file differ by about 1% consistently
(memory placement, thread pools): session effects are larger than the run-to-run noise, so timing one session
per graph and resampling its runs calls identical graphs "significantly" different. So:

1. **Sessions.** Each graph is run in ``sessions`` independently created runners (``make_runner`` is called
   afresh for every one), one block after another. In block ``s`` every graph gets a fresh runner, built in an
   order drawn at random per block (built always first, the reference ran 0.16% slower than identical bytes:
   ``benchmarks/aa_test.py --copy same``), ``warmup`` untimed calls each, then timed **rounds**: every graph
   called once per round, so drift and cache effects hit every graph alike. Rounds come in mirrored pairs: an
   order drawn at random (seeded), then the same order reversed, so in a block every graph runs before and after
   every other equally often (up to one round); the position matters: on paper-size BERT A/A (48 sessions) the
   per-round ratio was 0.8% higher (t = 2.9) when the reference ran first. The block's runners are released
   before the next block (one runner per graph alive at a time).
2. **Budget.** ``budget_s`` (from the config) is the comparison's seconds of timing -- warm-up and timed rounds,
   shared out evenly: block ``s`` runs rounds until the timing spent reaches ``budget_s (s + 1) / sessions`` (at
   least ``min_rounds``, at most ``max_rounds``; ``min_rounds`` may overrun it when one round alone is longer).
   Building the runners is not counted (:attr:`Comparison.seconds` is the wall time, builds included): it depends
   on the backend, not on how precise the comparison is.
3. **Estimate.** Paired by round: in every round each graph ran once, moments apart and in random order, so
   whatever slowed the machine in that round (the other core busy, a frequency change) slowed both alike. Per
   round the log of graph time / reference time; per session (block) their 20%-trimmed mean
   (:data:`TRIM`, scipy's ``trim_mean``); the ratio is ``exp`` of the mean of those over the sessions (< 1:
   faster). The sessions are the independent replicates -- each has its
   own freshly built runners, so a session effect (memory placement, thread pools) is part of its value -- and
   the interval is Student's t over them (scipy), ``confidence`` coverage with ``sessions - 1`` degrees of
   freedom. Why these two choices, measured here: on paper-size BERT (8 sessions, 60 s) the unpaired ratio of
   session medians gave a smallest detectable effect of 6-8%, the paired one 1.3-2% on the same runs, because
   slow spells last several runs; and a percentile bootstrap over 4 (8) sessions with a 1% session effect
   called identical graphs different in 14% (8%) of simulated comparisons, the t interval in 5% (6%). Why a
   trimmed mean per session: per-round log ratios of paper-size BERT on onnxruntime are heavy-tailed (5th-95th
   percentile -16% to +16%, quartiles +-3.7%); over 48 recorded A/A sessions the session medians were not normal
   (Shapiro-Wilk p = 0.013), which the t interval assumes, while the 20%-trimmed means were (p = 0.61), with a
   smallest detectable effect of 1.3% against the median's 1.1% (8 sessions resampled from the 48).
4. **Verdict.** ``faster`` when the whole interval is below 1, ``slower`` when above 1, else ``no detectable
   difference``. The **smallest detectable effect** is the relative change this comparison would detect with
   80% power at its confidence level: ``exp((t_{1-a/2} + t_{0.8}) se) - 1`` with ``se`` the standard error of
   the mean log ratio over the sessions (scipy's t quantiles).
5. **A/A control** (:func:`aa_copy`): the original re-exported to ONNX and imported again through the IR, timed
   as a graph of its own. Its interval must contain 1.0; when it does not, the comparison is **too noisy** and
   no verdict of it is a finding (:attr:`Comparison.too_noisy`).

Statistics use numpy and scipy (Student's t quantiles); nothing is written by hand.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rlflow.errors import RLFlowError

FASTER, SLOWER, SAME = "faster", "slower", "no detectable difference"
REFERENCE = "reference"
#: the verdicts a non-reference graph can get
VERDICTS = (FASTER, SLOWER, SAME)
#: the name the A/A control is timed under (the original, re-imported and re-exported through the IR)
AA = "original-aa"
#: the power the smallest detectable effect is computed for
POWER = 0.8
#: the share of rounds cut from each end of a session's log ratios before averaging (see the module docstring)
TRIM = 0.2

Runner = Callable[[dict], Any]


@dataclass(frozen=True)
class Protocol:
    """The protocol's settings (config section ``timing``; see ``src/rlflow/config.schema.yaml``)."""

    sessions: int = 4
    """Independently created runners per graph, one block each (>= 2: the session level needs two)."""
    warmup: int = 3
    """Untimed calls of every fresh runner before its block's rounds."""
    budget_s: float = 20.0
    """Seconds of timing per comparison (warm-up and timed rounds of all its graphs; building runners not counted)."""
    min_rounds: int = 3
    """Rounds per block at least, whatever the budget."""
    max_rounds: int = 500
    """Rounds per block at most."""
    confidence: float = 0.95
    """Coverage of the ratio's interval."""
    seed: int = 0
    """Seeds the round orders."""

    def __post_init__(self):
        if self.sessions < 2 or self.warmup < 0 or self.min_rounds < 1 or self.max_rounds < self.min_rounds \
                or not self.budget_s > 0 or not 0 < self.confidence < 1:
            raise RLFlowError(
                f"timing: need sessions >= 2, warmup >= 0, 1 <= min_rounds <= max_rounds, budget_s > 0, "
                f"and 0 < confidence < 1 (got sessions {self.sessions}, warmup {self.warmup}, "
                f"rounds {self.min_rounds}..{self.max_rounds}, budget_s {self.budget_s}, confidence "
                f"{self.confidence})")

    @classmethod
    def from_config(cls, config: Mapping[str, Any], budget_s: float | None = None) -> "Protocol":
        """The protocol of ``config`` (section ``timing``, schema defaults filled in by the config loader; seed:
        the config's ``seed``); ``budget_s`` overrides ``timing.budget_s``."""
        t = dict(config.get("timing") or {})
        fields = {k: t[k] for k in ("sessions", "warmup", "budget_s", "min_rounds", "max_rounds",
                                    "confidence") if k in t}
        if budget_s is not None:
            fields["budget_s"] = budget_s
        return cls(seed=int(config.get("seed", 0)), **fields)

    def for_graphs(self, n: int) -> "Protocol":
        """This protocol for one comparison of ``n`` graphs. ``budget_s`` is what a comparison of two graphs (the
        never-slower check: the original and one candidate) gets; every graph runs once per round, so ``n`` graphs
        get ``n / 2`` times as much, and each of their ratios rests on as many rounds as that check's. (With nine
        graphs in 12 s, paper-size BERT's sessions got 3-4 rounds each, too few for the trimmed mean to cut the
        heavy tails: the original against itself gave 0.990 [0.831, 1.179] on onnxruntime.)"""
        if n < 2:
            raise RLFlowError(f"a comparison needs at least two graphs (got {n})")
        return replace(self, budget_s=self.budget_s * n / 2)

    def describe(self, per: str = "comparison") -> str:
        """The settings in one line; the budget is ``budget_s`` per ``per``."""
        return (f"{self.sessions} sessions per graph, {self.warmup} warm-up calls each, randomised rounds in "
                f"mirrored pairs within {self.budget_s:g} s per {per} ({self.min_rounds}-{self.max_rounds} "
                f"rounds per session), {self.confidence:.0%} interval paired by round (a {TRIM:.0%}-trimmed mean "
                f"per session), Student's t over the sessions")


@dataclass
class Estimate:
    """One graph of a comparison: its latency, and its ratio to the reference with the interval and verdict."""

    name: str
    times_ms: list[list[float]]
    """The timed calls, one list per session (block)."""
    ratio: float | None = None
    """latency / the reference's latency (< 1: faster); 1 for the reference itself."""
    ci_low: float | None = None
    ci_high: float | None = None
    verdict: str = REFERENCE
    """:data:`FASTER` | :data:`SLOWER` | :data:`SAME`; :data:`REFERENCE` for the reference."""
    detectable: float | None = None
    """The smallest relative latency change this comparison detects with 80% power (0.02 = 2%)."""

    @property
    def latency_ms(self) -> float:
        """Mean over sessions of the session's median run (the protocol's latency)."""
        return float(np.mean([np.median(s) for s in self.times_ms]))

    @property
    def median_ms(self) -> float:
        return float(np.median(np.concatenate(self.times_ms)))

    @property
    def iqr_ms(self) -> float:
        q1, q3 = np.percentile(np.concatenate(self.times_ms), [25, 75])
        return float(q3 - q1)

    @property
    def runs(self) -> int:
        return sum(len(s) for s in self.times_ms)

    def interval(self) -> str:
        """``1.004 [0.991, 1.017]``."""
        if self.ratio is None or self.ci_low is None:
            return "n/a"
        return f"{self.ratio:.3f} [{self.ci_low:.3f}, {self.ci_high:.3f}]"


@dataclass
class Comparison:
    """The result of :func:`compare`: one :class:`Estimate` per graph, the reference first."""

    reference: str
    estimates: dict[str, Estimate]
    rounds: list[int] = field(default_factory=list)
    """Timed rounds in each block."""
    seconds: float = 0.0
    """Wall time of the comparison, runner builds included."""
    timing_s: float = 0.0
    """Seconds of warm-up and timed rounds (what ``budget_s`` bounds)."""
    protocol: Protocol | None = None

    def __getitem__(self, name: str) -> Estimate:
        return self.estimates[name]

    @property
    def too_noisy(self) -> bool:
        """True when the comparison holds an A/A control (:data:`AA`) whose interval excludes 1.0."""
        aa = self.estimates.get(AA)
        return aa is not None and aa.verdict != SAME


def verdict(ci_low: float, ci_high: float) -> str:
    """faster | slower | no detectable difference, from the interval of a latency ratio."""
    if ci_high < 1.0:
        return FASTER
    if ci_low > 1.0:
        return SLOWER
    return SAME


def ratio_interval(reference: Sequence[Sequence[float]], other: Sequence[Sequence[float]], *,
                   confidence: float = 0.95) -> tuple[float, float, float, float]:
    """(ratio, low, high, smallest detectable effect) of ``other``'s latency over ``reference``'s, both given as
    one list of timed runs per session, run ``k`` of session ``s`` of both from the same round (see the module
    docstring: paired by round, Student's t over the sessions)."""
    from scipy.stats import t, trim_mean

    if len(reference) != len(other) or len(reference) < 2 or any(
            len(r) == 0 or len(r) != len(o) for r, o in zip(reference, other)):
        raise RLFlowError("ratio_interval: need the same number (>= 2) of sessions for both graphs, each with the "
                          "same number (>= 1) of rounds")
    per_session = np.array([trim_mean(np.log(np.asarray(o, np.float64) / np.asarray(r, np.float64)), TRIM)
                            for r, o in zip(reference, other)])
    mean = float(per_session.mean())
    se = float(per_session.std(ddof=1) / math.sqrt(len(per_session)))
    q = float(t.ppf(0.5 + confidence / 2, len(per_session) - 1))
    detectable = math.expm1((q + float(t.ppf(POWER, len(per_session) - 1))) * se)
    return math.exp(mean), math.exp(mean - q * se), math.exp(mean + q * se), detectable


def _collect() -> None:
    """A garbage collection, then everything still alive is frozen (``gc.freeze``) until :func:`compare` ends:
    the next session's collection walks only what was made since, not again the million objects of a process
    holding torch and TensorFlow (0.5-1.3 s each time). Runners are built after the freeze, so they are
    collected as before."""
    gc.collect()
    gc.freeze()


def compare(graphs: Sequence[tuple[str, Any]], feeds: dict, protocol: Protocol, make_runner: Callable[[Any], Runner],
            *, clock: Callable[[], float] = time.perf_counter, log: Callable[[str], None] | None = None
            ) -> Comparison:
    """Time ``graphs`` (``(name, graph)``, the first the reference) under ``protocol`` and estimate each one's
    latency ratio to the reference (see the module docstring). ``make_runner(graph)`` builds a fresh runner (a
    callable on ``feeds``); it is called ``protocol.sessions`` times per graph. ``clock`` gives seconds."""
    names = [n for n, _ in graphs]
    if len(graphs) < 2 or len(set(names)) != len(names):
        raise RLFlowError(f"compare: need a reference and at least one other graph, names unique (got {names})")
    p = protocol
    rng = np.random.default_rng(p.seed)
    build_rng = np.random.default_rng((p.seed, 1))  # its own stream: the rounds' orders do not depend on it
    times: list[list[list[float]]] = [[] for _ in graphs]
    rounds: list[int] = []
    start, timing = clock(), 0.0
    try:
        for s in range(p.sessions):
            runners: list[Runner | None] = [None] * len(graphs)
            for i in build_rng.permutation(len(graphs)):  # built in random order: no graph always gets the
                runners[i] = make_runner(graphs[i][1])     # first (or last) memory of each block
            block = clock()
            for _ in range(p.warmup):
                for i in rng.permutation(len(runners)):
                    runners[i](feeds)
            for t in times:
                t.append([])
            deadline = p.budget_s * (s + 1) / p.sessions  # in seconds of timing
            k, order = 0, None
            while k < p.min_rounds or (k < p.max_rounds and timing + clock() - block < deadline):
                order = rng.permutation(len(runners)) if k % 2 == 0 else order[::-1]  # mirrored pairs
                for i in order:
                    t0 = clock()
                    runners[i](feeds)
                    times[i][s].append((clock() - t0) * 1e3)
                k += 1
            timing += clock() - block
            rounds.append(k)
            runners = None
            _collect()  # the block's sessions go before the next block's are built
            if log is not None:
                log(f"session {s + 1}/{p.sessions}: {k} rounds")
    finally:
        gc.unfreeze()  # what the sessions' collections froze goes back to the collector
    estimates = {names[0]: Estimate(names[0], times[0], ratio=1.0)}
    for j, name in enumerate(names[1:], 1):
        r, lo, hi, det = ratio_interval(times[0], times[j], confidence=p.confidence)
        estimates[name] = Estimate(name, times[j], r, lo, hi, verdict(lo, hi), det)
    return Comparison(names[0], estimates, rounds, clock() - start, timing, p)


def aa_copy(graph):
    """The A/A control: ``graph`` exported to ONNX and imported again through the IR (what every method's graph
    goes through), timed as a graph of its own."""
    import tempfile
    from pathlib import Path

    from rlflow.graph.onnx_io import load_onnx, save_onnx

    with tempfile.TemporaryDirectory(prefix="rlflow-aa-") as tmp:
        path = Path(tmp) / "aa.onnx"
        save_onnx(graph, path, check=False)
        return load_onnx(path)


def backend_runner(backend: str, device: str):
    """``make_runner`` for :func:`compare` on a real backend: a fresh runner of ``graph`` each call, each graph
    exported once (:class:`rlflow.graph.exec.FreshRunners`; close it, or use it in a ``with`` block, when done)."""
    from rlflow.graph.exec import FreshRunners

    return FreshRunners(backend, device)


def _close(make_runner) -> None:
    close = getattr(make_runner, "close", None)
    if close is not None:
        close()


def speed_check(original, optimised, backend: str, device: str, feeds: dict, protocol: Protocol,
                make_runner: Callable[[Any], Runner] | None = None, *,
                clock: Callable[[], float] = time.perf_counter) -> dict:
    """``rlflow optimize``'s and the pipeline's "never slower" check: ``optimised`` against ``original`` on
    ``backend``, under ``protocol``. Returns the trace record: ``{"backend", "device" (where its runners ran),
    "device_note" (why that is not ``device``, or empty), "ratio", "ci_low", "ci_high", "verdict", "detectable",
    "kept": "optimised" | "original", "line"}``; the optimised graph is kept only when the verdict is ``faster``."""
    own = make_runner is None
    make_runner = make_runner or backend_runner(backend, device)
    ran = []  # (where, why) of the runners built: the executors' record (ran_on, device_note)

    def built(graph):
        runner = make_runner(graph)
        ran.append((getattr(runner, "ran_on", device), getattr(runner, "device_note", "")))
        return runner

    try:
        est = compare([("original", original), ("optimised", optimised)], feeds, protocol, built,
                      clock=clock)["optimised"]
    finally:
        if own:
            _close(make_runner)
    ran_on, note = ran[0] if ran else (device, "")
    where = backend if ran_on == device else f"{backend} (on {ran_on}: {note or 'the backend chose so'})"
    kept = "optimised" if est.verdict == FASTER else "original"
    if kept == "optimised":
        line = f"speed check: faster, ratio {est.interval()} on {where}"
    else:
        why = "slower" if est.verdict == SLOWER else "no significant speedup"
        line = f"kept the original: {why}, ratio {est.interval()} on {where}"
    return {"backend": backend, "device": ran_on, "device_note": note, "ratio": est.ratio, "ci_low": est.ci_low,
            "ci_high": est.ci_high, "verdict": est.verdict, "detectable": est.detectable,
            "sessions": protocol.sessions, "runs": est.runs, "budget_s": protocol.budget_s, "kept": kept,
            "line": line}


def never_slower(protocol: Protocol, backend: str, device: str, seed: int = 0,
                 make_runner: Callable[[Any], Runner] | None = None, *,
                 clock: Callable[[], float] = time.perf_counter) -> Callable[[Any, Any], dict]:
    """The never-slower check as ``check(original, optimised) -> record`` (what
    :func:`rlflow.search.output.verify_and_write` takes): :func:`speed_check` on the original's seeded inputs; a
    graph equal to the original (no rewrite changed it), or one whose ONNX export is the original's (its rewrites
    only fused ops that export back as they were, e.g. Conv+ReLU), is kept as the original without timing:
    timing a graph against itself could only produce a false verdict."""

    def check(original, optimised) -> dict:
        same = original.structural_hash() == optimised.structural_hash()
        if same or aa_copy(original).structural_hash() == aa_copy(optimised).structural_hash():
            why = "the rewrites left the graph unchanged" if same else "its ONNX export is the original's"
            return {"backend": backend, "ratio": None, "ci_low": None, "ci_high": None, "verdict": None,
                    "detectable": None, "kept": "original", "line": f"kept the original: {why} (not timed)"}
        from rlflow.graph.exec import make_inputs

        return speed_check(original, optimised, backend, device, make_inputs(original, seed), protocol, make_runner,
                           clock=clock)

    return check


def latency_meter(protocol: Protocol, backend: str, device: str, seed: int = 0,
                  make_runner: Callable[[Any], Runner] | None = None, *,
                  clock: Callable[[], float] = time.perf_counter) -> Callable[[Any, Any], dict]:
    """The ``e2e`` reward's measurement as ``meter(first, graph) -> {"ratio", "ci_low", "ci_high", "verdict",
    "first_ms"}``: ``graph``'s latency over the episode's first graph's under ``protocol`` (a graph equal to the
    first is not timed: ratio 1, no detectable difference)."""
    def meter(first, graph) -> dict:
        if first.structural_hash() == graph.structural_hash():
            return {"ratio": 1.0, "ci_low": 1.0, "ci_high": 1.0, "verdict": SAME, "first_ms": None}
        from rlflow.graph.exec import make_inputs

        fresh = make_runner or backend_runner(backend, device)  # a graph's file only lives through its comparison
        try:
            c = compare([("first", first), ("graph", graph)], make_inputs(first, seed), protocol, fresh, clock=clock)
        finally:
            if make_runner is None:
                _close(fresh)
        e = c["graph"]
        return {"ratio": e.ratio, "ci_low": e.ci_low, "ci_high": e.ci_high, "verdict": e.verdict,
                "first_ms": c["first"].latency_ms}

    return meter
