"""The matcher/applier's guarantees, each on a small graph built to hit it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.graph import GraphBuilder
from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff
from rlflow.graph.fold import fold_constants
from rlflow.rewrite import rule_from_json
from rlflow.rewrite.matcher import MatchIndex, apply, find_matches

V = {"method": "test", "trials": 0}


def node(op, ins, attrs=None, **kw):
    return {"op": op, "inputs": ins, "attrs": attrs or {}, **kw}


def merge_matmul(const=True):
    last = {"sum": [{"rank": "x"}, -1]}
    return rule_from_json({
        "id": "merge-mm", "name": "merge two MatMuls sharing an input", "origin": "builtin",
        "src": [node("MatMul", ["x", "w0"]), node("MatMul", ["x", "w1"])],
        "dst": [node("Concat", ["w0", "w1"], {"axis": {"sum": [{"rank": "w0"}, -1]}}), node("MatMul", ["x", "%0"]),
                node("Split", ["%1"], {"axis": last, "split": [{"dim": ["w0", 1]}, {"dim": ["w1", 1]}]}, outputs=2)],
        "outputs": [["%0", "%2.0"], ["%1", "%2.1"]], "constraints": {"const": ["w0", "w1"]} if const else {},
        "verified": V})


CONV_RELU = rule_from_json({
    "id": "conv-relu", "name": "fuse Conv + Relu", "origin": "builtin",
    "src": [node("Conv", ["x", "w"], {"strides": "$s", "pads": "$p", "group": "$g", "activation": "none"}),
            node("Relu", ["%0"])],
    "dst": [node("Conv", ["x", "w"], {"strides": "$s", "pads": "$p", "group": "$g", "activation": "relu"})],
    "outputs": [["%1", "%0"]], "verified": V})

SPLIT_CONCAT = rule_from_json({
    "id": "split-concat", "name": "Split of a Concat -> its inputs", "origin": "generated",
    "src": [node("Concat", ["x", "y"], {"axis": 1}),
            node("Split", ["%0"], {"axis": 1, "split": [{"dim": ["x", 1]}, {"dim": ["y", 1]}]}, outputs=2)],
    "dst": [], "outputs": [["%1.0", "x"], ["%1.1", "y"]], "verified": V})


def rand(*shape, seed=0):
    return np.random.default_rng(seed + len(shape)).standard_normal(shape).astype(np.float32)


def three_projections():
    b = GraphBuilder("qkv")
    x = b.input("x", (1, 4, 8))
    outs = [b.op("MatMul", [x, b.const(f"w{k}", rand(8, 3 + k, seed=k))], name=f"mm{k}") for k in range(3)]
    return b.build(outs)


def outputs_equal(g, h):
    feeds = make_inputs(g, seed=5)
    return max_rel_diff(get_runner(g, "torch")(feeds), get_runner(h, "torch")(feeds)) <= 1e-5


def test_matches_are_deterministic_and_apply_leaves_the_input_alone():
    g = three_projections()
    rule = merge_matmul()
    ms = find_matches(g, rule)
    assert [m.nodes for m in ms] == [("mm0", "mm1"), ("mm1", "mm0"), ("mm0", "mm2"), ("mm2", "mm0"),
                                     ("mm1", "mm2"), ("mm2", "mm1")]
    assert [m.nodes for m in find_matches(g.copy(), rule)] == [m.nodes for m in ms]
    before = g.structural_hash()
    h = apply(g, ms[0])
    h.validate()
    assert g.structural_hash() == before and len(g.nodes) == 3
    assert h.op_counts() == {"Concat": 1, "MatMul": 2, "Split": 1}
    assert outputs_equal(g, h)


def test_weights_computed_from_constants_count_as_constant():
    """After merging two projections the concatenated weight is static, so the third merges too."""
    g = three_projections()
    idx = MatchIndex(g, [merge_matmul()])
    idx = idx.apply(0, 0)
    assert idx.counts() == [2]
    idx = idx.apply(0, 0)
    assert idx.graph.op_counts()["MatMul"] == 1
    folded = fold_constants(idx.graph)
    assert folded.op_counts() == {"MatMul": 1, "Split": 2}
    assert outputs_equal(g, folded)


def test_const_constraint_rejects_activations():
    b = GraphBuilder()
    x, y, z = b.input("x", (2, 4)), b.input("y", (4, 3)), b.input("z", (4, 3))
    g = b.build([b.op("MatMul", [x, y]), b.op("MatMul", [x, z])])
    assert find_matches(g, merge_matmul(const=True)) == []
    assert len(find_matches(g, merge_matmul(const=False))) == 2


def test_no_match_that_would_create_a_cycle():
    """w1 is computed from the first MatMul's output: merging both MatMuls would feed the result into itself."""
    b = GraphBuilder()
    x = b.input("x", (4, 4))
    a = b.op("MatMul", [x, b.const("w0", rand(4, 4))], name="a")
    w1 = b.op("Relu", [a], name="w1")
    c = b.op("MatMul", [x, w1], name="c")
    g = b.build([c])
    assert find_matches(g, merge_matmul(const=False)) == []


def test_unmapped_value_read_outside_blocks_the_match():
    b = GraphBuilder()
    x = b.input("x", (1, 3, 6, 6))
    conv = b.op("Conv", [x, b.const("w", rand(4, 3, 3, 3))], strides=(2, 2), pads=(1, 1, 1, 1), group=1,
                activation="none", name="conv")
    relu = b.op("Relu", [conv])
    fused = b.build([relu])
    assert len(find_matches(fused, CONV_RELU)) == 1  # parameters bind any stride/padding
    shared = b.build([relu, conv])  # the conv's own output is also a graph output: fusing would lose it
    assert find_matches(shared, CONV_RELU) == []


def test_parameters_must_agree():
    rule = rule_from_json({
        "id": "merge-conv", "name": "merge convs with equal parameters", "origin": "builtin",
        "src": [node("Conv", ["x", "w0"], {"strides": "$s", "pads": "$p", "group": 1, "activation": "none"}),
                node("Conv", ["x", "w1"], {"strides": "$s", "pads": "$p", "group": 1, "activation": "none"})],
        "dst": [node("Concat", ["w0", "w1"], {"axis": 0}),
                node("Conv", ["x", "%0"], {"strides": "$s", "pads": "$p", "group": 1, "activation": "none"}),
                node("Split", ["%1"], {"axis": 1, "split": [{"dim": ["w0", 0]}, {"dim": ["w1", 0]}]}, outputs=2)],
        "outputs": [["%0", "%2.0"], ["%1", "%2.1"]], "constraints": {"const": ["w0", "w1"]}, "verified": V})
    b = GraphBuilder()
    x = b.input("x", (1, 3, 8, 8))
    kw = dict(pads=(1, 1, 1, 1), group=1, activation="none")
    c1 = b.op("Conv", [x, b.const("a", rand(4, 3, 3, 3))], strides=(1, 1), **kw)
    c2 = b.op("Conv", [x, b.const("b", rand(5, 3, 3, 3, seed=1))], strides=(2, 2), **kw)
    c3 = b.op("Conv", [x, b.const("c", rand(6, 3, 3, 3, seed=2))], strides=(1, 1), **kw)
    g = b.build([c1, c2, c3])
    ms = find_matches(g, rule)
    assert sorted(m.nodes for m in ms) == sorted([(c1, c3), (c3, c1)])
    assert outputs_equal(g, apply(g, ms[0]))


def test_target_may_be_a_variable_even_for_graph_outputs():
    b = GraphBuilder()
    x, y = b.input("x", (2, 3, 4, 4)), b.input("y", (2, 5, 4, 4))
    cat = b.op("Concat", [x, y], axis=1)
    p, q = b.op("Split", [cat], n_outputs=2, axis=1, split=(3, 5))
    g = b.build([b.op("Relu", [p]), q])
    ms = find_matches(g, SPLIT_CONCAT)
    assert len(ms) == 1
    h = apply(g, ms[0])
    h.validate()
    assert h.outputs == g.outputs  # the output keeps its name, computed by an Identity of y
    assert h.op_counts() == {"Identity": 1, "Relu": 1}
    assert outputs_equal(g, h)


def test_split_sizes_must_fit_the_pattern():
    b = GraphBuilder()
    x, y = b.input("x", (2, 3)), b.input("y", (2, 5))
    cat = b.op("Concat", [x, y], axis=1)
    g = b.build(b.op("Split", [cat], n_outputs=2, axis=1, split=(4, 4)))
    assert find_matches(g, SPLIT_CONCAT) == []  # splitting elsewhere is not the inverse of the concat


@pytest.mark.parametrize("k", [0, 3, 5])
def test_incremental_index_equals_matching_from_scratch(k):
    g = three_projections()
    rules = [merge_matmul(), SPLIT_CONCAT]
    idx = MatchIndex(g, rules).apply(0, k)
    scratch = MatchIndex(idx.graph, rules)
    assert [[m.nodes for m in ms] for ms in idx.matches] == [[m.nodes for m in ms] for ms in scratch.matches]


def test_average_pooling_as_a_depthwise_conv_with_a_made_kernel():
    rule = rule_from_json({
        "id": "avgpool-conv", "name": "3x3 average pooling as a conv with the pooling kernel", "origin": "builtin",
        "src": [node("AveragePool", ["x"], {"kernel": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1],
                                            "ceil_mode": 0, "count_include_pad": 1})],
        "dst": [node("Constant", [], {"value": 1 / 9, "shape": [{"dim": ["x", 1]}, 1, 3, 3]}),
                node("Conv", ["x", "%0"], {"strides": [1, 1], "pads": [1, 1, 1, 1], "group": {"dim": ["x", 1]},
                                           "activation": "none"})],
        "outputs": [["%0", "%1"]], "verified": V})
    b = GraphBuilder()
    x = b.input("x", (2, 5, 7, 7))
    g = b.build([b.op("AveragePool", [x], kernel=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1), ceil_mode=0,
                      count_include_pad=1)])
    (m,) = find_matches(g, rule)
    h = apply(g, m)
    assert h.op_counts() == {"Conv": 1} and h.types[h.nodes[0].inputs[1]].shape == (5, 1, 3, 3)
    assert outputs_equal(g, h)


def test_target_attributes_may_refer_to_target_nodes_as_percent_k():
    """A target attribute expression may name an earlier target node as "%k" (output 0), like any reference."""
    rule = rule_from_json({
        "id": "relu-reshape", "name": "reshape via an earlier target value", "origin": "builtin",
        "src": [node("Relu", ["x"])],
        "dst": [node("Relu", ["x"]), node("Reshape", ["%0"], {"shape": [{"dim": ["%0", 0]}, {"dim": ["%0", 1]}]})],
        "outputs": [["%0", "%1"]], "verified": V})
    b = GraphBuilder()
    g = b.build([b.op("Relu", [b.input("x", (2, 3))])])
    h = apply(g, find_matches(g, rule)[0])
    assert h.op_counts() == {"Relu": 1, "Reshape": 1} and outputs_equal(g, h)


def test_incremental_index_sees_readers_rewired_to_a_variable():
    """split(concat(x, y)) -> x, y rewires the split's readers to x and y: their matches change too."""
    relu_rule = rule_from_json({"id": "relu-id", "name": "relu", "origin": "builtin", "src": [node("Relu", ["x"])],
                                "dst": [node("Relu", ["x"])], "outputs": [["%0", "%0"]], "verified": V})
    b = GraphBuilder()
    x, y = b.input("x", (2, 3, 4, 4)), b.input("y", (2, 5, 4, 4))
    p, q = b.op("Split", [b.op("Concat", [x, y], axis=1)], n_outputs=2, axis=1, split=(3, 5))
    g = b.build([b.op("Relu", [p]), b.op("Relu", [q])])
    idx = MatchIndex(g, [SPLIT_CONCAT, relu_rule]).apply(0, 0)
    scratch = MatchIndex(idx.graph, idx.rules)
    assert [[m.bindings for m in ms] for ms in idx.matches] == [[m.bindings for m in ms] for ms in scratch.matches]
    assert {dict(m.bindings)["x"] for m in idx.matches[1]} == {"x", "y"}


def test_pattern_reading_a_later_output_of_a_single_output_producer_is_no_match():
    """A pattern that reads output 1 of a two-output node (``%1.1``) must not match, nor fail, where the graph's
    producer of that value has a single output (a Split of a MatMul's product, not of another Split's)."""
    rule = rule_from_json({
        "id": "t-split-of-split", "name": "t", "origin": "builtin",
        "src": [{"op": "MatMul", "inputs": ["a", "w"], "attrs": {}},
                {"op": "Split", "inputs": ["%0"], "outputs": 2, "attrs": {"axis": 1, "split": "$sp"}},
                {"op": "Split", "inputs": ["%1.1"], "outputs": 2, "attrs": {"axis": 1, "split": "$sq"}},
                {"op": "Relu", "inputs": ["%2.1"], "attrs": {}}],
        "dst": [{"op": "MatMul", "inputs": ["a", "w"], "attrs": {}},
                {"op": "Split", "inputs": ["%0"], "outputs": 2, "attrs": {"axis": 1, "split": "$sp"}},
                {"op": "Split", "inputs": ["%1.1"], "outputs": 2, "attrs": {"axis": 1, "split": "$sq"}},
                {"op": "Relu", "inputs": ["%2.1"], "attrs": {}}],
        "outputs": [["%1.0", "%1.0"], ["%2.0", "%2.0"], ["%3", "%3"]],
        "verified": {"method": "pending", "trials": 0}}, "test")
    b = GraphBuilder("one-split")
    x = b.input("x", (2, 4))
    y = b.op("MatMul", [x, b.const("w", np.ones((4, 6), np.float32))])
    s0, s1 = b.op("Split", [y], n_outputs=2, axis=1, split=(2, 4))
    inner = b.op("Split", [s1], n_outputs=2, axis=1, split=(1, 3))
    g = b.build([s0, inner[0], b.op("Relu", [inner[1]])])
    assert len(find_matches(g, rule)) == 1          # the Split of a Split's second output
    b = GraphBuilder("flat")
    x = b.input("x", (2, 4))
    y = b.op("MatMul", [x, b.const("w", np.ones((4, 6), np.float32))])
    s0, s1 = b.op("Split", [y], n_outputs=2, axis=1, split=(2, 4))
    g = b.build([s0, b.op("Relu", [s1])])           # the Relu's Split reads the MatMul: one output only
    assert find_matches(g, rule) == []


UNBATCH_RELU = rule_from_json({
    "id": "unbatch-relu", "name": "split(relu(concat(a, b))) -> relu(a), relu(b)", "origin": "builtin",
    "src": [node("Concat", ["a", "b"], {"axis": 1}), node("Relu", ["%0"]),
            node("Split", ["%1"], {"axis": 1, "split": [{"dim": ["a", 1]}, {"dim": ["b", 1]}]}, outputs=2)],
    "dst": [node("Relu", ["a"]), node("Relu", ["b"])], "outputs": [["%2.0", "%0"], ["%2.1", "%1"]],
    "verified": V})


def test_incremental_index_sees_matches_a_removed_path_unblocks():
    """Unbatching split(relu(concat(p, b))) -> relu(p), relu(b) removes the path from p to the second output. The
    Relu pair (relu(a), a Relu after that output), ruled out as a cycle before, is a match after it, far from
    the rewrite: the incremental index finds it as matching from scratch does. (The pair's pattern is not
    connected: the index matches it again from scratch after such a rewrite.)"""
    batch = rule_from_json({
        "id": "batch-relu", "name": "relu(a), relu(b) -> split(relu(concat(a, b)))", "origin": "builtin",
        "src": [node("Relu", ["a"]), node("Relu", ["b"])],
        "dst": [node("Concat", ["a", "b"], {"axis": 1}), node("Relu", ["%0"]),
                node("Split", ["%1"], {"axis": 1, "split": [{"dim": ["a", 1]}, {"dim": ["b", 1]}]}, outputs=2)],
        "outputs": [["%0", "%2.0"], ["%1", "%2.1"]], "verified": V})
    b = GraphBuilder()
    x, y = b.input("x", (2, 3, 4)), b.input("y", (2, 5, 4))
    p = b.op("Relu", [b.op("Tanh", [x])], name="p")
    s0, s1 = b.op("Split", [b.op("Relu", [b.op("Concat", [b.op("Tanh", [p]), y], axis=1)])], n_outputs=2, axis=1,
                  split=(3, 5))
    g = b.build([b.op("Tanh", [s0]), b.op("Relu", [b.op("Tanh", [s1])], name="q")])
    before = MatchIndex(g, [UNBATCH_RELU, batch])
    assert not any({"p", "q"} <= set(m.nodes) for m in before.matches[1])  # q reads p through the concat
    idx = before.apply(0, 0)
    scratch = MatchIndex(idx.graph, idx.rules)
    assert idx.keys() == scratch.keys()
    assert any({"p", "q"} <= set(m.nodes) for m in idx.matches[1])
    assert outputs_equal(g, idx.graph)


def test_a_match_blocked_as_a_cycle_is_kept_and_freed_when_a_rewrite_removes_the_path():
    """Two MatMuls reading x (a connected pattern), the second's weight computed from the first's output through
    a concat: merging them would be a cycle, so the index keeps the pair blocked. Unbatching the concat removes
    that path: the pair becomes a match, and the index frees it without matching the rule again from scratch."""
    b = GraphBuilder()
    x, y = b.input("x", (4, 4)), b.input("y", (4, 3))
    p = b.op("MatMul", [x, b.const("w", np.ones((4, 4), np.float32))], name="p")
    s0, s1 = b.op("Split", [b.op("Relu", [b.op("Concat", [b.op("Tanh", [p]), y], axis=1)])], n_outputs=2, axis=1,
                  split=(4, 3))
    g = b.build([b.op("Tanh", [s0]), b.op("MatMul", [x, s1], name="q")])
    rules = [UNBATCH_RELU, merge_matmul(const=False)]
    before = MatchIndex(g, rules)
    assert before.matches[1] == [] and sorted(m.nodes for m in before.blocked[1]) == [("p", "q"), ("q", "p")]
    idx = before.apply(0, 0)
    assert sorted(m.nodes for m in idx.matches[1]) == [("p", "q"), ("q", "p")] and idx.blocked[1] == []
    assert idx.keys() == MatchIndex(idx.graph, rules).keys()
    assert outputs_equal(g, idx.graph)
    merged = idx.apply(1, 0)
    assert outputs_equal(g, merged.graph)


# ============================================================================================ commutative ops
ADD_RELU = rule_from_json({
    "id": "add-relu", "name": "x + relu(y) -> relu(y) + x", "origin": "builtin",
    "src": [node("Relu", ["y"]), node("Add", ["x", "%0"])],
    "dst": [node("Relu", ["y"]), node("Mul", ["%0", "x"])],  # not equal: only the bindings are looked at
    "outputs": [["%1", "%1"]], "verified": V})

ADD_ANY = rule_from_json({
    "id": "add-any", "name": "x + y -> relu(x) + y", "origin": "builtin",
    "src": [node("Add", ["x", "y"])], "dst": [node("Relu", ["x"]), node("Add", ["%0", "y"])],
    "outputs": [["%0", "%1"]], "verified": V})


def add_graph(relu_first: bool, same: bool = False):
    b = GraphBuilder("add")
    a, c = b.input("a", (2, 3)), b.input("b", (2, 3))
    r = b.op("Relu", [c], name="r")
    return b.build([b.op("Add", [a, a] if same else [r, a] if relu_first else [a, r], name="s")])


@pytest.mark.parametrize("relu_first", [False, True])
def test_a_commutative_pattern_node_matches_either_operand_order(relu_first):
    """Add(x, relu(y)) matches Add(relu(b), a) as it matches Add(a, relu(b)): one match, the same bindings, so
    no rule that swaps operands has to fire first."""
    g = add_graph(relu_first)
    ms = find_matches(g, ADD_RELU)
    assert [(m.nodes, m.bindings) for m in ms] == [(("r", "s"), (("x", "a"), ("y", "b")))]
    h = apply(g, ms[0])
    h.validate()
    assert h.op_counts() == {"Relu": 1, "Mul": 1}
    assert MatchIndex(g, [ADD_RELU]).matches == [ms]


def test_commutative_matches_are_listed_once_and_in_one_order():
    """Add(a, b) binds Add(x, y) both ways (two matches, two rewrites); Add(a, a) binds it once. The order is
    the same on every run and in the incremental index."""
    b = GraphBuilder("two")
    x, y = b.input("a", (2, 3)), b.input("b", (2, 3))
    two = b.build([b.op("Add", [x, y], name="s")])
    ms = find_matches(two, ADD_ANY)
    assert [m.bindings for m in ms] == [(("x", "a"), ("y", "b")), (("x", "b"), ("y", "a"))]
    assert [m.bindings for m in find_matches(two, ADD_ANY)] == [m.bindings for m in ms]
    assert len({apply(two, m).structural_hash() for m in ms}) == 2  # relu(a) + b and relu(b) + a
    same = add_graph(False, same=True)
    assert [m.bindings for m in find_matches(same, ADD_ANY)] == [(("x", "a"), ("y", "a"))]
    # the incremental index after a rewrite finds what matching from scratch finds
    g = add_graph(True)
    idx = MatchIndex(g, [ADD_RELU, ADD_ANY])
    after = idx.apply(1, 0)
    scratch = MatchIndex(after.graph, [ADD_RELU, ADD_ANY])
    assert after.keys() == scratch.keys()
    assert after.matches[0] and after.matches[1]


# ============================================================================================ attribute equality
_ATOMS = st.one_of(st.integers(-3, 3), st.booleans(), st.sampled_from(["a", "b"]),
                   st.floats(-2, 2, allow_nan=False), st.just(1.0 + 1e-9), st.just(1.0))
_ATTRS = st.recursive(_ATOMS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.lists(inner, max_size=3).map(tuple)), max_leaves=6)


@settings(max_examples=400, deadline=None)
@given(a=_ATTRS, b=_ATTRS)
def test_attribute_equality_is_equality_of_canonical_forms(a, b):
    """The matcher's fast paths (same-type ints, strings, bools, equal tuples) answer as the canonical form does
    (floats at float32 precision, lists as tuples, 1 == 1.0)."""
    from rlflow.graph.ir import _canonical
    from rlflow.rewrite.rule import _tuplify, attr_equal

    assert attr_equal(a, b) == (_canonical(_tuplify(a)) == _canonical(_tuplify(b)))
    assert attr_equal(a, a)
