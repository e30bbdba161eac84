"""The measurement protocol (rlflow.evaluation.protocol) with fake runners on a fake clock: latencies are
known, so the intervals, verdicts and the budget can be checked exactly."""

from __future__ import annotations

import re

import numpy as np
import pytest

from rlflow.errors import RLFlowError
from rlflow.evaluation.protocol import (AA, FASTER, SAME, SLOWER, Protocol, compare, ratio_interval, speed_check,
                                        verdict)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class FakeGraph:
    """A 'graph' whose runs take ``ms`` milliseconds, times a per-session factor, times per-run noise."""

    def __init__(self, ms, session_sd=0.0, run_sd=0.0):
        self.ms, self.session_sd, self.run_sd = ms, session_sd, run_sd


def fake_runners(clock, seed=0):
    """make_runner for compare(): each call is a fresh 'session' with its own random speed factor."""
    rng = np.random.default_rng(seed)
    built = []

    def make(g):
        factor = 1.0 + g.session_sd * rng.standard_normal()
        built.append(g)

        def run(feeds):
            clock.now += g.ms * factor * (1.0 + g.run_sd * rng.standard_normal()) / 1e3

        return run

    make.built = built
    return make


def proto(**kw):
    return Protocol(**{"sessions": 4, "warmup": 1, "budget_s": 2.0, "min_rounds": 3, "max_rounds": 1000,
                       **kw})


def test_identical_graphs_get_an_interval_containing_one():
    clock = Clock()
    a, b = FakeGraph(10, 0.01, 0.02), FakeGraph(10, 0.01, 0.02)
    c = compare([("original", a), (AA, b)], {}, proto(), fake_runners(clock), clock=clock)
    e = c[AA]
    assert e.ci_low <= 1.0 <= e.ci_high
    assert e.verdict == SAME and not c.too_noisy
    assert e.ci_low < e.ratio < e.ci_high and 0 < e.detectable < 0.2


def test_deterministic_identical_graphs_give_exactly_one():
    clock = Clock()
    c = compare([("original", FakeGraph(5)), ("same", FakeGraph(5))], {}, proto(), fake_runners(clock), clock=clock)
    assert c["same"].ratio == c["same"].ci_low == c["same"].ci_high == 1.0
    assert c["same"].verdict == SAME


def test_a_clearly_slower_graph_is_called_slower_and_a_faster_one_faster():
    clock = Clock()
    graphs = [("original", FakeGraph(10, 0.01, 0.02)), ("slow", FakeGraph(12, 0.01, 0.02)),
              ("fast", FakeGraph(8, 0.01, 0.02))]
    c = compare(graphs, {}, proto(), fake_runners(clock), clock=clock)
    assert c["slow"].verdict == SLOWER and 1.0 < c["slow"].ci_low <= c["slow"].ratio <= c["slow"].ci_high
    assert c["slow"].ratio == pytest.approx(1.2, rel=0.05)
    assert c["fast"].verdict == FASTER and c["fast"].ci_high < 1.0
    assert c["original"].verdict == "reference" and c["original"].ratio == 1.0


def test_session_effects_widen_the_interval():
    """Large per-session effects and tiny per-run noise: resampling runs alone would give a narrow interval;
    the interval over sessions is much wider."""
    clock = Clock()
    g = [("original", FakeGraph(10, 0.05, 0.001)), ("other", FakeGraph(10, 0.05, 0.001))]
    c = compare(g, {}, proto(sessions=6), fake_runners(clock, seed=3), clock=clock)
    wide = c["other"].ci_high - c["other"].ci_low
    one = [c[n].times_ms[0] for n in ("original", "other")]  # one session per graph, its runs resampled
    flat = ratio_interval([one[0], one[0]], [one[1], one[1]])
    assert wide > 5 * (flat[2] - flat[1])
    assert c["other"].ci_low <= 1.0 <= c["other"].ci_high


def test_slow_spells_that_hit_a_whole_round_do_not_widen_the_interval():
    """The machine alternates between normal and 30% slower spells of a few rounds (the other core busy): both
    graphs of a round see the same spell, so the paired ratio stays exact to the per-run noise."""
    clock = Clock()
    rng = np.random.default_rng(5)
    calls = [0]

    def make(g):
        def run(feeds):
            calls[0] += 1
            slow = 1.3 if (calls[0] // 16) % 3 == 0 else 1.0  # spells of 8 rounds
            clock.now += g.ms * slow * (1.0 + 0.002 * rng.standard_normal()) / 1e3
        return run

    c = compare([("original", FakeGraph(10)), ("other", FakeGraph(10.5))], {}, proto(), make, clock=clock)
    e = c["other"]
    assert e.ratio == pytest.approx(1.05, abs=0.002) and e.verdict == SLOWER
    assert e.ci_high - e.ci_low < 0.01 and e.detectable < 0.01


def test_identical_graphs_with_session_effects_are_called_different_at_most_at_the_nominal_rate():
    """A/A comparisons with a 1% session effect and 2% run noise, 4 sessions: the 95% interval must exclude 1
    in about 5% of them (a percentile bootstrap over the 4 sessions excluded it in ~14%)."""
    rng = np.random.default_rng(11)
    wrong, n = 0, 400
    for _ in range(n):
        ref, oth = [], []
        for _s in range(4):
            spell = np.where(rng.random(25) < 0.2, 1.3, 1.0)  # shared by both graphs of a round
            ref.append(10 * (1 + 0.01 * rng.standard_normal()) * spell * (1 + 0.02 * rng.standard_normal(25)))
            oth.append(10 * (1 + 0.01 * rng.standard_normal()) * spell * (1 + 0.02 * rng.standard_normal(25)))
        _, lo, hi, _ = ratio_interval(ref, oth)
        wrong += not lo <= 1.0 <= hi
    assert 0.02 <= wrong / n <= 0.08, wrong / n


def test_unpaired_sessions_are_refused():
    with pytest.raises(RLFlowError, match="same number"):
        ratio_interval([[1.0, 1.0], [1.0, 1.0]], [[1.0], [1.0, 1.0]])


def test_the_budget_bounds_the_rounds():
    clock = Clock()
    make = fake_runners(clock)
    p = proto(budget_s=1.0, sessions=2, warmup=0, min_rounds=1)
    c = compare([("original", FakeGraph(10)), ("other", FakeGraph(10))], {}, p, make, clock=clock)
    # one round = 20 ms of (fake) time: 1 s buys 50 rounds in all (each block may overrun by one round)
    assert 50 <= sum(c.rounds) <= 52
    assert c.timing_s <= 1.0 + 2 * 0.02 and c.seconds == c.timing_s  # (building fake runners takes no time)
    assert len(make.built) == 2 * 2  # a fresh runner per graph and session
    clock2 = Clock()
    c2 = compare([("original", FakeGraph(10)), ("other", FakeGraph(10))], {}, proto(budget_s=2.0, sessions=2,
                 warmup=0, min_rounds=1), fake_runners(clock2), clock=clock2)
    assert 100 <= sum(c2.rounds) <= 102
    assert all(len(s) == k for s, k in zip(c2["other"].times_ms, c2.rounds))


def test_building_runners_is_not_counted_against_the_budget():
    clock = Clock()
    inner = fake_runners(clock)

    def slow_build(g):  # every build takes 2 s of the clock
        clock.now += 2.0
        return inner(g)

    p = proto(budget_s=1.0, sessions=2, warmup=0, min_rounds=1)
    c = compare([("original", FakeGraph(10)), ("other", FakeGraph(10))], {}, p, slow_build, clock=clock)
    assert 50 <= sum(c.rounds) <= 52 and c.seconds == pytest.approx(c.timing_s + 2 * 2 * 2.0)


def test_runners_are_built_in_a_random_order_per_block():
    """Built always first, the reference ran 0.16% slower than identical bytes on onnxruntime (aa_test --copy
    same): no graph may get the first build of every block."""
    clock = Clock()
    make = fake_runners(clock)
    graphs = [("original", FakeGraph(1)), ("b", FakeGraph(1)), ("c", FakeGraph(1))]
    compare(graphs, {}, proto(sessions=12, budget_s=0.1), make, clock=clock)
    blocks = [make.built[k:k + 3] for k in range(0, len(make.built), 3)]
    assert len(blocks) == 12 and all({id(g) for g in b} == {id(g) for _, g in graphs} for b in blocks)
    firsts = {id(b[0]) for b in blocks}
    assert len(firsts) == 3  # every graph was built first in some block



def test_rounds_come_in_mirrored_pairs():
    """The second round of each pair runs the graphs in the first one's order reversed, so in every block each
    graph runs before and after every other as often (a run's position changed BERT's ratio by 0.8%)."""
    clock, calls = Clock(), []

    def make(g):
        def run(feeds):
            calls.append(g)
            clock.now += 0.001
        return run

    graphs = [("original", "a"), ("b", "b"), ("c", "c")]
    c = compare(graphs, {}, proto(sessions=2, warmup=0, min_rounds=10, max_rounds=10), make, clock=clock)
    assert c.rounds == [10, 10]
    rounds = [calls[k:k + 3] for k in range(0, len(calls), 3)]
    assert len(rounds) == 20 and all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert all(rounds[k + 1] == rounds[k][::-1] for k in range(0, 20, 2))
    assert len({tuple(r) for r in rounds[::2]}) > 1  # the first of each pair is drawn at random


def test_a_position_effect_cancels_and_outlier_rounds_are_trimmed():
    """Whoever runs second in a round is 1% slower, one round in ten is 30% slower for one graph, and every run
    has 3% noise: identical graphs still get a ratio within 0.5% of one, and no verdict (mirrored pairs cancel the
    position, the trimmed mean drops the outliers; a plain mean would be off by more than 1%)."""
    clock, rng = Clock(), np.random.default_rng(3)
    state = {"calls": 0}

    def make(g):
        def run(feeds):
            second = state["calls"] % 2 == 1
            state["calls"] += 1
            outlier = g == "b" and rng.random() < 0.1
            noise = 1.0 + 0.03 * rng.standard_normal()
            clock.now += 0.1 * (1.01 if second else 1.0) * (1.3 if outlier else 1.0) * noise
        return run

    c = compare([("original", "a"), ("b", "b")], {}, proto(warmup=0, min_rounds=40, max_rounds=40), make,
                clock=clock)
    e = c["b"]
    assert e.ratio == pytest.approx(1.0, abs=0.005) and e.verdict == SAME
    ref, other = c["original"].times_ms, e.times_ms
    plain = np.mean([np.mean(np.log(np.asarray(o) / np.asarray(r))) for r, o in zip(ref, other)])
    assert plain > 0.01  # what an untrimmed mean would have called


def test_min_and_max_rounds_hold_whatever_the_budget():
    clock = Clock()
    c = compare([("original", FakeGraph(1000)), ("b", FakeGraph(1000))], {}, proto(budget_s=0.5, min_rounds=4),
                fake_runners(clock), clock=clock)
    assert c.rounds == [4, 4, 4, 4]
    clock = Clock()
    c = compare([("original", FakeGraph(0.01)), ("b", FakeGraph(0.01))], {}, proto(max_rounds=7),
                fake_runners(clock), clock=clock)
    assert c.rounds == [7, 7, 7, 7]


def test_a_failed_aa_control_marks_the_comparison_too_noisy():
    clock = Clock()
    c = compare([("original", FakeGraph(10, 0, 0.01)), (AA, FakeGraph(11, 0, 0.01))], {}, proto(),
                fake_runners(clock), clock=clock)
    assert c[AA].verdict == SLOWER and c.too_noisy


def test_verdicts_and_bad_settings():
    assert verdict(0.9, 0.99) == FASTER and verdict(1.01, 1.2) == SLOWER and verdict(0.99, 1.01) == SAME
    with pytest.raises(RLFlowError, match="sessions >= 2"):
        Protocol(sessions=1)
    with pytest.raises(RLFlowError, match="budget_s > 0"):
        Protocol(budget_s=0)
    with pytest.raises(RLFlowError, match="reference and at least one"):
        compare([("original", FakeGraph(1))], {}, proto(), fake_runners(Clock()))


def test_a_comparison_of_n_graphs_gets_n_halves_of_the_two_graph_budget():
    p = Protocol(budget_s=12.0)
    assert p.for_graphs(2) == p and p.for_graphs(9).budget_s == pytest.approx(54.0)
    assert p.for_graphs(9).sessions == p.sessions and p.for_graphs(9).seed == p.seed
    with pytest.raises(RLFlowError, match="at least two graphs"):
        p.for_graphs(1)


def test_from_config_reads_the_timing_section():
    p = Protocol.from_config({"seed": 7, "timing": {"sessions": 5, "budget_s": 3.5, "warmup": 2}})
    assert (p.sessions, p.budget_s, p.warmup, p.seed) == (5, 3.5, 2, 7)
    assert Protocol.from_config({"timing": {"budget_s": 3.5}}, budget_s=1.0).budget_s == 1.0


def test_speed_check_keeps_the_original_unless_significantly_faster():
    clock = Clock()
    make = fake_runners(clock)
    same = speed_check(FakeGraph(10, 0.01, 0.02), FakeGraph(10, 0.01, 0.02), "ort", "cpu", {}, proto(), make,
                       clock=clock)
    fast = speed_check(FakeGraph(10, 0.01, 0.02), FakeGraph(7, 0.01, 0.02), "ort", "cpu", {}, proto(), make,
                       clock=clock)
    assert same["kept"] == "original" and same["verdict"] == SAME
    assert same["line"].startswith("kept the original: no significant speedup, ratio ") and same["line"].endswith(
        " on ort")
    assert fast["kept"] == "optimised" and fast["verdict"] == FASTER and fast["ci_high"] < 1


# -------------------------------------------------------------------------- the never-slower check when writing
@pytest.fixture(scope="module")
def searched():
    """Tiny BERT and greedy's result over the builtin rules (a real rewrite: one constant folded)."""
    from rlflow.cost import make_cost_model
    from rlflow.env.graph_rewrite import DEFAULT_GRAPH
    from rlflow.graph.onnx_io import load_onnx
    from rlflow.rewrite.builtin import verified_builtin_rules
    from rlflow.search.output import run_method

    g = load_onnx(DEFAULT_GRAPH)
    result = run_method("greedy", g, verified_builtin_rules(), make_cost_model({}, "cpu", kind="analytic"), budget=20)
    assert result.graph.structural_hash() != g.structural_hash()
    return g, result


def _by_graph(clock, original, ms_original, ms_other):
    """make_runner: the original's runs take ms_original, any other graph's ms_other (fake clock)."""
    h = original.structural_hash()
    rng = np.random.default_rng(0)

    def make(g):
        ms = ms_original if g.structural_hash() == h else ms_other

        def run(feeds):
            clock.now += ms * (1 + 0.02 * rng.standard_normal()) / 1e3

        return run

    return make


@pytest.mark.parametrize("ms_other, kept", [(10.0, "original"), (10.5, "original"), (8.0, "optimised")])
def test_verify_and_write_keeps_the_original_unless_significantly_faster(searched, tmp_path, ms_other, kept):
    from rlflow.evaluation.protocol import never_slower
    from rlflow.graph.onnx_io import load_onnx
    from rlflow.search.output import verify_and_write

    original, result = searched
    clock = Clock()
    check = never_slower(proto(), "ort", "cpu", 0, _by_graph(clock, original, 10.0, ms_other), clock=clock)
    lines = []
    out, trace = tmp_path / "m.onnx", tmp_path / "t.json"
    _, doc = verify_and_write(original, result, out, trace, {"model": "tiny"}, speed_check=check, log=lines.append)
    import json

    rec = json.loads(trace.read_text())["speed_check"]
    assert rec == doc["speed_check"] and rec["kept"] == kept and rec["backend"] == "ort"
    written = load_onnx(out).structural_hash()
    want = original if kept == "original" else result.graph
    assert written == want.structural_hash()
    assert len(lines) == 1 and lines[0] == rec["line"]
    if kept == "original":
        # identical speeds: either reason keeps the original (the 95% interval excludes 1 in ~5% of A/A draws)
        why = "slower" if ms_other > 10 else "(slower|no significant speedup)"
        assert re.fullmatch(rf"kept the original: {why}, ratio .* on ort", lines[0]), lines[0]
    else:
        assert rec["ci_high"] < 1 and lines[0].startswith("speed check: faster, ratio 0.")


def test_an_unchanged_graph_is_kept_without_timing(searched):
    from rlflow.evaluation.protocol import never_slower

    original, _ = searched
    built = []
    rec = never_slower(proto(), "ort", "cpu", make_runner=built.append)(original, original.copy())
    assert rec["kept"] == "original" and built == [] and "unchanged" in rec["line"]


def test_a_graph_that_exports_as_the_original_is_kept_without_timing():
    """A Conv+ReLU fusion lives in the IR only: its ONNX export is Conv + Relu again, the original's file. Timing
    it against the original would time a graph against itself (a false "faster" 1 time in 20)."""
    from rlflow.evaluation.protocol import never_slower
    from rlflow.graph.builder import GraphBuilder
    from rlflow.rewrite.builtin import verified_builtin_rules
    from rlflow.rewrite.matcher import MatchIndex

    b = GraphBuilder("convrelu")
    x = b.input("x", (1, 3, 8, 8))
    y = b.op("Relu", [b.op("Conv", [x, b.const("w", np.ones((4, 3, 3, 3), np.float32))], pads=(1, 1, 1, 1),
                           strides=(1, 1), group=1, activation="none")])
    original = b.build([y])
    fuse = [r for r in verified_builtin_rules() if r.name == "conv-relu-fuse"]
    fused = MatchIndex(original, fuse).apply(0, 0).graph
    assert fused.structural_hash() != original.structural_hash() and len(fused.nodes) < len(original.nodes)
    built = []
    rec = never_slower(proto(), "ort", "cpu", make_runner=built.append)(original, fused)
    assert rec["kept"] == "original" and built == [] and "ONNX export is the original's" in rec["line"]


def test_fresh_runners_write_each_graph_once_and_remove_the_files(monkeypatch):
    """FreshRunners exports each graph to ONNX once, however many onnxruntime sessions the protocol builds from
    it, and its files are gone after close()."""
    import os

    import rlflow.graph.onnx_io as onnx_io
    from rlflow.graph.builder import GraphBuilder
    from rlflow.graph.exec import FreshRunners, make_inputs

    graphs = []
    for k in range(2):
        b = GraphBuilder(f"g{k}")
        x = b.input("x", (2, 4))
        graphs.append(b.build([b.op("Relu", [b.op("Add", [x, b.const("c", np.full((2, 4), k, np.float32))])])]))
    exported = []
    to_onnx = onnx_io.to_onnx
    monkeypatch.setattr(onnx_io, "to_onnx", lambda g: exported.append(g.name) or to_onnx(g))
    with FreshRunners("ort") as runners:
        outs = []
        for _ in range(3):
            for g in graphs:
                outs.append(runners(g)(make_inputs(g, seed=0)))
        folder = runners._dir.name
        assert sorted(exported) == ["g0", "g1"] and len(os.listdir(folder)) == 2
    assert not os.path.exists(folder)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(outs[0::2], outs[2::2]))
