"""The substitution families TASO has and the rule set once lacked, each found by the generator or written as a
builtin rule, verified numerically, applied to a small graph with equal outputs, and each with a broken variant
the verifier rejects:

1. conv distributivity, ``conv(x, w1 + w2) = conv(x, w1) + conv(x, w2)`` and ``conv(x1 + x2, w) = conv(x1, w) +
   conv(x2, w)`` (generated, with the ``no_broadcast`` constraint: they hold only where the Add does not
   broadcast, so without it the verifier dropped them);
2. two convs summed into one conv over concatenated inputs and kernels, with and without a fused ReLU
   (generated for stride-1 "same" convs; builtin ``b-conv[-bias]-sum-concat[-relu]`` for any conv);
3. concat and element-wise ops with four distinct operands (generated: four activations per rank);
4. sources of independent ops, ``relu(a), relu(b) -> split(relu(concat(a, b)))`` (generated: the generator
   records two independent instances of one op);
5. merging two convs into one grouped conv (builtin ``b-conv[-bias]-group-merge``).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.graph import GraphBuilder
from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff
from rlflow.rewrite import rule_from_json
from rlflow.rewrite.builtin import builtin_rules, compare, verified_builtin_rules
from rlflow.rewrite.generator import GeneratorConfig, generate, variable_class
from rlflow.rewrite.matcher import apply, find_matches
from rlflow.rewrite.prune import renaming_key
from rlflow.rewrite.verify import check_binding, verify

BUILTIN = {r.id: (r, ex) for r, ex in builtin_rules()}
HYP = settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
SAME = {"strides": [1, 1], "group": 1, "activation": "none"}


def n(op, inputs, outputs=1, **attrs):
    d = {"op": op, "inputs": list(inputs), "attrs": attrs}
    if outputs != 1:
        d["outputs"] = outputs
    return d


def conv(x, w, activation="none"):
    return n("Conv", [x, w], **{**SAME, "activation": activation, "pads": {"same_pads": w}})


def rule(src, dst, outputs, const=(), no_broadcast=False, rid="t"):
    raw = {"id": rid, "name": rid, "origin": "generated", "src": src, "dst": dst, "outputs": outputs,
           "verified": {"method": "pending", "trials": 0}}
    constraints = {**({"const": list(const)} if const else {}), **({"no_broadcast": True} if no_broadcast else {})}
    if constraints:
        raw["constraints"] = constraints
    return rule_from_json(raw, "test")


def find(rules, want):
    """The generated rule equal (up to renaming and the order of its mapped outputs) to ``want``, or None."""
    key = renaming_key(want, variable_class)
    for raw in rules:
        r = rule_from_json(raw, "generated")
        if renaming_key(r, variable_class) == key:
            return r
    return None


def rand(*shape, seed=0):
    return np.random.default_rng(seed + 7 * len(shape) + sum(shape)).standard_normal(shape).astype(np.float32)


def applies_once_and_agrees(g, r, expect_ops):
    """``r`` matches ``g``; applying its first match gives a valid graph with ``expect_ops`` and equal outputs."""
    ms = find_matches(g, r)
    assert ms, f"{r.id} does not match"
    h = apply(g, ms[0])
    h.validate()
    assert h.op_counts() == expect_ops
    feeds = make_inputs(g, seed=3)
    assert max_rel_diff(get_runner(g, "torch")(feeds), get_runner(h, "torch")(feeds)) <= 1e-5
    return h


# ============================================================================================ 1. distributivity
@pytest.fixture(scope="module")
def conv_add_run():
    return generate(GeneratorConfig(max_ops=3, ops=("Conv", "Add"), variables={"a": 2, "k": 2}), trials=3)


KERNEL_SUM = rule([conv("a0", "k0"), conv("a0", "k1"), n("Add", ["%0", "%1"])],
                  [n("Add", ["k0", "k1"]), conv("a0", "%0")], [["%2", "%1"]], const=["k0", "k1"])
INPUT_SUM = rule([conv("a0", "k0"), conv("a1", "k0"), n("Add", ["%0", "%1"])],
                 [n("Add", ["a0", "a1"]), conv("%0", "k0")], [["%2", "%1"]], const=["k0"])


def reverse(r):
    """``r`` the other way round (every rule here reads the same variables on both sides)."""
    return rule([x.to_json() for x in r.dst], [x.to_json() for x in r.src], [[d, s] for s, d in r.outputs],
                const=sorted(r.const_vars))


def test_conv_distributivity_is_generated_in_both_directions_with_no_broadcast(conv_add_run):
    got = conv_add_run.rules
    for want in (KERNEL_SUM, INPUT_SUM):
        for w in (want, reverse(want)):
            r = find(got, w)
            assert r is not None, w.to_json()
            assert r.no_broadcast, r.id
            assert r.verified["method"] == "random-float64" and r.verified["trials"] >= 3
    assert conv_add_run.stats["verified_no_broadcast"] == 4


@pytest.mark.parametrize("r", [KERNEL_SUM, INPUT_SUM], ids=["kernel-sum", "input-sum"])
def test_conv_distributivity_fails_where_the_add_broadcasts(r):
    """The cause of the gap: the generator's Add never broadcasts, the IR's does. A 1x3 kernel broadcast along
    a 3x3 kernel's rows (or an activation of height 1 along another's height) is not the smaller conv, so the
    rule without the constraint fails verification; with ``no_broadcast`` the matcher takes no such binding."""
    rng = np.random.default_rng(0)
    if r is KERNEL_SUM:
        bad = {"a0": (2, 4, 5, 5), "k0": (4, 4, 3, 3), "k1": (4, 4, 1, 3)}
    else:
        bad = {"a0": (2, 4, 1, 5), "a1": (2, 4, 5, 5), "k0": (4, 4, 3, 3)}
    assert check_binding(r, bad, {}, rng) > 1e-3
    assert verify(r, trials=3) is None
    narrowed = replace(r, constraints={**r.constraints, "no_broadcast": True})
    # the source's Add broadcasts (input sum: no match) or the target's would (kernel sum: rejected)
    assert check_binding(narrowed, bad, {}, rng) == ("rejected" if r is KERNEL_SUM else "no-match")
    assert verify(narrowed, trials=3) is not None


def conv_pair_graph(k2=(4, 3, 3, 3), shared_input=True):
    """conv(a, w1) + conv(a, w2) ("same" padding for each kernel), or conv(a, w1) + conv(a2, w1)."""
    b = GraphBuilder("conv-pair")
    a = b.input("a", (1, 3, 6, 6))
    w1 = b.const("w1", rand(4, 3, 3, 3))
    if shared_input:
        a2, w2 = a, b.const("w2", rand(*k2, seed=1))
    else:
        a2, w2 = b.input("a2", (1, 3, 6, 6)), w1
    same = lambda k: (k[2] // 2, k[3] // 2, k[2] // 2, k[3] // 2)  # noqa: E731
    y1 = b.op("Conv", [a, w1], strides=(1, 1), pads=same((4, 3, 3, 3)), group=1, activation="none")
    y2 = b.op("Conv", [a2, w2], strides=(1, 1), pads=same(k2 if shared_input else (4, 3, 3, 3)), group=1,
              activation="none")
    return b.build([b.op("Add", [y1, y2])])


def test_conv_distributivity_applies_to_a_small_graph(conv_add_run):
    kernel_sum = find(conv_add_run.rules, KERNEL_SUM)
    applies_once_and_agrees(conv_pair_graph(), kernel_sum, {"Add": 1, "Conv": 1})
    input_sum = find(conv_add_run.rules, INPUT_SUM)
    applies_once_and_agrees(conv_pair_graph(shared_input=False), input_sum, {"Add": 1, "Conv": 1})
    # and back: conv(a, w1 + w2) -> conv(a, w1) + conv(a, w2)
    h = applies_once_and_agrees(conv_pair_graph(), kernel_sum, {"Add": 1, "Conv": 1})
    applies_once_and_agrees(h, find(conv_add_run.rules, reverse(KERNEL_SUM)), {"Add": 1, "Conv": 2})


def test_no_broadcast_keeps_the_matcher_and_eqsat_from_a_wrong_rewrite(conv_add_run):
    """A 3x3 and a 1x3 conv on one input: the sum of their kernels would broadcast. Without the constraint the
    rule matches and the rewrite changes the outputs; with it (as generated) the matcher and eqsat refuse."""
    from rlflow.cost import AnalyticCost
    from rlflow.graph.exec.check import check_equal
    from rlflow.search.eqsat import eqsat_search

    g = conv_pair_graph(k2=(4, 3, 1, 3))
    generated = find(conv_add_run.rules, KERNEL_SUM)
    loose = replace(generated, id="loose", name="loose", constraints={"const": ["k0", "k1"]})
    ms = find_matches(g, loose)
    assert ms
    feeds = make_inputs(g, seed=3)
    assert max_rel_diff(get_runner(g, "torch")(feeds), get_runner(apply(g, ms[0]), "torch")(feeds)) > 1e-3
    assert find_matches(g, generated) == []
    res = eqsat_search(g, [generated], AnalyticCost("cpu"))
    assert res.stats["rules_fired"].get(generated.name, 0) == 0 and check_equal(g, res.graph) <= 1e-5
    assert eqsat_search(g, [loose], AnalyticCost("cpu")).stats["rules_fired"].get("loose", 0) >= 1


def test_no_broadcast_round_trips_and_is_validated():
    r = replace(KERNEL_SUM, constraints={"const": ["k0", "k1"], "no_broadcast": True})
    assert rule_from_json(r.to_json(), "x") == r and rule_from_json(r.to_json(), "x").no_broadcast
    raw = copy.deepcopy(r.to_json())
    raw["constraints"]["no_broadcast"] = "yes"
    with pytest.raises(Exception, match="no_broadcast must be true or false"):
        rule_from_json(raw, "x")


# ============================================================================================ 2. sum of two convs
def test_two_convs_summed_are_generated_as_one_conv_over_concatenations():
    res = generate(GeneratorConfig(max_ops=3, ops=("Conv", "Add", "Concat"), variables={"a": 2, "k": 2}), trials=3)
    want = rule([conv("a0", "k0"), conv("a1", "k1"), n("Add", ["%0", "%1"])],
                [n("Concat", ["a0", "a1"], axis=1), n("Concat", ["k0", "k1"], axis=1), conv("%0", "%1")],
                [["%2", "%2"]], const=["k0", "k1"])
    r = find(res.rules, want)
    assert r is not None and not r.no_broadcast
    applies_once_and_agrees(conv_pair_graph(shared_input=False), r, {"Concat": 2, "Conv": 1})


def two_input_conv_graph(relu=False, bias=False, c2=2, stride=(1, 1), pads=(1, 1, 1, 1), group=1, o2=4):
    b = GraphBuilder("two-convs")
    x1, x2 = b.input("x1", (2, 2 * group, 7, 6)), b.input("x2", (2, c2 * group, 7, 6))
    extra1 = [b.const("b1", rand(4, seed=5))] if bias else []
    extra2 = [b.const("b2", rand(o2, seed=6))] if bias else []
    y1 = b.op("Conv", [x1, b.const("w1", rand(4, 2, 3, 3, seed=2))] + extra1, strides=stride, pads=pads, group=group,
              activation="none")
    y2 = b.op("Conv", [x2, b.const("w2", rand(o2, c2, 3, 3, seed=3))] + extra2, strides=stride, pads=pads,
              group=group, activation="none")
    return b, y1, y2


@pytest.mark.parametrize("rid", ["b-conv-sum-concat", "b-conv-bias-sum-concat", "b-conv-sum-concat-relu",
                                 "b-conv-bias-sum-concat-relu"])
def test_conv_sum_builtin_applies_to_a_small_graph(rid):
    relu, bias = rid.endswith("-relu"), "-bias-" in rid
    b, y1, y2 = two_input_conv_graph(bias=bias, c2=3, stride=(2, 1), pads=(0, 1, 1, 0))
    s = b.op("Add", [y1, y2])
    g = b.build([b.op("Relu", [s]) if relu else s])
    applies_once_and_agrees(g, BUILTIN[rid][0], {"Concat": 2, "Conv": 1, **({"Add": 1} if bias else {})})


@pytest.mark.parametrize("rid", ["b-conv-sum-concat", "b-conv-sum-concat-relu"])
@HYP
@given(data=st.data())
def test_conv_sum_builtin_at_other_shapes(rid, data):
    """Any strides and pads and input channels agree; kernels of other sizes or output channels, or inputs of
    other sizes (where the source's Add would broadcast) are rejected, never wrong."""
    d = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
    kh, kw, o = d(1, 3), d(1, 3), d(1, 3)
    pads = [d(0, 1) for _ in range(4)]
    h, w = d(kh, 6), d(kw, 6)
    shapes = {"x1": [d(1, 2), d(1, 3), h, w], "w1": [o, 0, kh, kw]}
    shapes["w1"][1] = shapes["x1"][1]
    c2 = d(1, 3)
    shapes.update(x2=[shapes["x1"][0], c2, h, w], w2=[o, c2, kh, kw])
    params = {"s": [d(1, 2), d(1, 2)], "p": pads, "g": 1}
    r = BUILTIN[rid][0]
    assert compare(r, shapes, params) <= 1e-9
    var, axis = data.draw(st.sampled_from([("w2", 0), ("w2", 2), ("x2", 0), ("x2", 2)]))  # O, kh / N, H
    bad = {k: list(v) for k, v in shapes.items()}
    bad[var][axis] = 1 if bad[var][axis] > 1 else 2
    got = compare(r, bad, params)
    assert got in ("no-match", "rejected"), (bad, got)


# ============================================================================================ 3. four operands
@pytest.fixture(scope="module")
def four_operand_run():
    return generate(GeneratorConfig(max_ops=3, ops=("Add", "Mul", "Concat"), variables={"x": 4}), trials=3)


def concat_ew(op, axis):
    return rule([n("Concat", ["x0", "x1"], axis=axis), n("Concat", ["x2", "x3"], axis=axis), n(op, ["%0", "%1"])],
                [n(op, ["x0", "x2"]), n(op, ["x1", "x3"]), n("Concat", ["%0", "%1"], axis=axis)], [["%2", "%2"]])


RENEST = rule([n("Concat", ["x0", "x1"], axis=1), n("Concat", ["x2", "x3"], axis=1), n("Concat", ["%0", "%1"], axis=0)],
              [n("Concat", ["x0", "x2"], axis=0), n("Concat", ["x1", "x3"], axis=0), n("Concat", ["%0", "%1"], axis=1)],
              [["%2", "%2"]])


def test_four_distinct_operands_are_generated(four_operand_run):
    for op in ("Add", "Mul"):
        for axis in (0, 1):
            assert find(four_operand_run.rules, concat_ew(op, axis)) is not None, (op, axis)
    assert find(four_operand_run.rules, RENEST) is not None


def test_three_operands_per_rank_cannot_reach_them():
    """Why the default has four activations per rank: with three, only the forms with a shared operand exist."""
    res = generate(GeneratorConfig(max_ops=3, ops=("Add", "Concat"), variables={"x": 3}), trials=3)
    assert find(res.rules, concat_ew("Add", 0)) is None
    assert max(len(rule_from_json(r, "g").variables) for r in res.rules) <= 3


def test_four_operand_rules_apply_to_a_small_graph(four_operand_run):
    b = GraphBuilder("four")
    xs = [b.input(f"x{i}", (2, 3 + i % 2)) for i in range(4)]     # x0, x2: 2x3; x1, x3: 2x4
    c1 = b.op("Concat", [xs[0], xs[1]], axis=1)
    c2 = b.op("Concat", [xs[2], xs[3]], axis=1)
    g = b.build([b.op("Add", [c1, c2])])
    h = applies_once_and_agrees(g, find(four_operand_run.rules, concat_ew("Add", 1)), {"Add": 2, "Concat": 1})
    applies_once_and_agrees(h, find(four_operand_run.rules, reverse(concat_ew("Add", 1))), {"Add": 1, "Concat": 2})
    b = GraphBuilder("renest")
    xs = [b.input(f"x{i}", (1 + i // 2, 2 + i % 2)) for i in range(4)]   # a 2x2 block matrix of blocks
    g = b.build([b.op("Concat", [b.op("Concat", [xs[0], xs[1]], axis=1), b.op("Concat", [xs[2], xs[3]], axis=1)],
                      axis=0)])
    applies_once_and_agrees(g, find(four_operand_run.rules, RENEST), {"Concat": 3})


def test_four_operand_broken_variants_are_rejected():
    """Pairing the wrong halves (x0 + x3, x1 + x2) or nesting the blocks transposed fails verification."""
    wrong = rule([n("Concat", ["x0", "x1"], axis=0), n("Concat", ["x2", "x3"], axis=0), n("Add", ["%0", "%1"])],
                 [n("Add", ["x0", "x3"]), n("Add", ["x1", "x2"]), n("Concat", ["%0", "%1"], axis=0)], [["%2", "%2"]])
    assert verify(wrong, trials=3) is None
    assert verify(concat_ew("Add", 0), trials=3) is not None
    transposed = rule(RENEST.to_json()["src"], [n("Concat", ["x0", "x1"], axis=0), n("Concat", ["x2", "x3"], axis=0),
                                                n("Concat", ["%0", "%1"], axis=1)], [["%2", "%2"]])
    assert verify(transposed, trials=3) is None


# ============================================================================================ 4. independent ops
@pytest.fixture(scope="module")
def independent_run():
    return generate(GeneratorConfig(max_ops=3, ops=("Relu", "MaxPool", "Concat", "Split"), variables={"a": 2}),
                    trials=3)


def batch_rule(op, axis, **attrs):
    split = [{"dim": ["a0", axis]}, {"dim": ["a1", axis]}]
    return rule([n(op, ["a0"], **attrs), n(op, ["a1"], **attrs)],
                [n("Concat", ["a0", "a1"], axis=axis), n(op, ["%0"], **attrs), n("Split", ["%1"], 2, axis=axis,
                                                                                  split=split)],
                [["%0", "%2.0"], ["%1", "%2.1"]])


POOL = dict(kernel=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1], ceil_mode=0)


def test_independent_ops_are_generated_as_one_op_on_a_concatenation(independent_run):
    for axis in (0, 1):
        for op, attrs in (("Relu", {}), ("MaxPool", POOL)):
            r = find(independent_run.rules, batch_rule(op, axis, **attrs))
            assert r is not None, (op, axis)
            assert find(independent_run.rules, reverse(batch_rule(op, axis, **attrs))) is not None, (op, axis)
    # the same substitution with a0 and a1 swapped (outputs listed the other way round) is kept once
    names = [r["name"] for r in independent_run.rules]
    assert names.count("relu+relu->concat1+relu+split1") == 1


def test_only_pairs_of_one_op_are_recorded():
    """A disconnected graph of two different ops (relu(a0), maxpool(a1)) has no equivalent within three ops and
    is not recorded; two Relus are."""
    from rlflow.rewrite.generator import Enumerator

    graphs = Enumerator(GeneratorConfig(max_ops=2, ops=("Relu", "MaxPool"), variables={"a": 2})).run()
    pairs = [tuple(o.op for o in g.ops) for g in graphs
             if len(g.ops) == 2 and not set(g.ops[1].inputs) & {"%0", *g.ops[0].inputs}]
    assert ("Relu", "Relu") in pairs and ("MaxPool", "MaxPool") in pairs
    assert all(a == b for a, b in pairs)


def test_independent_relus_merge_on_a_small_graph(independent_run):
    b = GraphBuilder("relus")
    a0, a1 = b.input("a0", (1, 3, 4, 4)), b.input("a1", (1, 5, 4, 4))
    g = b.build([b.op("Relu", [a0]), b.op("Relu", [a1])])
    r = find(independent_run.rules, batch_rule("Relu", 1))
    h = applies_once_and_agrees(g, r, {"Concat": 1, "Relu": 1, "Split": 1})
    # channel counts that differ on another axis than the concat's: no match (Concat fails shape inference)
    b = GraphBuilder("relus2")
    g2 = b.build([b.op("Relu", [b.input("a0", (1, 3, 4, 4))]), b.op("Relu", [b.input("a1", (1, 3, 5, 4))])])
    assert find_matches(g2, r) == []
    applies_once_and_agrees(h, find(independent_run.rules, reverse(batch_rule("Relu", 1))), {"Relu": 2})


def test_independent_ops_broken_variant_is_rejected():
    """Splitting the merged result back in the wrong order fails (sizes drawn apart, or equal sizes with other
    values)."""
    good = batch_rule("Relu", 1)
    wrong = rule(good.to_json()["src"], good.to_json()["dst"], [["%0", "%2.1"], ["%1", "%2.0"]])
    assert verify(good, trials=3) is not None
    assert verify(wrong, trials=3, examples=[{"vars": {"a0": [1, 2, 3, 3], "a1": [1, 2, 3, 3]}}]) is None


# ============================================================================================ 5. grouped convs
@pytest.mark.parametrize("rid", ["b-conv-group-merge", "b-conv-bias-group-merge"])
@pytest.mark.parametrize("group", [1, 2])
def test_group_merge_applies_to_a_small_graph(rid, group):
    b, y1, y2 = two_input_conv_graph(bias="-bias-" in rid, group=group, stride=(1, 2), pads=(1, 0, 1, 1))
    g = b.build([b.op("Relu", [y1]), y2])
    h = applies_once_and_agrees(g, BUILTIN[rid][0], {"Concat": 2 + ("-bias-" in rid), "Conv": 1, "Split": 1,
                                                     "Relu": 1})
    merged = next(nd for nd in h.nodes if nd.op == "Conv")
    assert merged.attrs["group"] == 2 * group


def test_group_merge_rejects_unequal_output_channels():
    b, y1, y2 = two_input_conv_graph(o2=2)
    assert find_matches(b.build([y1, y2]), BUILTIN["b-conv-group-merge"][0]) == []


@HYP
@given(data=st.data())
def test_group_merge_at_other_shapes(data):
    d = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731
    g, cpg, opg, kh, kw = d(1, 3), d(1, 2), d(1, 2), d(1, 3), d(1, 3)
    h, w = d(kh, 6), d(kw, 6)
    x = [d(1, 2), g * cpg, h, w]
    shapes = {"x1": x, "w1": [g * opg, cpg, kh, kw], "x2": list(x), "w2": [g * opg, cpg, kh, kw]}
    params = {"s": [d(1, 2), d(1, 2)], "p": [d(0, 1) for _ in range(4)], "g": g,
              "a": data.draw(st.sampled_from(["none", "relu"]))}
    r = BUILTIN["b-conv-group-merge"][0]
    assert compare(r, shapes, params) <= 1e-9
    o2 = g * d(1, 3)
    got = compare(r, {**shapes, "w2": [o2, cpg, kh, kw]}, params)
    assert got <= 1e-9 if o2 == g * opg else got == "rejected", got


def test_group_merge_split_by_each_kernel_is_unsound():
    """The broken variant: splitting the merged output at [O1, O2] type-checks when O1 != O2 but the merged
    conv's groups then mix the two kernels' output channels; the verifier rejects it (the rule itself splits
    at [O1, O1], which fails shape inference there)."""
    raw = copy.deepcopy(BUILTIN["b-conv-group-merge"][0].to_json())
    raw["dst"][-1]["attrs"]["split"] = [{"dim": ["w1", 0]}, {"dim": ["w2", 0]}]
    broken = rule_from_json(raw, "broken")
    shapes = {"x1": [1, 2, 5, 5], "w1": [2, 2, 3, 3], "x2": [1, 2, 5, 5], "w2": [4, 2, 3, 3]}
    params = {"s": [1, 1], "p": [1, 1, 1, 1], "g": 1, "a": "none"}
    assert compare(broken, shapes, params) > 1e-3
    assert compare(BUILTIN["b-conv-group-merge"][0], shapes, params) == "rejected"
    ex = BUILTIN["b-conv-group-merge"][1]
    assert verify(broken, trials=4, examples=ex) is None
    assert verify(BUILTIN["b-conv-group-merge"][0], trials=4, examples=ex) is not None


def test_new_builtin_rules_are_verified_by_the_stage():
    ids = {"b-conv-sum-concat", "b-conv-bias-sum-concat", "b-conv-sum-concat-relu", "b-conv-bias-sum-concat-relu",
           "b-conv-group-merge", "b-conv-bias-group-merge"}
    got = {r.id: r for r in verified_builtin_rules(trials=3)}
    assert ids <= set(got)
    for rid in ids:
        assert got[rid].verified["method"] == "random-float64" and got[rid].verified["max_rel_diff"] <= 1e-9


def test_eqsat_leaves_out_rules_whose_roots_share_no_variable(independent_run):
    """Two independent Relus batched into one match every pair of Relu e-nodes, and each application makes new
    Relu e-nodes that pair again: eqsat leaves such rules out (the graph matcher, the searches and the agents use
    them); a two-root rule whose roots share a variable (conv-merge) stays."""
    from rlflow.cost import AnalyticCost
    from rlflow.search.eqsat import Pattern, eqsat_search

    batch = find(independent_run.rules, batch_rule("Relu", 1))
    assert not Pattern(batch).joined and not Pattern(BUILTIN["b-conv-group-merge"][0]).joined
    assert Pattern(BUILTIN["b-conv-merge"][0]).joined and Pattern(BUILTIN["b-matmul-merge"][0]).joined
    b = GraphBuilder("relus")
    g = b.build([b.op("Relu", [b.input("a0", (1, 3, 4, 4))]), b.op("Relu", [b.input("a1", (1, 5, 4, 4))])])
    res = eqsat_search(g, [batch, BUILTIN["b-conv-merge"][0]], AnalyticCost("cpu"))
    assert res.stats["rules_skipped"] == 1 and res.stats["rules_translated"] == 1
    assert res.stats["egraph_nodes"] == res.stats["egraph_nodes_initial"]
