"""The fused-kernel rules (:func:`rlflow.rewrite.builtin.fused_kernel_rules`): the primitive attention patterns to
ONNX's ``Attention`` and back. Each verifies (float64, its examples and random bindings around them), agrees at
random shapes (hypothesis), is rejected (never wrong) where the fused op would compute something else, applies to a
small graph with equal outputs on torch and onnxruntime, fires only in graphs of opset >= 23 (``min_opset``, in
the matcher, the incremental index and eqsat), fuses every attention block of the zoo's bert, vit and gpt2 and of
Hugging Face-style BERT, ViT and GPT-2 exports, and a broken variant of each kind (wrong scale, mask on the wrong side,
K's transpose missing) is caught by the verifier."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.errors import RLFlowError
from rlflow.graph import GraphBuilder, load_onnx
from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff
from rlflow.rewrite.builtin import (ATTENTION_OPSET, builtin_rules, check_rule, compare, fused_kernel_rules,
                                    verified_builtin_rules)
from rlflow.rewrite.matcher import MatchIndex, apply, find_matches
from rlflow.rewrite.rule import rule_from_json
from rlflow.rewrite.verify import verify

RULES = {r.id: (r, ex) for r, ex in fused_kernel_rules()}
FUSE = [rid for rid in RULES if rid.startswith("b-attn-fuse-")]
HYP = settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def ok(got, tol: float = 1e-9) -> bool:
    return isinstance(got, float) and got <= tol


def sound(got) -> bool:
    return got in ("no-match", "rejected") or ok(got)


def mutate(rid: str, fn):
    raw = copy.deepcopy(RULES[rid][0].to_json())
    fn(raw)
    return rule_from_json(raw, "mutated")


def shapes_for(rid: str, b, h, sq, skv, d, dv, mask=None, s=()) -> dict:
    """A binding of fuse rule ``rid``'s variables for Q (b, h, sq, d), K/V of skv keys, V's head size dv."""
    kform = rid.split("-")[3]
    k = {"kt": {"kt": [b, h, d, skv]}, "t": {"k": [b, h, skv, d]}, "bshd": {"k": [b, skv, h, d]}}[kform]
    out = {"q": [b, h, sq, d], **k, "v": [b, h, skv, dv]}
    if "-mul" in rid or "-div" in rid:
        out["s"] = list(s)
    if rid.endswith("-mask"):
        out["m"] = mask
    return out


# ============================================================================================ the family
def test_family_and_opset_constraint():
    assert len(FUSE) == 18 and set(RULES) - set(FUSE) == {"b-attn-unfuse", "b-attn-unfuse-mask"}
    for rid, (rule, _) in RULES.items():
        assert rule.min_opset == (ATTENTION_OPSET if rid in FUSE else 0)
        assert rule_from_json(json.loads(json.dumps(rule.to_json())), "x") == rule
    # opt-in: the default builtin set is unchanged, the family comes last
    assert not any(r.id.startswith("b-attn") for r, _ in builtin_rules())
    both = [r.id for r, _ in builtin_rules(bias_fusion=True, fused_kernels=True)]
    assert both[-len(RULES):] == list(RULES)
    bad = RULES[FUSE[0]][0].to_json()
    bad["constraints"]["min_opset"] = "23"
    with pytest.raises(RLFlowError, match="min_opset must be a non-negative integer"):
        rule_from_json(bad, "x")


@pytest.mark.parametrize("rid", list(RULES))
def test_examples_and_random_bindings_verify(rid):
    rule, examples = RULES[rid]
    assert check_rule(rule, examples)["max_rel_diff"] <= 1e-9
    assert verify(rule, trials=len(examples) + 3, examples=examples) is not None


def test_verified_records():
    rules = [r for r in verified_builtin_rules(fused_kernels=True) if r.id in RULES]
    assert len(rules) == len(RULES)
    for r in rules:
        assert r.verified["method"] == "random-float64" and r.verified["examples"] == RULES[r.id][1]


# ============================================================================================ property tests
@pytest.mark.parametrize("rid", FUSE)
@HYP
@given(b=st.integers(1, 2), h=st.integers(1, 3), sq=st.integers(1, 4), skv=st.integers(1, 4), d=st.integers(1, 4),
       dv=st.integers(1, 4), data=st.data())
def test_fuse_shapes(rid, b, h, sq, skv, d, dv, data):
    rule = RULES[rid][0]
    mask = data.draw(st.sampled_from([[b, 1, 1, skv], [1, 1, sq, skv], [sq, skv], [skv], [b, h, sq, skv], []]))
    s = data.draw(st.sampled_from([[], [1], [1, 1, 1, 1]]))
    assert ok(compare(rule, shapes_for(rid, b, h, sq, skv, d, dv, mask, s), {}))
    # never wrong where the fused op would differ: a per-key scale, a mask that grows the scores, batches that
    # MatMul broadcasts, K/V with another head count
    if "-mul" in rid or "-div" in rid:
        assert sound(compare(rule, shapes_for(rid, b, h, sq, skv, d, dv, mask, [1, 1, 1, skv]), {}))
    if rid.endswith("-mask"):
        assert sound(compare(rule, shapes_for(rid, b, h, sq, skv, d, dv, [2, b, h, sq, skv], s), {}))
    grown = shapes_for(rid, b, h, sq, skv, d, dv, mask, s)
    grown["q"] = [b + 1, h, sq, d]
    assert sound(compare(rule, grown, {}))
    grown["q"] = [b, h + 1, sq, d]
    assert sound(compare(rule, grown, {}))


@pytest.mark.parametrize("rid", ["b-attn-unfuse", "b-attn-unfuse-mask"])
@HYP
@given(b=st.integers(1, 2), h=st.integers(1, 3), sq=st.integers(1, 4), skv=st.integers(1, 4), d=st.integers(1, 4),
       dv=st.integers(1, 4), sc=st.sampled_from([1.0, 0.125, 0.5]), data=st.data())
def test_unfuse_shapes(rid, b, h, sq, skv, d, dv, sc, data):
    rule = RULES[rid][0]
    hkv = data.draw(st.sampled_from([h, 1]))  # one K/V head serving every query head: MatMul broadcasts it
    shapes = {"q": [b, h, sq, d], "k": [b, hkv, skv, d], "v": [b, hkv, skv, dv]}
    if rid.endswith("-mask"):
        shapes["m"] = data.draw(st.sampled_from([[b, 1, 1, skv], [sq, skv], [1, h, sq, skv]]))
    assert ok(compare(rule, shapes, {"sc": sc}))
    if h > 1:  # grouped heads MatMul cannot broadcast: rejected
        assert compare(rule, {**shapes, "q": [b, 2 * h, sq, d], "k": [b, h, skv, d], "v": [b, h, skv, dv]},
                       {"sc": sc}) in ("rejected", "no-match")


def _block(kform: str, scale: str, mask: bool, b, h, sq, skv, d, dv, opset: int = ATTENTION_OPSET):
    """A small graph with one attention block as an exporter writes it (weights as constants), plus a reader of
    Q so the graph has more than the pattern."""
    rng = np.random.default_rng(0)
    g = GraphBuilder("attn", opset=opset)
    q = g.input("q", [b, h, sq, d])
    v = g.input("v", [b, h, skv, dv])
    if kform == "kt":
        kt = g.op("Mul", [g.input("k", [b, h, d, skv]), g.const("ks", np.float32(0.5))])
    elif kform == "t":
        kt = g.op("Transpose", [g.input("k", [b, h, skv, d])], perm=(0, 1, 3, 2))
    else:
        kt = g.op("Transpose", [g.input("k", [b, skv, h, d])], perm=(0, 2, 3, 1))
    x = g.op("MatMul", [q, kt])
    if scale != "none":
        x = g.op(scale, [x, g.const("s", np.asarray([np.sqrt(d)], np.float32))])
    if mask:
        m = np.where(rng.random((b, 1, 1, skv)) < 0.3, -1e4, 0.0).astype(np.float32)
        x = g.op("Add", [x, g.const("m", m)])
    p = g.op("Softmax", [x], axis=3)
    y = g.op("MatMul", [p, v])
    return g.build([y, g.op("Relu", [q])])


@HYP
@given(kform=st.sampled_from(["kt", "t", "bshd"]), scale=st.sampled_from(["none", "Mul", "Div"]),
       mask=st.booleans(), b=st.integers(1, 2), h=st.integers(1, 3), sq=st.integers(1, 5), skv=st.integers(1, 5),
       d=st.integers(1, 5), dv=st.integers(1, 5))
def test_rule_applies_to_a_graph_with_equal_outputs(kform, scale, mask, b, h, sq, skv, d, dv):
    graph = _block(kform, scale, mask, b, h, sq, skv, d, dv)
    rid = f"b-attn-fuse-{kform}-{scale.lower()}{'-mask' if mask else ''}"
    rules = [r for r, _ in fused_kernel_rules()]
    hits = {r.id: find_matches(graph, r) for r in rules if r.id in FUSE}
    assert len(hits[rid]) == 1
    fused = apply(graph, hits[rid][0])
    assert [n.op for n in fused.nodes].count("Attention") == 1 and "Softmax" not in [n.op for n in fused.nodes]
    feeds = make_inputs(graph, 0)
    want = get_runner(graph, "torch")(feeds)
    for backend in ("torch", "ort"):
        assert max_rel_diff(want, get_runner(fused, backend)(feeds)) < 1e-5, backend
    # and back: the unfused graph computes the same
    back = [m for r in rules if r.id.startswith("b-attn-unfuse") for m in find_matches(fused, r)]
    assert len(back) == 1
    assert max_rel_diff(want, get_runner(apply(fused, back[0]), "torch")(feeds)) < 1e-5
    # below opset 23 nothing fuses
    low = _block(kform, scale, mask, b, h, sq, skv, d, dv, opset=18)
    assert not any(find_matches(low, r) for r in rules if r.id in FUSE)


# ============================================================================================ opset
def test_min_opset_in_the_index_and_eqsat():
    from rlflow.cost.model import AnalyticCost
    from rlflow.search.eqsat import eqsat_search

    rules = [r for r, _ in fused_kernel_rules()]
    for opset, want in ((18, 0), (22, 0), (23, 1), (28, 1)):
        g = _block("t", "Div", True, 1, 2, 3, 3, 2, 2, opset=opset)
        counts = dict(zip([r.id for r in rules], MatchIndex(g, rules).counts()))
        assert counts["b-attn-fuse-t-div-mask"] == counts["b-attn-fuse-kt-div-mask"] == want
        assert sum(counts.values()) == 2 * want
        res = eqsat_search(g, rules, AnalyticCost("cpu"), iter_limit=3, time_limit_s=30)
        assert [n.op for n in res.graph.nodes].count("Attention") == want


# ============================================================================================ broken variants
def _wrong_scale(raw):  # the scale multiplies Q where the scores were divided by it
    raw["dst"][1]["op"] = "Mul"


def _mask_after_softmax(raw):  # src: the mask added to the probabilities (after the Softmax), dst unchanged
    src = raw["src"]
    add, sm = src[2], src[3]
    src[2] = {**sm, "inputs": ["%1"]}
    src[3] = {**add, "inputs": ["%2", "m"]}


def _k_not_transposed(raw):  # the target forgets to transpose K^T back (fits when D == Skv)
    raw["dst"] = [n for n in raw["dst"] if n["op"] != "Transpose"]
    raw["dst"][-1]["inputs"][1] = "kt"
    raw["outputs"] = [[raw["outputs"][0][0], f"%{len(raw['dst']) - 1}"]]


BROKEN = {
    "b-attn-fuse-t-div-mask": (_wrong_scale, shapes_for("b-attn-fuse-t-div-mask", 1, 2, 3, 4, 3, 2, [1, 1, 1, 4])),
    "b-attn-fuse-t-none-mask": (_mask_after_softmax,
                                shapes_for("b-attn-fuse-t-none-mask", 1, 2, 3, 4, 3, 2, [1, 1, 3, 4])),
    "b-attn-fuse-kt-mul": (_k_not_transposed, shapes_for("b-attn-fuse-kt-mul", 1, 2, 3, 4, 4, 2, s=[])),
    "b-attn-unfuse-mask": (lambda raw: raw["dst"].__setitem__(4, {**raw["dst"][4], "inputs": ["%2", "m"]}),
                           {"q": [1, 2, 3, 4], "k": [1, 2, 5, 4], "v": [1, 2, 5, 3], "m": [1, 1, 1, 5]}),
}


@pytest.mark.parametrize("rid", list(BROKEN))
def test_broken_variant_fails(rid):
    fn, shapes = BROKEN[rid]
    broken = mutate(rid, fn)
    params = RULES[rid][1][0]["params"]
    examples = [{"vars": shapes, "params": params}]
    with pytest.raises(RLFlowError, match=rf"rule '{rid}': example 0 .*outputs differ"):
        check_rule(broken, examples, trials=1)
    assert verify(RULES[rid][0], trials=3, examples=examples) is not None
    assert verify(broken, trials=3, examples=examples) is None


# ============================================================================================ real exports
@pytest.mark.parametrize("model", ["bert", "vit", "gpt2"])
def test_zoo_attention_blocks_fuse(tmp_path, model):
    """Greedy search (analytic target) with the fused family fuses every attention block of the zoo's bert, vit
    and gpt2 exported at opset 23 (the pipeline's ``export.opset: 23``) with equal outputs on onnxruntime; gpt2's
    multiplicative causal mask (``scores * tril - 1e10 * (1 - tril)``) is made additive by the importer
    (tests/test_additive_masks.py)."""
    from rlflow.cost.model import AnalyticCost
    from rlflow.graph.exec.check import check_equal
    from rlflow.graph.zoo import TINY_SIZES, export_model
    from rlflow.search.common import finish
    from rlflow.search.greedy import greedy_search

    path = tmp_path / f"{model}.onnx"
    export_model(model, path, TINY_SIZES[model], opset=ATTENTION_OPSET)
    g = load_onnx(path)
    assert g.opset == ATTENTION_OPSET
    rules = [r for r, _ in fused_kernel_rules()]
    out, _ = finish(greedy_search(g, rules, AnalyticCost("cpu")).graph, AnalyticCost("cpu"))
    ops = [n.op for n in out.nodes]
    assert ops.count("Attention") == 2 and ops.count("Softmax") == 0
    assert check_equal(g, out, tol=1e-4) <= 1e-4


@pytest.mark.parametrize("family,rid", [("bert", "b-attn-fuse-kt-none-mask"), ("vit", "b-attn-fuse-kt-none"),
                                        ("gpt2", "b-attn-fuse-kt-none-mask")])
def test_hugging_face_exports_fuse(tmp_path, family, rid):
    """torch.onnx of Hugging Face's BertModel / ViTModel / GPT2Model (random weights): SDPA decomposed into Q and
    K^T each scaled by sqrt(scale), an additive mask (BERT's padding mask, GPT-2's causal one), Softmax (GPT-2's
    guarded by ``Where(IsNaN(p), 0, p)``, which :func:`rlflow.graph.fold.at_opset` drops), MatMul V; every block
    fuses, outputs equal."""
    sys.path.insert(0, str(Path(__file__).parent))
    from hf_exports import export

    from rlflow.graph.exec.check import check_equal
    from rlflow.graph.fold import at_opset

    orig = load_onnx(export(family, "small", tmp_path / f"{family}.onnx"))
    rule, g, n = RULES[rid][0], at_opset(orig, ATTENTION_OPSET), 0
    while find_matches(g, rule):
        g, n = apply(g, find_matches(g, rule)[0]), n + 1
    assert n == 2  # both layers
    assert [x.op for x in g.nodes].count("Attention") == 2 and "Softmax" not in [x.op for x in g.nodes]
    assert check_equal(orig, g, tol=1e-4) <= 1e-4


def test_the_pipeline_exports_at_the_configured_opset():
    """``export.opset`` takes what torch's exporter writes (up to 25: 23 defines Attention); beyond, the config
    is refused before any stage runs."""
    from rlflow.config import load_config

    root = Path(__file__).resolve().parents[1]
    assert load_config([root / "config.yaml"], ["export.opset=23"])["export"]["opset"] == 23
    with pytest.raises(RLFlowError, match="export.opset"):
        load_config([root / "config.yaml"], ["export.opset=26"])


# ============================================================================================ rlflow optimize --opset
def test_optimize_opset_lets_attention_fuse(tmp_path, capsys):
    """``rlflow optimize --opset 23`` with a rules file holding the fused family writes an opset-23 model with
    ONNX's Attention (equal outputs: optimize's own check on onnxruntime); without --opset the model keeps opset
    18 and nothing fuses; --opset below the model's is a one-line error."""
    import onnx

    from rlflow.cli import main
    from rlflow.graph.zoo import TINY_SIZES, export_model
    from rlflow.rewrite.rule import rules_document

    model, rules = tmp_path / "bert.onnx", tmp_path / "rules.json"
    export_model("bert", model, TINY_SIZES["bert"])
    fused = [r for r in verified_builtin_rules(fused_kernels=True) if r.id in RULES]
    rules.write_text(json.dumps(rules_document(fused, {"builtin": True, "fused_kernels": True})))
    common = ["--rules", str(rules), "--method", "greedy", "--target", "analytic", "--no-speed-check"]
    for opset, attention in ((None, 0), (23, 2)):
        out = tmp_path / f"out{opset}.onnx"
        assert main(["optimize", str(model), "--out", str(out), *common,
                     *(["--opset", str(opset)] if opset else [])]) == 0
        proto = onnx.load(str(out))
        assert proto.opset_import[0].version == (opset or 18)
        assert [n.op_type for n in proto.graph.node].count("Attention") == attention
    capsys.readouterr()
    assert main(["optimize", str(model), "--out", str(tmp_path / "x.onnx"), *common, "--opset", "17"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--opset 17" in err[0] and "opset 18" in err[0]
    assert not (tmp_path / "x.onnx").exists()
    # the Python API: opset= the same way, the caller's graph untouched
    import rlflow

    g = load_onnx(model)
    out = rlflow.optimize(g, rules=rules, method="greedy", target="analytic", speed_check=False, opset=23)
    assert g.opset == 18 and out.opset == 23 and [n.op for n in out.nodes].count("Attention") == 2
