"""The builtin (hand-written) rules: each parses, round-trips, agrees with its source pattern at its own examples
and at random other shapes (float64, torch reference semantics), is rejected (never wrong) at bindings it must not
fold, and a deliberately broken variant of each is caught."""

from __future__ import annotations

import copy
import itertools
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.errors import RLFlowError
from rlflow.rewrite.builtin import builtin_rules, check_rule, compare, tolerance, verified_builtin_rules
from rlflow.rewrite.rule import load_rules, rule_from_json, rules_document

RULES = {r.id: (r, ex) for r, ex in builtin_rules(bias_fusion=True)}  # every rule, the opt-in family too
TOL = 1e-9
HYP = settings(max_examples=25, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow])


def ok(got, tol: float = TOL) -> bool:
    return isinstance(got, float) and got <= tol


def sound(got) -> bool:
    """At a binding the matcher could produce, the rule either is rejected or agrees."""
    return got in ("no-match", "rejected") or ok(got)


def mutate(rid: str, fn) -> object:
    raw = copy.deepcopy(RULES[rid][0].to_json())
    fn(raw)
    return rule_from_json(raw, "mutated")


# ============================================================================================ structure
def test_rule_set():
    ids = list(RULES)
    assert len(ids) == len(set(ids)) >= 20
    expected = {"b-conv-relu", "b-conv-bias-relu", "b-conv-bn", "b-conv-bias-bn", "b-conv-mul-c4",
                "b-conv-bias-mul-c4", "b-conv-mul-c3", "b-conv-mul-scalar", "b-conv-enlarge-merge",
                "b-conv-bias-enlarge-merge", "b-conv-merge", "b-conv-bias-merge", "b-matmul-merge",
                "b-matmul-add-gemm", "b-add-assoc", "b-add-const-pair", "b-avgpool-conv-3x3"}
    assert expected <= set(ids), expected - set(ids)


@pytest.mark.parametrize("rid", list(RULES))
def test_parses_and_round_trips(rid):
    rule, examples = RULES[rid]
    assert rule.origin == "builtin" and rid.startswith("b-")
    again = rule_from_json(json.loads(json.dumps(rule.to_json())), "x")
    assert again == rule
    assert len(examples) >= 2
    src_params = {v[1:] for n in rule.src for v in n.attrs.values() if isinstance(v, str) and v.startswith("$")}
    for ex in examples:
        assert set(ex["vars"]) == set(rule.variables)
        assert src_params <= set(ex["params"])


def test_merge_rules_pin_group_one():
    """Concatenating kernels of grouped convs would re-group the channels: these rules only take group 1 (but
    the grouped-conv merge, which doubles the group count: tests/test_rule_families.py)."""
    for rid, (rule, _) in RULES.items():
        if ("merge" in rid or "sum-concat" in rid) and "conv" in rid and "group-merge" not in rid:
            assert all(n.attrs["group"] == 1 for n in rule.src + rule.dst if n.op == "Conv"), rid
    for rid in ("b-conv-group-merge", "b-conv-bias-group-merge"):
        rule = RULES[rid][0]
        assert [n.attrs["group"] for n in rule.src + rule.dst if n.op == "Conv"] == ["$g", "$g", {"prod": [2, "$g"]}]


# ============================================================================================ examples
@pytest.mark.parametrize("rid", list(RULES))
def test_examples_verify(rid):
    rule, examples = RULES[rid]
    rec = check_rule(rule, examples, trials=2)
    assert rec["method"] == "random-float64" and rec["trials"] == 2 * len(examples)
    assert rec["max_rel_diff"] <= tolerance(rule) == 1e-9


def test_verified_records_and_rules_file(tmp_path):
    """verified_builtin_rules is what the generate_rules stage writes: every rule verified by the project's
    verifier at its own examples plus random bindings, and the records survive a rules file."""
    rules = verified_builtin_rules(trials=3, max_dim=4, seed=0, bias_fusion=True)
    assert [r.id for r in rules] == list(RULES) and len(rules) == 62
    # the bias-fusion family is opt-in and comes last: without it every other rule keeps its place and record
    default = verified_builtin_rules(trials=3, max_dim=4, seed=0)
    assert len(default) == 60 and rules[:60] == default
    assert [r.id for r in rules[60:]] == ["b-split-add-merge", "b-matmul-add-gemm-3d"]
    for r in rules:
        rec, examples = r.verified, RULES[r.id][1]
        assert rec["method"] == "random-float64" and rec["seed"] == 0 and rec["rtol"] == 1e-9, r.id
        # every example, then random bindings around them: at least max(trials, #examples) in all
        assert [s["vars"] for s in rec["shapes"][:len(examples)]] == [e["vars"] for e in examples], r.id
        assert len(rec["shapes"]) >= max(3, len(examples)), r.id
        assert rec["examples"] == examples, r.id
        assert 0.0 <= rec["max_rel_diff"] <= 1e-9, (r.id, rec["max_rel_diff"])
        # the rule itself is unchanged: only its record is filled in
        assert {**r.to_json(), "verified": None} == {**RULES[r.id][0].to_json(), "verified": None}
    p = tmp_path / "rules.json"
    p.write_text(json.dumps(rules_document(rules, {"builtin": True})))
    assert load_rules(p) == rules


def test_verified_builtin_rules_fails_on_a_broken_rule(monkeypatch):
    """A builtin rule that does not verify is an error naming the rule and its failing example, never dropped."""
    import rlflow.rewrite.builtin as builtin

    broken = mutate("b-add-assoc", lambda raw: raw["dst"][0].update(op="Sub"))
    rules = [(broken if r.id == "b-add-assoc" else r, ex) for r, ex in builtin_rules()]
    monkeypatch.setattr(builtin, "builtin_rules", lambda bias_fusion=False, fused_kernels=False: rules)
    with pytest.raises(RLFlowError, match=r"rule 'b-add-assoc': example 0 .*outputs differ"):
        builtin.verified_builtin_rules(trials=1)


# ============================================================================================ other shapes
@st.composite
def conv_case(draw, bias: bool):
    g = draw(st.sampled_from([1, 1, 2, 3]))
    cin, opg = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    pads = draw(st.lists(st.integers(0, 2), min_size=4, max_size=4))
    h = draw(st.integers(max(1, kh - pads[0] - pads[2]), 7))
    w = draw(st.integers(max(1, kw - pads[1] - pads[3]), 7))
    o = g * opg
    shapes = {"x": [draw(st.integers(1, 2)), cin * g, h, w], "w": [o, cin, kh, kw]}
    if bias:
        shapes["b"] = [o]
    params = {"s": [draw(st.integers(1, 3)), draw(st.integers(1, 3))], "p": pads, "g": g}
    return shapes, params


def conv_rule_ids(*parts):
    return [rid for rid in RULES if rid.startswith("b-conv") and any(rid.endswith(p) for p in parts)]


@pytest.mark.parametrize("rid", ["b-conv-relu", "b-conv-bias-relu"])
@HYP
@given(data=st.data())
def test_conv_relu_shapes(rid, data):
    shapes, params = data.draw(conv_case("bias" in rid))
    assert ok(compare(RULES[rid][0], shapes, params))


@pytest.mark.parametrize("rid", conv_rule_ids("-bn"))
@HYP
@given(data=st.data(), eps=st.sampled_from([1e-5, 1e-3, 0.1]))
def test_conv_bn_shapes(rid, data, eps):
    shapes, params = data.draw(conv_case("bias" in rid))
    o = shapes["w"][0]
    shapes.update(scale=[o], bias=[o], mean=[o], var=[o])
    assert ok(compare(RULES[rid][0], shapes, {**params, "eps": eps}))


@pytest.mark.parametrize("rid", conv_rule_ids("-c4", "-c3", "-scalar", "-add-bias"))
@HYP
@given(data=st.data())
def test_conv_constant_fold_shapes(rid, data):
    shapes, params = data.draw(conv_case("-bias-" in rid))
    o = shapes["w"][0]
    if rid.endswith("c3"):
        shapes["c"] = [o, 1, 1]
    elif rid.endswith("scalar"):
        shapes["c"] = [1] * data.draw(st.integers(0, 4))
    else:
        shapes["c"] = [1, o, 1, 1]
    assert ok(compare(RULES[rid][0], shapes, params))


@pytest.mark.parametrize("rid", conv_rule_ids("-c4", "-c3", "-scalar", "-add-bias"))
def test_conv_constant_fold_rejects_other_broadcasts(rid):
    """Every constant shape that broadcasts against the conv output (N=O=H=W=4, so every dimension coincides):
    only the per-channel (or one-element) shapes are folded, all others are rejected, none is folded wrongly."""
    rule = RULES[rid][0]
    accepted = []
    for rank in range(6):
        for c in itertools.product([1, 4], repeat=rank):
            shapes = {"x": [4, 3, 4, 4], "w": [4, 3, 1, 1], "c": list(c)}
            if "-bias-" in rid:
                shapes["b"] = [4]
            got = compare(rule, shapes, {"s": [1, 1], "p": [0, 0, 0, 0], "g": 1}, trials=1)
            assert sound(got), (c, got)
            if ok(got):
                accepted.append(c)
    kind = next(k for k in ("c4", "c3", "scalar", "add-bias") if rid.endswith(k))
    want = {"c4": [(1, 4, 1, 1)], "c3": [(4, 1, 1)], "scalar": [(), (1,), (1, 1), (1, 1, 1), (1, 1, 1, 1)],
            "add-bias": [(1, 4, 1, 1)]}[kind]
    assert accepted == want


@st.composite
def odd_even_pair(draw):
    """(k1, k2), k2 <= k1 with the same parity (Enlarge pads symmetrically)."""
    k1 = draw(st.integers(1, 5))
    k2 = draw(st.sampled_from(list(range(k1 % 2 or 2, k1 + 1, 2))))
    return k1, k2


@pytest.mark.parametrize("rid", ["b-conv-enlarge-merge", "b-conv-bias-enlarge-merge"])
@HYP
@given(kh=odd_even_pair(), kw=odd_even_pair(), data=st.data())
def test_enlarge_merge_shapes(rid, kh, kw, data):
    c, o1, o2 = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    shapes = {"x": [data.draw(st.integers(1, 2)), c, data.draw(st.integers(1, 7)), data.draw(st.integers(1, 7))],
              "w1": [o1, c, kh[0], kw[0]], "w2": [o2, c, kh[1], kw[1]]}
    if "bias" in rid:
        shapes.update(b1=[o1], b2=[o2])
    params = {"s": [data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))],
              "a": data.draw(st.sampled_from(["none", "relu"]))}
    rule = RULES[rid][0]
    assert ok(compare(rule, shapes, params))
    # the other binding (the larger kernel as w2) is rejected unless the kernels are equal
    swapped = {**shapes, "w1": shapes["w2"], "w2": shapes["w1"]}
    if "bias" in rid:
        swapped.update(b1=shapes["b2"], b2=shapes["b1"])
    got = compare(rule, swapped, params)
    assert (ok(got) if (kh[0], kw[0]) == (kh[1], kw[1]) else got == "rejected"), got


@pytest.mark.parametrize("rid", ["b-conv-merge", "b-conv-bias-merge"])
@HYP
@given(data=st.data())
def test_conv_merge_shapes(rid, data):
    shapes, params = data.draw(conv_case(False))
    c, kh, kw = shapes["x"][1], shapes["w"][2], shapes["w"][3]
    o0, o1 = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    shapes = {"x": shapes["x"], "w0": [o0, c, kh, kw], "w1": [o1, c, kh, kw]}
    if "bias" in rid:
        shapes.update(b0=[o0], b1=[o1])
    params = {"s": params["s"], "p": params["p"], "a": data.draw(st.sampled_from(["none", "relu"]))}
    assert ok(compare(RULES[rid][0], shapes, params))


@HYP
@given(xrank=st.integers(1, 3), wrank=st.integers(2, 3), m=st.integers(1, 4), k=st.integers(1, 4),
       n0=st.integers(1, 4), n1=st.integers(1, 4), b=st.integers(1, 3))
def test_matmul_merge_shapes(xrank, wrank, m, k, n0, n1, b):
    x = [b, m, k][3 - xrank:]
    rule = RULES["b-matmul-merge"][0]
    assert ok(compare(rule, {"x": x, "w0": [b, k, n0][3 - wrank:], "w1": [b, k, n1][3 - wrank:]}, {}))
    # 1-D weights (the product drops an axis) and batch sizes that differ are rejected or not a match
    assert sound(compare(rule, {"x": x, "w0": [k], "w1": [k]}, {}))
    assert sound(compare(rule, {"x": x, "w0": [1, k, n0], "w1": [b + 1, k, n1]}, {}))


@HYP
@given(m=st.integers(1, 4), k=st.integers(1, 4), n=st.integers(1, 4), data=st.data())
def test_gemm_shapes(m, k, n, data):
    rule = RULES["b-matmul-add-gemm"][0]
    bshape = data.draw(st.sampled_from([[], [n], [1, n], [m, 1], [m, n], [1, 1], [1]]))
    assert ok(compare(rule, {"x": [m, k], "w": [k, n], "b": bshape}, {}))
    # a bias that grows the output, or batched operands, are not Gemm: rejected (or no match), never wrong
    assert compare(rule, {"x": [m, k], "w": [k, n], "b": [2, m, n]}, {}) == "rejected"
    assert compare(rule, {"x": [2, m, k], "w": [k, n], "b": [n]}, {}) == "rejected"


@HYP
@given(bsz=st.integers(1, 3), m=st.integers(1, 4), k=st.integers(1, 4), n=st.integers(1, 4), data=st.data())
def test_gemm_3d_shapes(bsz, m, k, n, data):
    """A (B, M, K) x with any bias that broadcasts along the flattened rows agrees; a bias that differs per batch
    element, grows the output, or an x of another rank is rejected (or not a match), never wrong."""
    rule = RULES["b-matmul-add-gemm-3d"][0]
    bshape = data.draw(st.sampled_from([[], [1], [n], [1, n], [1, 1]] + ([[m, n], [m, 1]] if bsz == 1 else [])))
    assert ok(compare(rule, {"x": [bsz, m, k], "w": [k, n], "b": bshape}, {}))
    for shapes in ({"x": [bsz, m, k], "w": [k, n], "b": [bsz, m, n]},
                   {"x": [bsz, m, k], "w": [k, n], "b": [2, 1, 1, n]},
                   {"x": [m, k], "w": [k, n], "b": [n]}, {"x": [1, bsz, m, k], "w": [k, n], "b": [n]},
                   {"x": [bsz, m, k], "w": [bsz, k, n], "b": [n]}):
        got = compare(rule, shapes, {})
        assert sound(got), (shapes, got)
        if len(shapes["b"]) == 3 and bsz > 1 or len(shapes["x"]) != 3:
            assert got in ("no-match", "rejected"), (shapes, got)


@HYP
@given(lead=st.lists(st.integers(1, 3), max_size=2), n0=st.integers(1, 4), n1=st.integers(1, 4), data=st.data())
def test_split_add_merge_shapes(lead, n0, n1, data):
    """Constants that span their block of the split axis (with any broadcast leading axes) agree; one that
    broadcasts along the split axis is rejected; the result is never wrong."""
    rule = RULES["b-split-add-merge"][0]
    y = lead + [n0 + n1]
    clead = [d if data.draw(st.booleans()) else 1 for d in lead[len(lead) - data.draw(st.integers(0, len(lead))):]]
    assert ok(compare(rule, {"y": y, "c0": clead + [n0], "c1": clead + [n1]}, {"sp": [n0, n1]}))
    c0 = data.draw(st.sampled_from([[1], [n0], [], [2, n0], [n0, 1]]))
    c1 = data.draw(st.sampled_from([[1], [n1], [], [2, n1], [n1, 1]]))
    got = compare(rule, {"y": y, "c0": c0, "c1": c1}, {"sp": [n0, n1]})
    assert sound(got), (y, c0, c1, got)
    if (c0 == [1] and n0 > 1) or (c1 == [1] and n1 > 1) or [] in (c0, c1):
        assert got in ("no-match", "rejected"), (y, c0, c1, got)


@st.composite
def broadcast_shapes(draw, count: int):
    """``count`` shapes that broadcast together (suffixes of one full shape, some dimensions set to 1)."""
    full = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
    out = []
    for _ in range(count):
        r = draw(st.integers(0, len(full)))
        out.append([d if draw(st.booleans()) else 1 for d in full[len(full) - r:]])
    return out


@pytest.mark.parametrize("rid", ["b-add-const-pair", "b-add-assoc", "b-mul-assoc"])
@HYP
@given(data=st.data())
def test_elementwise_chain_shapes(rid, data):
    rule = RULES[rid][0]
    vs = rule.variables
    shapes = dict(zip(vs, data.draw(broadcast_shapes(len(vs)))))
    assert ok(compare(rule, shapes, {}))


@pytest.mark.parametrize("rid", [rid for rid in RULES if rid.startswith("b-avgpool-conv")])
@HYP
@given(n=st.integers(1, 2), c=st.integers(1, 4), h=st.integers(3, 8), w=st.integers(3, 8),
       s=st.tuples(st.integers(1, 3), st.integers(1, 3)), p=st.tuples(*[st.integers(0, 1)] * 4),
       cip=st.integers(0, 1))
def test_avgpool_conv_shapes(rid, n, c, h, w, s, p, cip):
    rule = RULES[rid][0]
    assert ok(compare(rule, {"x": [n, c, h, w]}, {"s": list(s), "p": list(p), "c": cip}), tolerance(rule))


def test_avgpool_excluded_padding_is_unsound():
    """Why the pooling rules pin count_include_pad=1 when padded: with padding left out of the count, border
    windows divide by fewer than kh*kw elements, and the conv would compute something else."""
    loose = mutate("b-avgpool-conv-3x3", _set(["src", 0, "attrs", "count_include_pad"], "$c"))
    params = {"s": [1, 1], "p": [1, 1, 1, 1]}
    assert ok(compare(loose, {"x": [1, 2, 5, 5]}, {**params, "c": 1}))
    assert compare(loose, {"x": [1, 2, 5, 5]}, {**params, "c": 0}) > 1e-3


# ============================================================================================ broken variants
def _set(path, value):
    def fn(raw):
        node = raw
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
    return fn


def _conv_idx(raw):
    return [i for i, n in enumerate(raw["dst"]) if n["op"] == "Conv"][-1]


BROKEN = {
    # the fused conv forgets its ReLU
    "b-conv-relu": (lambda raw: raw["dst"][0]["attrs"].__setitem__("activation", "none"), None),
    # new bias adds the mean instead of subtracting it
    "b-conv-bias-bn": (_set(["dst", 6, "op"], "Add"), None),
    # scale reshaped onto the input-channel axis (same shape when C == O and 1x1 kernels, wrong values)
    "b-conv-bn": (_set(["dst", 4, "attrs", "shape"], [1, {"dim": ["w", 0]}, 1, 1]),
                  {"x": [1, 4, 5, 5], "w": [4, 4, 1, 1], "scale": [4], "bias": [4], "mean": [4], "var": [4]}),
    # merged output split in the wrong order (equal widths: same types, swapped values)
    "b-conv-enlarge-merge": (_set(["outputs"], [["%0", "%3.1"], ["%1", "%3.0"]]),
                             {"x": [1, 2, 5, 5], "w1": [3, 2, 3, 3], "w2": [3, 2, 1, 1]}),
    # weights concatenated in the wrong order
    "b-matmul-merge": (_set(["dst", 0, "inputs"], ["w1", "w0"]),
                          {"x": [3, 4], "w0": [4, 2], "w1": [4, 2]}),
    # Gemm with a transposed weight
    "b-matmul-add-gemm": (_set(["dst", 0, "attrs", "transB"], 1), {"x": [3, 4], "w": [4, 4], "b": [4]}),
    # the flattened Gemm with a transposed weight
    "b-matmul-add-gemm-3d": (_set(["dst", 1, "attrs", "transB"], 1), {"x": [1, 3, 4], "w": [4, 4], "b": [4]}),
    # the constants concatenated in the wrong order (same types, biases on the wrong columns)
    "b-split-add-merge": (_set(["dst", 0, "inputs"], ["c1", "c0"]), {"y": [2, 5], "c0": [2], "c1": [3]}),
    # "associativity" that drops the regrouping: (x + y) + z -> x + (z + z)
    "b-add-assoc": (_set(["dst", 0, "inputs"], ["z", "z"]), None),
    # associativity of a non-associative op: (x - y) - z -> x - (y - z)
    "b-mul-assoc": (lambda raw: [n.update(op="Sub") for n in raw["src"] + raw["dst"]], None),
    # constants subtracted instead of added
    "b-add-const-pair": (_set(["dst", 1, "op"], "Sub"), None),
    # pooling kernel of the wrong value
    "b-avgpool-conv-3x3": (_set(["dst", 1, "attrs", "value"], 8.0), None),
    # the scale multiplies the moved operand where it should divide it
    "b-div-scalar-matmul-l": (_set(["dst", 1, "op"], "Mul"), None),
    # the hoisted product drops y: x * (y * s) -> (x * x) * s
    "b-mul-scalar-hoist": (_set(["dst", 1, "inputs"], ["x", "x"]), None),
    # the weight's block multiplied by the scale where the product was divided by it
    "b-div-scalar-split-weight-1": (_set(["dst", 3, "op"], "Mul"), None),
    "b-div-scalar-split2-weight-01": (_set(["dst", 4, "op"], "Mul"), None),
    # folded scale applied to the bias twice over: Mul(b, c) replaced by Add(b, c)
    "b-conv-bias-mul-c4": (_set(["dst", 5, "op"], "Add"), None),
    # kernels concatenated in the other order than the inputs (equal channel counts: same types)
    "b-conv-sum-concat": (_set(["dst", 1, "inputs"], ["w2", "w1"]),
                          {"x1": [1, 2, 5, 5], "w1": [3, 2, 3, 3], "x2": [1, 2, 5, 5], "w2": [3, 2, 3, 3]}),
    # the ReLU after the sum dropped from the merged conv
    "b-conv-sum-concat-relu": (_set(["dst", 2, "attrs", "activation"], "none"), None),
    # the merged biases subtracted
    "b-conv-bias-sum-concat": (_set(["dst", 2, "op"], "Sub"), None),
    # the grouped conv's outputs split in the wrong order
    "b-conv-group-merge": (_set(["outputs"], [["%0", "%3.1"], ["%1", "%3.0"]]), None),
}


@pytest.mark.parametrize("rid", list(BROKEN))
def test_broken_variant_fails(rid):
    fn, shapes = BROKEN[rid]
    broken = mutate(rid, fn)
    examples = RULES[rid][1] if shapes is None else [{"vars": shapes, "params": RULES[rid][1][0]["params"]}]
    with pytest.raises(RLFlowError, match=rf"rule '{rid}': example 0 .*outputs differ"):
        check_rule(broken, examples, trials=1)
    # the project's verifier catches it too, and passes the intact rule at the same shapes
    from rlflow.rewrite.verify import verify

    assert verify(RULES[rid][0], trials=len(examples) + 2, examples=examples, rtol=tolerance(broken)) is not None
    assert verify(broken, trials=len(examples) + 2, examples=examples, rtol=tolerance(broken)) is None


def test_unchecked_channel_constant_is_unsound():
    """Why the conv-mul targets pin the constant's shape: with the Split/Enlarge checks removed (Reshape only),
    a (4,1,1,1) constant (one scale per *batch* item, N == O) would be folded into the weights, wrongly."""
    def strip(raw):
        raw["dst"] = [{"op": "Reshape", "inputs": ["c"], "attrs": {"shape": [{"dim": ["w", 0]}, 1, 1, 1]}},
                      {"op": "Mul", "inputs": ["w", "%0"], "attrs": {}},
                      {"op": "Conv", "inputs": ["x", "%1"], "attrs": raw["dst"][-1]["attrs"]}]
        raw["outputs"] = [["%1", "%2"]]
    loose = mutate("b-conv-mul-c4", strip)
    params = {"s": [1, 1], "p": [0, 0, 0, 0], "g": 1}
    assert ok(compare(loose, {"x": [4, 3, 4, 4], "w": [4, 3, 1, 1], "c": [1, 4, 1, 1]}, params))
    assert compare(loose, {"x": [4, 3, 4, 4], "w": [4, 3, 1, 1], "c": [4, 1, 1, 1]}, params) > 1e-3
    strict = RULES["b-conv-mul-c4"][0]
    assert compare(strict, {"x": [4, 3, 4, 4], "w": [4, 3, 1, 1], "c": [4, 1, 1, 1]}, params) == "rejected"


def test_grouped_merge_is_unsound():
    """Why the merge rules pin group 1: the same rule with a group parameter computes something else at group 2."""
    def grouped(raw):
        for side in ("src", "dst"):
            for n in raw[side]:
                if n["op"] == "Conv":
                    n["attrs"]["group"] = "$g"
    loose = mutate("b-conv-merge", grouped)
    params = {"s": [1, 1], "p": [0, 0, 0, 0], "a": "none"}
    shapes = {"x": [1, 4, 3, 3], "w0": [4, 2, 1, 1], "w1": [2, 2, 1, 1]}
    assert compare(loose, shapes, {**params, "g": 2}) > 1e-3


# ============================================================================================ on graphs
def _apply_all(g, rid, expected, times=None):
    """Apply builtin rule ``rid`` (``expected`` matches at first) ``times`` times (default: ``expected``), one
    match at a time, re-matching after each; afterwards no match is left."""
    from rlflow.rewrite.matcher import apply, find_matches

    rule = RULES[rid][0]
    first = find_matches(g, rule)
    assert len(first) == expected, (rid, len(first))
    for _ in range(expected if times is None else times):
        g = apply(g, find_matches(g, rule)[0])
    assert find_matches(g, rule) == []
    return g


def _same_outputs(g0, g1, tol=1e-5):
    from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff

    feeds = make_inputs(g0, seed=1)
    want = get_runner(g0, "ort")(feeds)
    assert max_rel_diff(want, get_runner(g1, "ort")(feeds)) < tol
    assert max_rel_diff(want, get_runner(g1, "torch")(feeds)) < tol


def test_rules_rewrite_a_conv_block():
    """Conv+BN+ReLU, an Inception-like 1x1 / 3x3 / avg-pool branch: BN folds, ReLUs fuse, the 1x1 conv is
    enlarged and merged with the 3x3 one, the pooling becomes a conv; ORT and torch outputs are unchanged."""
    import numpy as np

    from rlflow.graph.builder import GraphBuilder
    from rlflow.graph.fold import fold_constants

    rng = np.random.default_rng(0)
    w = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    b = GraphBuilder("block")
    x = b.input("x", (2, 3, 8, 8))
    conv = dict(strides=(1, 1), group=1, activation="none")
    y = b.op("Conv", [x, b.const("w0", w(8, 3, 3, 3)), b.const("b0", w(8))], pads=(1, 1, 1, 1), **conv)
    y = b.op("BatchNormalization", [y, b.const("g", w(8)), b.const("beta", w(8)), b.const("mu", w(8)),
                                    b.const("var", np.abs(w(8)) + 0.5)], epsilon=1e-5)
    r = b.op("Relu", [y])
    a = b.op("Relu", [b.op("Conv", [r, b.const("w1", w(4, 8, 1, 1)), b.const("b1", w(4))], pads=(0,) * 4, **conv)])
    c = b.op("Relu", [b.op("Conv", [r, b.const("w3", w(5, 8, 3, 3)), b.const("b3", w(5))], pads=(1,) * 4, **conv)])
    p = b.op("AveragePool", [r], kernel=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1), ceil_mode=0, count_include_pad=1)
    p = b.op("Conv", [p, b.const("w4", w(2, 8, 1, 1))], pads=(0,) * 4, **conv)
    g0 = b.build([b.op("Concat", [a, c, p], axis=1)])

    g = _apply_all(g0, "b-conv-bias-bn", 1)
    g = _apply_all(g, "b-conv-bias-relu", 3)
    g = _apply_all(g, "b-conv-bias-enlarge-merge", 1)   # only the (3x3, 1x1) binding: the other is rejected
    g = _apply_all(g, "b-avgpool-conv-3x3", 1)
    _same_outputs(g0, g)
    folded = fold_constants(g)
    assert folded.op_counts() == {"Concat": 1, "Conv": 4, "Split": 1}
    _same_outputs(g0, folded)


def test_rules_rewrite_matmuls():
    """Q/K projections of a (batch, seq, hidden) input merge; MatMul+bias becomes Gemm; x + c0 + c1 folds."""
    import numpy as np

    from rlflow.graph.builder import GraphBuilder
    from rlflow.graph.fold import fold_constants
    from rlflow.rewrite.matcher import apply, find_matches

    rng = np.random.default_rng(0)
    w = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    b = GraphBuilder("mm")
    x = b.input("x", (2, 5, 8))
    q = b.op("MatMul", [x, b.const("wq", w(8, 8))])
    k = b.op("MatMul", [x, b.const("wk", w(8, 6))])
    h = b.input("h", (4, 8))
    o = b.op("Add", [b.op("MatMul", [h, b.const("wo", w(8, 3))]), b.const("bo", w(3))])
    o = b.op("Add", [b.op("Add", [o, b.const("c0", w(4, 1))]), b.const("c1", w(3))])
    g0 = b.build([q, k, o])

    g = _apply_all(g0, "b-matmul-merge", 2, times=1)  # (wq, wk) and (wk, wq); applying one removes both
    g = _apply_all(g, "b-matmul-add-gemm", 1)
    # associativity with the two constants side by side (a commutative match: (o + c0) + c1 -> o + (c0 + c1))
    assoc = RULES["b-add-assoc"][0]
    g = apply(g, next(m for m in find_matches(g, assoc) if {dict(m.bindings)[v] for v in "yz"} == {"c0", "c1"}))
    _same_outputs(g0, g)
    assert fold_constants(g).op_counts() == {"Add": 1, "Gemm": 1, "MatMul": 1, "Split": 1}


def test_qkv_biases_join_the_merged_gemm():
    """A transformer's Q/K/V projections of a (1, seq, hidden) input: merged (two MatMul merges), their three
    biases joined behind the Splits (two split-add merges) and fused with the merged product into one Gemm:
    the same outputs, one Gemm and no Add left once folded. A (2, seq, hidden) batch fuses too."""
    from rlflow.graph.builder import GraphBuilder
    from rlflow.graph.fold import fold_constants

    for batch in (1, 2):
        rng = np.random.default_rng(3)
        w = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
        b = GraphBuilder("qkv")
        x = b.input("x", (batch, 5, 8))
        outs = [b.op("Add", [b.op("MatMul", [x, b.const(f"w{n}", w(8, 4))]), b.const(f"b{n}", w(4))]) for n in "qkv"]
        g0 = b.build(outs)
        g = _apply_all(g0, "b-matmul-merge", 6, times=2)   # every ordered pair of the three; two merges do all
        g = _apply_all(g, "b-split-add-merge", 1, times=2)  # the inner Split's two biases, then the outer's
        g = _apply_all(g, "b-matmul-add-gemm-3d", 1)
        _same_outputs(g0, g)
        folded = fold_constants(g)
        assert folded.op_counts() == {"Gemm": 1, "Reshape": 2, "Split": 2}, folded.op_counts()
        _same_outputs(g0, folded)


# ============================================================================================ scalar scales
SCALE_RULES = [rid for rid in RULES if "-scalar-" in rid and rid.startswith(("b-mul-scalar", "b-div-scalar"))
               and "split" not in rid]
SPLIT_SCALE_RULES = [rid for rid in RULES if "-scalar-split" in rid]


@st.composite
def scale_binding(draw, rule):
    """Shapes for a scalar-scale rule: the moved operand at rank 1-4, its partner broadcast or chained to fit, and
    ``s`` with one element at rank 0-4 or with several (which the rule must never move)."""
    dims = lambda n: [draw(st.integers(1, 4)) for _ in range(n)]  # noqa: E731
    n = draw(st.integers(1, 4))
    one = [1] * draw(st.integers(0, 4))
    s = one if draw(st.integers(0, 4)) else dims(draw(st.integers(1, 2)))
    vs = set(rule.variables)
    if {"a", "b"} <= vs:                       # MatMul of (..., m, k) @ (k, n) or batched
        k = draw(st.integers(1, 4))
        a = dims(n - 1) + [k]
        b = [k] + dims(1)
        if draw(st.booleans()) and n > 2:
            b = a[:-2] + b
        return {"a": a, "b": b, "s": s}, {}
    if "x" in vs:                              # hoist: x * (y * s)
        return {"x": dims(n), "y": dims(n), "s": s}, {}
    t = dims(n)
    if "c" in vs and "Transpose" in {p.op for p in rule.src}:  # head split: Transpose(Reshape(t + c)) op s
        shape = t[:-1] + ([t[-1] // 2, 2] if t[-1] % 2 == 0 and draw(st.booleans()) else [t[-1]])
        return ({"t": t, "c": t[len(t) - draw(st.integers(0, len(t))):], "s": s},
                {"shape": shape, "perm": draw(st.permutations(range(len(shape))))})
    if "c" in vs:
        return {"t": t, "c": t[len(t) - draw(st.integers(0, len(t))):], "s": s}, {}
    if rule.src[0].op == "Transpose":
        return {"t": t, "s": s}, {"perm": draw(st.permutations(range(n)))}
    return {"t": t, "s": s}, {"shape": [int(np.prod(t))]}


@pytest.mark.parametrize("rid", SCALE_RULES)
@HYP
@given(data=st.data())
def test_scalar_scale_shapes(rid, data):
    """Sound at every binding: a one-element s that keeps the output's rank moves and agrees; an s with several
    elements (a per-channel scale) is never moved; a higher-rank one-element s that broadcasts the output is
    rejected."""
    rule = RULES[rid][0]
    shapes, params = data.draw(scale_binding(rule))
    got = compare(rule, shapes, params)
    assert sound(got), (shapes, got)
    if np.prod(shapes["s"]) > 1:
        assert got in ("no-match", "rejected")
    elif len(shapes["s"]) == 0:
        assert got not in ("rejected",), shapes


@pytest.mark.parametrize("rid", SPLIT_SCALE_RULES)
@HYP
@given(data=st.data())
def test_scalar_split_weight_shapes(rid, data):
    """Sound at every binding: w of rank 1-3 (a vector w is never matched: its product has none of w's axes),
    split sizes that may or may not add up to the product's last axis, s with one element or several."""
    rule = RULES[rid][0]
    dims = lambda n: [data.draw(st.integers(1, 4)) for _ in range(n)]  # noqa: E731
    rank = data.draw(st.integers(1, 3))
    k = data.draw(st.integers(1, 4))
    w = [k] if rank == 1 else dims(rank - 2) + [k] + dims(1)
    a = (w[:-2] if rank == 3 and data.draw(st.booleans()) else []) + dims(data.draw(st.integers(0, 1))) + [k]
    n = w[-1] if rank > 1 else (a[-2] if len(a) > 1 else 1)
    cut = lambda m: [c := data.draw(st.integers(1, max(1, m - 1))), max(1, m - c)]  # noqa: E731
    params = {"sp": cut(n + data.draw(st.integers(0, 1)))}
    if "sq" in {p[1:] for nd in rule.src for p in nd.attrs.values() if isinstance(p, str)}:
        params["sq"] = cut(params["sp"][int(rid[-2])])
    s = [1] * data.draw(st.integers(0, 2)) if data.draw(st.integers(0, 4)) else dims(1)
    got = compare(rule, {"a": a, "w": w, "s": s}, params)
    assert sound(got), (a, w, s, params, got)
    if rank == 1:
        assert got in ("no-match", "rejected")


def test_scalar_split_weight_vector_rejected():
    """The rank check is what keeps a vector w out: without it, a @ w's last axis (a's rows) would be cut where
    w's own axis is, and the scale would land on the wrong entries."""
    loose = mutate("b-div-scalar-split-weight-1", lambda raw: (
        raw["dst"].__setitem__(1, {"op": "Identity", "inputs": ["w"], "attrs": {}})))
    shapes = {"a": [4, 4], "w": [4], "s": []}
    assert compare(loose, shapes, {"sp": [1, 3]}) > 1e-3
    assert compare(RULES["b-div-scalar-split-weight-1"][0], shapes, {"sp": [1, 3]}) == "rejected"


def test_unchecked_scale_shape_is_unsound():
    """Why the targets reshape s to 0-D: without it, a per-column scale (n,) of (a @ b) would be moved onto the
    left operand, where it scales a's columns (the k axis) instead."""
    loose = mutate("b-div-scalar-matmul-l", lambda raw: raw["dst"].__setitem__(0, {
        "op": "Identity", "inputs": ["s"], "attrs": {}}))
    assert ok(compare(loose, {"a": [3, 4], "b": [4, 4], "s": []}, {}))
    assert compare(loose, {"a": [3, 4], "b": [4, 4], "s": [4]}, {}) > 1e-3
    assert compare(RULES["b-div-scalar-matmul-l"][0], {"a": [3, 4], "b": [4, 4], "s": [4]}, {}) == "rejected"


def test_rules_fold_attention_and_gelu_scales():
    """An attention block as torch exports it (Q/K projections with biases, heads split by Reshape+Transpose,
    scores / sqrt(d)) and a GELU's 0.5 before the output projection: pushing the scales to the weights leaves no
    Div or Mul by a constant once folded; outputs are unchanged under ORT and torch."""
    from rlflow.graph.builder import GraphBuilder
    from rlflow.graph.fold import fold_constants

    rng = np.random.default_rng(0)
    w = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    b = GraphBuilder("attn")
    x = b.input("x", (1, 6, 8))
    heads = lambda v, perm: b.op("Transpose", [b.op("Reshape", [v], shape=(1, 6, 2, 4))], perm=perm)  # noqa: E731
    q = heads(b.op("Add", [b.op("MatMul", [x, b.const("wq", w(8, 8))]), b.const("bq", w(8))]), (0, 2, 1, 3))
    k = heads(b.op("Add", [b.op("MatMul", [x, b.const("wk", w(8, 8))]), b.const("bk", w(8))]), (0, 2, 3, 1))
    scores = b.op("Div", [b.op("MatMul", [q, k]), b.const("sqrt_d", np.array(2.0, np.float32))])
    p = b.op("Softmax", [scores], axis=3)
    h = b.op("Add", [b.op("MatMul", [x, b.const("w1", w(8, 8))]), b.const("b1", w(8))])
    gelu = b.op("Mul", [h, b.op("Mul", [b.const("half", np.array(0.5, np.float32)), b.op("Erf", [h])])])
    o = b.op("MatMul", [gelu, b.const("w2", w(8, 8))])
    g0 = b.build([p, o])

    g = _apply_all(g0, "b-div-scalar-matmul-r", 1)       # scores / s -> q @ (k / s)
    g = _apply_all(g, "b-div-scalar-transpose", 1)
    g = _apply_all(g, "b-div-scalar-reshape", 1)
    g = _apply_all(g, "b-div-scalar-add-const", 1)       # (x @ wk + bk) / s -> x @ wk / s + bk / s
    g = _apply_all(g, "b-div-scalar-matmul-r", 1)        # x @ (wk / s): a weight
    g = _apply_all(g, "b-mul-scalar-hoist", 1)           # h * (0.5 * erf) -> (h * erf) * 0.5
    g = _apply_all(g, "b-mul-scalar-across-matmul", 1)   # ((h * erf) * 0.5) @ w2 -> (h * erf) @ (w2 * 0.5)
    _same_outputs(g0, g)
    folded = fold_constants(g)
    assert g0.op_counts()["Div"] == 1 and g0.op_counts()["Mul"] == 2
    assert folded.op_counts() == {"Add": 3, "Erf": 1, "MatMul": 5, "Mul": 1, "Reshape": 2, "Softmax": 1,
                                  "Transpose": 2}
    _same_outputs(g0, folded)


def test_attention_scale_folds_after_the_qkv_merge():
    """Merging Q/K/V first (each merge pays at once) hides K's weight behind Splits; the split-weight rules still
    fold the attention scale into K's block of the merged weight: the same outputs, no Div left once folded. The
    nested-Split rule is also searched over the whole graph, where other ops produce what it reads (no crash)."""
    from rlflow.graph.builder import GraphBuilder
    from rlflow.graph.fold import fold_constants
    from rlflow.rewrite.matcher import apply, find_matches

    rng = np.random.default_rng(1)
    w = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    b = GraphBuilder("attn-merged")
    x = b.input("x", (1, 6, 8))
    heads = lambda v, perm: b.op("Transpose", [b.op("Reshape", [v], shape=(1, 6, 2, 4))], perm=perm)  # noqa: E731
    proj = lambda n: b.op("Add", [b.op("MatMul", [x, b.const(f"w{n}", w(8, 8))]), b.const(f"b{n}", w(8))])  # noqa: E731
    q, k, v = heads(proj("q"), (0, 2, 1, 3)), heads(proj("k"), (0, 2, 3, 1)), heads(proj("v"), (0, 2, 1, 3))
    scores = b.op("Div", [b.op("MatMul", [q, k]), b.const("sqrt_d", np.array(2.0, np.float32))])
    g0 = b.build([b.op("MatMul", [b.op("Softmax", [scores], axis=3), v])])

    merge = RULES["b-matmul-merge"][0]
    g = apply(g0, find_matches(g0, merge)[0])             # two of Q, K, V -> one MatMul and a Split
    g = apply(g, find_matches(g, merge)[0])               # and the third: a Split of a Split
    assert g.op_counts()["MatMul"] == 3 and g.op_counts()["Split"] == 2
    g = _apply_all(g, "b-div-scalar-matmul-r", 1)
    g = _apply_all(g, "b-div-scalar-transpose", 1)
    g = _apply_all(g, "b-div-scalar-reshape", 1)
    g = _apply_all(g, "b-div-scalar-add-const", 1)
    assert all(find_matches(g, RULES[r][0]) == [] for r in SPLIT_SCALE_RULES if not r.endswith(("weight-01", "weight-11")))
    inner = next(r for r in ("b-div-scalar-split2-weight-01", "b-div-scalar-split2-weight-11")
                 if find_matches(g, RULES[r][0]))
    g = _apply_all(g, inner, 1)
    _same_outputs(g0, g)
    folded = fold_constants(g)
    assert "Div" not in folded.op_counts() and folded.op_counts()["MatMul"] == 3
    _same_outputs(g0, folded)


def test_head_split_rule_is_the_three_steps_at_once():
    """b-div-scalar-head-split moves attention's scale across a biased projection's head split in one step, to the
    same graph the three single steps (through Transpose, through Reshape, over the constant Add) reach."""
    from rlflow.graph.builder import GraphBuilder

    rng = np.random.default_rng(2)
    b = GraphBuilder("heads")
    x = b.input("x", (1, 6, 8))
    t = b.op("MatMul", [x, b.const("wk", rng.standard_normal((8, 8)).astype(np.float32))])
    k = b.op("Transpose", [b.op("Reshape", [b.op("Add", [t, b.const("bk", rng.standard_normal(8).astype(np.float32))])],
                                shape=(1, 6, 2, 4))], perm=(0, 2, 3, 1))
    g0 = b.build([b.op("Div", [k, b.const("sqrt_d", np.array(2.0, np.float32))])])
    one = _apply_all(g0, "b-div-scalar-head-split", 1)
    three = _apply_all(_apply_all(_apply_all(g0, "b-div-scalar-transpose", 1), "b-div-scalar-reshape", 1),
                       "b-div-scalar-add-const", 1)
    from rlflow.graph.fold import fold_constants

    assert fold_constants(one).op_counts() == fold_constants(three).op_counts()
    _same_outputs(g0, one)
    folded = _apply_all(one, "b-div-scalar-matmul-r", 1)
    _same_outputs(g0, folded)
