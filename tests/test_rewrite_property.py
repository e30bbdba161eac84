"""Property: any sequence of (rule, location) choices applied to any zoo model keeps the model's outputs
(onnxruntime, after folding weight-only subgraphs), and the incremental match index always equals matching from
scratch (its matches, and the ones it keeps blocked as cycles). A rule that ever breaks this is a bug to fix, not
to skip. (benchmarks/random_rewrites.py runs the same check at scale.)"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.graph import load_onnx, zoo
from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff
from rlflow.graph.fold import fold_constants
from rlflow.rewrite import load_rules
from rlflow.rewrite.matcher import MatchIndex


@pytest.fixture(scope="module")
def setups(tiny_zoo, rules_file):
    rules = load_rules(rules_file)
    out = {}
    for name, path in tiny_zoo.items():
        g = load_onnx(path)
        feeds = make_inputs(g, seed=1)
        out[name] = (MatchIndex(g, rules), feeds, get_runner(g, "ort")(feeds))
    return out


def test_every_zoo_model_offers_matches(setups):
    for name, (idx, _, _) in setups.items():
        assert sum(idx.counts()) > 0, name


def test_start_filter_keeps_every_node_of_every_match(setups):
    """The incremental index searches only from (rule, position) pairs a region node passes without bindings
    (op, arity, literal attributes, ranks, its neighbours' ops): every node of every match found from scratch
    passes it at its own position, on every zoo model and after a few rewrites (so no match is ever missed), and
    it turns most pairs away (the point of it)."""
    from rlflow.rewrite.matcher import _View

    offered = kept = 0
    for name, (idx, _, _) in setups.items():
        for step in range(4):
            view, rs = _View(idx.graph), idx._rules
            for k, ms in enumerate(idx.matches):
                for m in ms:
                    for pos, node in enumerate(m.nodes):
                        assert (k, pos) in rs.starts_for(view.by_name[node], view), (name, idx.rules[k].id, pos)
            for n in idx.graph.nodes:
                offered += len(rs.by_op.get(n.op, ()))
                kept += len(rs.starts_for(n, view))
            k = next((k for k, c in enumerate(idx.counts()) if c), None)
            if k is None:
                break
            idx = idx.apply(k, (step * 7) % idx.counts()[k])
    assert 0 < kept < offered / 4, (kept, offered)


@settings(max_examples=int(os.environ.get("RLFLOW_HYPOTHESIS_EXAMPLES", 40)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data(), name=st.sampled_from(zoo.MODEL_NAMES))
def test_random_rewrite_sequences_keep_outputs(setups, data, name):
    idx, feeds, ref = setups[name]
    trail = []
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        choices = [k for k, c in enumerate(idx.counts()) if c]
        if not choices:
            break
        k = data.draw(st.sampled_from(choices), label="rule")
        j = data.draw(st.integers(0, idx.counts()[k] - 1), label="location")
        trail.append(idx.rules[k].id)
        idx = idx.apply(k, j)
    scratch = MatchIndex(idx.graph, idx.rules)
    assert idx.keys() == scratch.keys(), trail  # the matches, and those blocked as cycles
    g = fold_constants(idx.graph)
    g.validate()
    assert max_rel_diff(ref, get_runner(g, "ort")(feeds)) <= 1e-4, trail
