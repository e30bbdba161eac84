"""Hand-written ("builtin") rules: substitutions the generator cannot find, written as data in the rule format of
:mod:`rlflow.rewrite.rule`.

The generator enumerates small graphs over TASO-style operator templates (stride-1 "same" convolutions, no bias,
no BatchNormalization, no Gemm), so it cannot produce the rules real exported models need most: fusing a ReLU or
a BatchNormalization into the preceding convolution, folding a constant scale into conv weights, merging parallel
convolutions or matmuls of any stride/padding, fusing MatMul+Add into Gemm, folding chains of constant
additions, and average pooling as a convolution with a constant pooling kernel. Each rule here is
parameterised (``$s`` strides, ``$p`` pads, ``$g`` group, ``$a`` activation, ...) so it applies to real models,
and carries two or more example instantiations ``{"vars": {name: shape}, "params": {name: value}}`` that the
verifier runs.

The rules (``b-conv-bias-*`` is the same rule for a Conv with a bias input):

- ``b-conv-relu``: Conv(activation none) + Relu -> Conv(activation relu);
- ``b-conv-bn``: Conv + BatchNormalization -> Conv with w * s and (b - mean) * s + beta, s = scale/sqrt(var+eps),
  computed by target ops on the constants (folded after a search);
- ``b-conv-mul-c4`` / ``-c3`` / ``-scalar``: Conv * c, c of shape (1,O,1,1) / (O,1,1) / one element -> the scale
  folded into the weights (and bias); ``b-conv-add-bias``: Conv + c, c (1,O,1,1) -> c as (added) bias;
- ``b-conv-enlarge-merge``: two "same" convs of different kernel sizes on one input -> one conv (the smaller
  kernel zero-padded by Enlarge) and a Split; ``b-conv-merge``: two convs with equal parameters -> one + Split;
- ``b-conv[-bias]-sum-concat[-relu]``: conv(x1, w1) + conv(x2, w2) [then Relu] -> one conv over Concat(x1, x2)
  and Concat(w1, w2) [with fused ReLU]; ``b-conv[-bias]-group-merge``: two convs on different inputs -> one grouped
  conv (twice the groups) over the concatenated inputs and kernels, and a Split;
- ``b-matmul-merge``: x @ w0, x @ w1 -> Split(x @ Concat(w0, w1)); ``b-matmul-add-gemm``: MatMul + Add -> Gemm;
- ``b-add/mul-assoc``, ``b-add-const-pair``: element-wise chains (below);
- ``b-avgpool-conv-3x3`` / ``-2x2`` (``-nopad``): AveragePool -> depthwise Conv with a constant pooling kernel;
- ``b-{mul,div}-scalar-*``: a one-element scale (attention's, GELU's) moved to a weight, one step at a time, also
  through a merged MatMul's Split (``-split-weight-*``, ``-split2-weight-*``);
- bias fusion, only with config ``rules.bias_fusion: true`` (:func:`bias_fusion_rules`): ``b-matmul-add-gemm-3d``:
  MatMul + Add -> Gemm for 3-D activations, flattened to 2-D around it; ``b-split-add-merge``: Split(y)[j] + c_j
  -> Split(y + Concat(c0, c1)), which brings merged Q/K/V's biases in front of the Split, to the Gemm. Off by
  default: on vit they double every method's simulated gain, but the agents' route then needs ~156 rewrites, more
  than the 100-step horizon, and TASO keeps most of it (docs/results-history.md, "Bias fusion").

**Soundness over every binding.** The matcher binds a variable to any value and accepts a match when the target
pattern's shape inference succeeds and its output types equal the source's. So each target is written to fail
shape inference (or change an output type) for every binding where it would compute something else:

- a constant that scales or shifts per output channel must have exactly shape ``(1,O,1,1)`` (or ``(O,1,1)``):
  ``Split(c, axis=1, split=[O])`` pins ``c.shape[1] == O``, ``Enlarge(kernel=[1,1])`` pins rank 4 with unit
  spatial dims, and ``Reshape(shape=[O,1,1,1])`` pins the element count (for ``(O,1,1)``: ``Transpose(perm=
  [0,1,2])`` pins rank 3, ``Split`` axis 0, then the count), so e.g. a ``(O,)`` constant (which broadcasts along
  the *width*) or an ``(N,1,1,1)`` one (along the batch) is never folded. These checks are shape-only
  identities on constants: the search's final constant folding removes them;
- weights are concatenated only with ``group`` literal 1 (concatenating grouped kernels would re-group channels),
  except in the grouped-conv merge, which doubles the group count and pins equal output channels;
- a merged MatMul concatenates its weights and splits its product on their *last* axes, computed with ``rank``
  expressions, so the rule is right for 1-D, 2-D, 3-D and batched operands alike;
- average pooling becomes a depthwise conv with a constant ``1/(kh*kw)`` kernel only where every window divides by
  ``kh*kw`` (``count_include_pad=1``, or no padding) and not in ceil mode;
- Gemm's own shape inference requires 2-D operands, and a bias that would broadcast the output to a larger shape
  changes the output type, so the match is rejected.

**Element-wise chains.** Associativity of Add and Mul, ``(x + y) + z -> x + (y + z)`` at any rank (the generator
emits it only at its symbolic ranks: a generated rule binds only the ranks it was verified at), puts two constants
side by side (``(x + c0) + c1 -> x + (c0 + c1)``), so the search's constant folding turns two runtime additions into
one; ``Add(Add(x, c0), Add(y, c1)) -> Add(Add(x, y), Add(c0, c1))`` does the same for two branches that each add a
constant before they meet (e.g. two biases before a residual sum): three runtime Adds become two. Broadcasting is
associative and commutative, so the targets infer the same shape as the sources whenever the sources are valid. No
rule here swaps operands or mirrors another's operand order: the matcher binds a commutative op's operands in
either order.

Verification: :func:`verified_builtin_rules` (what the generate_rules stage calls) fills each rule's
``verified`` record with :func:`rlflow.rewrite.verify.verify` (every example must fit and agree in float64, plus
random bindings drawn around them) at the verifier's default tolerance (1e-9), which every rule here meets: no
target makes a constant that float32 cannot hold exactly (the 1/9 pooling kernel is ones / 9).
:func:`check_rule` / :func:`compare` check a rule at given bindings; :func:`check_rule` names the example that
fails when a rule does not verify.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from rlflow.errors import RLFlowError
from rlflow.graph.ir import Constant, Graph, TensorType
from rlflow.graph.ops.attention import ATTENTION_OPSET
from rlflow.rewrite.rule import Rule, instantiate, rule_from_json

Example = dict  # {"vars": {name: [dims]}, "params": {name: value}}

PENDING = {"method": "pending", "trials": 0}


# ================================================================================================ pattern helpers
def _n(op: str, inputs: Sequence[str], outputs: int = 1, **attrs: Any) -> dict:
    d = {"op": op, "inputs": list(inputs), "attrs": attrs}
    if outputs != 1:
        d["outputs"] = outputs
    return d


def _conv(x: str, w: str, b: str | None = None, *, strides: Any = "$s", pads: Any = "$p", group: Any = "$g",
          activation: Any = "none") -> dict:
    return _n("Conv", [x, w] + ([b] if b else []), strides=strides, pads=pads, group=group, activation=activation)


def _rule(rid: str, name: str, src: list, dst: list, outputs: list, const: Sequence[str] = (),
          examples: Sequence[Example] = (), min_opset: int = 0) -> tuple[Rule, list[Example]]:
    raw = {"id": rid, "name": name, "origin": "builtin", "src": src, "dst": dst, "outputs": outputs,
           "verified": dict(PENDING)}
    constraints = {**({"const": list(const)} if const else {}), **({"min_opset": min_opset} if min_opset else {})}
    if constraints:
        raw["constraints"] = constraints
    rule = rule_from_json(raw, "builtin rules")
    if len(examples) < 2:
        raise AssertionError(f"builtin rule {rid} needs at least two examples")
    return rule, [dict(e) for e in examples]


def _ex(params: Mapping[str, Any] | None = None, **shapes: Sequence[int]) -> Example:
    return {"vars": {k: list(v) for k, v in shapes.items()}, "params": dict(params or {})}


def _conv_params(s=(1, 1), p=(1, 1, 1, 1), g=1, **more) -> dict:
    return {"s": list(s), "p": list(p), "g": g, **more}


O = {"dim": ["w", 0]}  # the conv's output channels


def _channel_scale_4d(c: str, base: int) -> tuple[list, str]:
    """Target nodes that turn a (1,O,1,1) constant into (O,1,1,1), failing inference for any other shape.
    ``base`` is the index of the first node added; returns (nodes, reference to the (O,1,1,1) value)."""
    return ([_n("Split", [c], axis=1, split=[O]),                   # rank >= 2 and c.shape[1] == O
             _n("Enlarge", [f"%{base}"], kernel=[1, 1]),            # rank 4, unit spatial dims
             _n("Reshape", [f"%{base + 1}"], shape=[O, 1, 1, 1])],  # element count O, so c.shape[0] == 1
            f"%{base + 2}")


def _channel_scale_3d(c: str, base: int) -> tuple[list, str]:
    """The same for a (O,1,1) constant (it broadcasts against (N,O,H,W) along the channel axis)."""
    return ([_n("Transpose", [c], perm=[0, 1, 2]),                  # rank 3
             _n("Split", [f"%{base}"], axis=0, split=[O]),          # c.shape[0] == O
             _n("Reshape", [f"%{base + 1}"], shape=[O, 1, 1, 1])],  # element count O: the rest are 1
            f"%{base + 2}")


def _channel_scale_scalar(c: str, base: int) -> tuple[list, str]:
    """A one-element constant of any rank (0-D included) as a 0-D scalar."""
    return [_n("Reshape", [c], shape=[])], f"%{base}"


# ================================================================================================ the rules
def _conv_relu() -> list:
    out = []
    for bias in (False, True):
        b = "b" if bias else None
        ex = [_ex(_conv_params(), x=[1, 3, 6, 6], w=[4, 3, 3, 3], **({"b": [4]} if bias else {})),
              _ex(_conv_params((2, 2), (0, 1, 1, 0), 2), x=[2, 4, 7, 5], w=[6, 2, 3, 1],
                  **({"b": [6]} if bias else {}))]
        out.append(_rule(
            f"b-conv{'-bias' if bias else ''}-relu", "conv-relu-fuse",
            [_conv("x", "w", b), _n("Relu", ["%0"])],
            [_conv("x", "w", b, activation="relu")],
            [["%1", "%0"]], examples=ex))
    return out


def _conv_bn() -> list:
    out = []
    for bias in (False, True):
        b = "b" if bias else None
        src = [_conv("x", "w", b), _n("BatchNormalization", ["%0", "scale", "bias", "mean", "var"], epsilon="$eps")]
        dst = [_n("Constant", [], value="$eps"),
               _n("Add", ["var", "%0"]),
               _n("Sqrt", ["%1"]),
               _n("Div", ["scale", "%2"]),                          # inv = scale / sqrt(var + eps), shape (O,)
               _n("Reshape", ["%3"], shape=[O, 1, 1, 1]),
               _n("Mul", ["w", "%4"])]                              # w' = w * inv per output channel
        if bias:
            dst += [_n("Sub", ["b", "mean"]), _n("Mul", ["%6", "%3"]), _n("Add", ["%7", "bias"]),  # (b-mean)*inv+bias
                    _conv("x", "%5", "%8")]
        else:
            dst += [_n("Mul", ["mean", "%3"]), _n("Sub", ["bias", "%6"]),                           # bias-mean*inv
                    _conv("x", "%5", "%7")]
        bn = lambda o: {"scale": [o], "bias": [o], "mean": [o], "var": [o]}  # noqa: E731
        ex = [_ex(_conv_params(eps=1e-5), x=[1, 3, 6, 6], w=[4, 3, 3, 3], **({"b": [4]} if bias else {}), **bn(4)),
              _ex(_conv_params((2, 2), (0, 0, 1, 1), 3, eps=1e-3), x=[2, 6, 5, 7], w=[9, 2, 1, 3],
                  **({"b": [9]} if bias else {}), **bn(9))]
        out.append(_rule(
            f"b-conv{'-bias' if bias else ''}-bn", "conv-bn-fold", src, dst, [["%1", f"%{len(dst) - 1}"]],
            const=["w"] + (["b"] if bias else []) + ["scale", "bias", "mean", "var"], examples=ex))
    return out


def _conv_mul() -> list:
    out = []
    shapes = {"c4": (_channel_scale_4d, lambda o: [1, o, 1, 1]),
              "c3": (_channel_scale_3d, lambda o: [o, 1, 1]),
              "scalar": (_channel_scale_scalar, None)}
    for kind, (check, cshape) in shapes.items():
        for bias in (False, True):
            b = "b" if bias else None
            nodes, cref = check("c", 0)
            k = len(nodes)
            if kind == "scalar":
                dst = nodes + [_n("ScalarMul", ["w", cref])]
                if bias:
                    dst += [_n("ScalarMul", ["b", cref])]
            else:
                dst = nodes + [_n("Mul", ["w", cref])]
                if bias:
                    dst += [_n("Reshape", [cref], shape=[O]), _n("Mul", ["b", f"%{k + 1}"])]
            dst += [_conv("x", f"%{k}", f"%{len(dst) - 1}" if bias else None)]

            def c_of(o, alt=False):
                if cshape:
                    return cshape(o)
                return [1, 1, 1, 1] if alt else []

            ex = [_ex(_conv_params(), x=[1, 3, 6, 6], w=[4, 3, 3, 3], c=c_of(4), **({"b": [4]} if bias else {})),
                  _ex(_conv_params((2, 2), (1, 0, 0, 1), 2), x=[2, 4, 7, 6], w=[6, 2, 3, 2], c=c_of(6, True),
                      **({"b": [6]} if bias else {}))]
            out.append(_rule(
                f"b-conv{'-bias' if bias else ''}-mul-{kind}", "conv-mul-fold",
                [_conv("x", "w", b), _n("Mul", ["%0", "c"])], dst, [["%1", f"%{len(dst) - 1}"]],
                const=["w"] + (["b"] if bias else []) + ["c"], examples=ex))
    return out


def _conv_add() -> list:
    """Conv(x, w[, b]) + c with c of shape (1,O,1,1) -> Conv with that (added) bias."""
    out = []
    for bias in (False, True):
        b = "b" if bias else None
        nodes, cref = _channel_scale_4d("c", 0)
        dst = nodes + [_n("Reshape", [cref], shape=[O])]
        if bias:
            dst += [_n("Add", ["b", "%3"])]
        dst += [_conv("x", "w", f"%{len(dst) - 1}")]
        ex = [_ex(_conv_params(), x=[1, 3, 6, 6], w=[4, 3, 3, 3], c=[1, 4, 1, 1], **({"b": [4]} if bias else {})),
              _ex(_conv_params((2, 1), (0, 1, 0, 1), 3), x=[2, 6, 5, 5], w=[3, 2, 1, 3], c=[1, 3, 1, 1],
                  **({"b": [3]} if bias else {}))]
        out.append(_rule(
            f"b-conv{'-bias' if bias else ''}-add-bias", "conv-add-bias-fold",
            [_conv("x", "w", b), _n("Add", ["%0", "c"])], dst, [["%1", f"%{len(dst) - 1}"]],
            const=["w"] + (["b"] if bias else []) + ["c"], examples=ex))
    return out


def _conv_enlarge_merge() -> list:
    """Two "same"-padded convs of different kernel sizes on one input -> one conv with the smaller kernel
    zero-padded (centred) to the larger, weights concatenated on the output-channel axis, output split."""
    out = []
    for bias in (False, True):
        b1, b2 = ("b1", "b2") if bias else (None, None)
        src = [_conv("x", "w1", b1, pads={"same_pads": "w1"}, group=1, activation="$a"),
               _conv("x", "w2", b2, pads={"same_pads": "w2"}, group=1, activation="$a")]
        dst = [_n("Enlarge", ["w2"], kernel={"kernel": "w1"}),
               _n("Concat", ["w1", "%0"], axis=0)]
        if bias:
            dst += [_n("Concat", ["b1", "b2"], axis=0)]
        dst += [_conv("x", "%1", "%2" if bias else None, pads={"same_pads": "w1"}, group=1, activation="$a")]
        j = len(dst) - 1
        dst += [_n("Split", [f"%{j}"], outputs=2, axis=1, split=[{"dim": ["w1", 0]}, {"dim": ["w2", 0]}])]
        bb = lambda o1, o2: {"b1": [o1], "b2": [o2]} if bias else {}  # noqa: E731
        ex = [_ex({"s": [1, 1], "a": "none"}, x=[1, 4, 6, 6], w1=[5, 4, 3, 3], w2=[3, 4, 1, 1], **bb(5, 3)),
              _ex({"s": [2, 2], "a": "relu"}, x=[2, 3, 7, 8], w1=[4, 3, 3, 3], w2=[2, 3, 1, 3], **bb(4, 2)),
              _ex({"s": [1, 2], "a": "relu"}, x=[1, 2, 9, 9], w1=[3, 2, 5, 5], w2=[4, 2, 3, 1], **bb(3, 4))]
        out.append(_rule(
            f"b-conv{'-bias' if bias else ''}-enlarge-merge", "conv-enlarge-merge", src, dst,
            [["%0", f"%{j + 1}.0"], ["%1", f"%{j + 1}.1"]],
            const=["w1", "w2"] + (["b1", "b2"] if bias else []), examples=ex))
    return out


def _conv_merge() -> list:
    """Two convs with equal parameters (any strides/pads, group 1) on one input -> one conv, output split."""
    out = []
    for bias in (False, True):
        b0, b1 = ("b0", "b1") if bias else (None, None)
        src = [_conv("x", "w0", b0, group=1, activation="$a"), _conv("x", "w1", b1, group=1, activation="$a")]
        dst = [_n("Concat", ["w0", "w1"], axis=0)]
        if bias:
            dst += [_n("Concat", ["b0", "b1"], axis=0)]
        dst += [_conv("x", "%0", "%1" if bias else None, group=1, activation="$a")]
        j = len(dst) - 1
        dst += [_n("Split", [f"%{j}"], outputs=2, axis=1, split=[{"dim": ["w0", 0]}, {"dim": ["w1", 0]}])]
        bb = lambda o1, o2: {"b0": [o1], "b1": [o2]} if bias else {}  # noqa: E731
        ex = [_ex({"s": [1, 1], "p": [1, 1, 1, 1], "a": "none"}, x=[1, 4, 6, 6], w0=[5, 4, 3, 3], w1=[3, 4, 3, 3],
                  **bb(5, 3)),
              _ex({"s": [2, 1], "p": [0, 1, 1, 0], "a": "relu"}, x=[2, 3, 7, 8], w0=[4, 3, 2, 3], w1=[2, 3, 2, 3],
                  **bb(4, 2))]
        out.append(_rule(
            f"b-conv{'-bias' if bias else ''}-merge", "conv-merge", src, dst,
            [["%0", f"%{j + 1}.0"], ["%1", f"%{j + 1}.1"]],
            const=["w0", "w1"] + (["b0", "b1"] if bias else []), examples=ex))
    return out


def _conv_sum_concat() -> list:
    """Two convs summed -> one conv over the inputs concatenated on the channel axis and the kernels on their
    input-channel axis: ``conv(x1, w1) + conv(x2, w2) = conv(concat(x1, x2), concat(w1, w2))`` (the output
    channel o reads x1's channels through w1[o] and x2's through w2[o]). ``-relu``: a ReLU after the sum becomes
    the merged conv's fused activation. Any strides and pads (equal on both convs), group 1; ``-bias``: the
    merged conv's bias is the sum of the two. The generator finds the plain form for stride-1 "same" convs of
    rank 4 (it has no bias and cannot reach the four-op ReLU source); these take any conv.

    Sound for every binding: the kernels concatenate on axis 1 only when their output channels and kernel sizes
    are equal, and the inputs on axis 1 only when their batch and spatial sizes are equal, so wherever the target
    type-checks the two convs give outputs of one shape and the source's Add does not broadcast."""
    out = []
    for relu in (False, True):
        for bias in (False, True):
            b1, b2 = ("b1", "b2") if bias else (None, None)
            src = [_conv("x1", "w1", b1, group=1), _conv("x2", "w2", b2, group=1), _n("Add", ["%0", "%1"])]
            if relu:
                src.append(_n("Relu", ["%2"]))
            dst = [_n("Concat", ["x1", "x2"], axis=1), _n("Concat", ["w1", "w2"], axis=1)]
            if bias:
                dst.append(_n("Add", ["b1", "b2"]))
            dst.append(_conv("%0", "%1", "%2" if bias else None, group=1, activation="relu" if relu else "none"))
            bb = lambda o: {"b1": [o], "b2": [o]} if bias else {}  # noqa: E731
            ex = [_ex(_conv_params(), x1=[1, 3, 6, 6], w1=[4, 3, 3, 3], x2=[1, 2, 6, 6], w2=[4, 2, 3, 3], **bb(4)),
                  _ex(_conv_params((2, 1), (0, 1, 1, 0)), x1=[2, 2, 7, 5], w1=[3, 2, 2, 3], x2=[2, 4, 7, 5],
                      w2=[3, 4, 2, 3], **bb(3))]
            out.append(_rule(
                f"b-conv{'-bias' if bias else ''}-sum-concat{'-relu' if relu else ''}", "conv-sum-as-one-conv",
                src, dst, [[f"%{len(src) - 1}", f"%{len(dst) - 1}"]],
                const=["w1", "w2"] + (["b1", "b2"] if bias else []), examples=ex))
    return out


def _conv_group_merge() -> list:
    """Two convs with equal parameters on different inputs -> one grouped conv (TASO's "merge group convs"):
    ``conv(x1, w1, g), conv(x2, w2, g) -> split(conv(concat(x1, x2), concat(w1, w2), 2g))`` (inputs on the channel
    axis, kernels on the output-channel axis): the first g groups read x1's channels with w1's kernels, the last
    g x2's with w2's. Any strides, pads, group and activation. Only for kernels with equal output channels: the
    output is split into two halves of w1's output channels, which fails shape inference unless w2 has as many
    (with unequal ones the merged conv's groups would mix the two kernels' output channels: a split at [O1, O2]
    type-checks and is wrong, the broken variant the tests show failing). Equal channels per group and kernel
    sizes are pinned by the kernels' concatenation, equal batch and spatial sizes by the inputs'."""
    out = []
    for bias in (False, True):
        b1, b2 = ("b1", "b2") if bias else (None, None)
        src = [_conv("x1", "w1", b1, activation="$a"), _conv("x2", "w2", b2, activation="$a")]
        dst = [_n("Concat", ["x1", "x2"], axis=1), _n("Concat", ["w1", "w2"], axis=0)]
        if bias:
            dst.append(_n("Concat", ["b1", "b2"], axis=0))
        dst.append(_conv("%0", "%1", "%2" if bias else None, group={"prod": [2, "$g"]}, activation="$a"))
        j = len(dst) - 1
        dst.append(_n("Split", [f"%{j}"], outputs=2, axis=1, split=[{"dim": ["w1", 0]}, {"dim": ["w1", 0]}]))
        bb = lambda o: {"b1": [o], "b2": [o]} if bias else {}  # noqa: E731
        ex = [_ex(_conv_params(a="none"), x1=[1, 3, 6, 6], w1=[4, 3, 3, 3], x2=[1, 3, 6, 6], w2=[4, 3, 3, 3],
                  **bb(4)),
              _ex(_conv_params((2, 1), (0, 1, 1, 0), 2, a="relu"), x1=[2, 4, 7, 5], w1=[6, 2, 2, 3],
                  x2=[2, 4, 7, 5], w2=[6, 2, 2, 3], **bb(6)),
              _ex(_conv_params((1, 1), (1, 1, 1, 1), 3, a="none"), x1=[1, 3, 5, 5], w1=[3, 1, 3, 3],
                  x2=[1, 3, 5, 5], w2=[3, 1, 3, 3], **bb(3))]
        out.append(_rule(
            f"b-conv{'-bias' if bias else ''}-group-merge", "conv-group-merge", src, dst,
            [["%0", f"%{j + 1}.0"], ["%1", f"%{j + 1}.1"]],
            const=["w1", "w2"] + (["b1", "b2"] if bias else []), examples=ex))
    return out


def _matmul_merge() -> list:
    """x @ w0, x @ w1 -> split(x @ concat(w0, w1)): weights concatenated on their last axis, the product split on
    its last axis (both computed from ranks, so one rule serves 2-D, 3-D (batch, sequence) and batched operands)."""
    last = lambda r: {"sum": [{"rank": r}, -1]}  # noqa: E731
    src = [_n("MatMul", ["x", "w0"]), _n("MatMul", ["x", "w1"])]
    dst = [_n("Concat", ["w0", "w1"], axis=last("w0")),
           _n("MatMul", ["x", "%0"]),
           # (the product's rank; "%1.0", the explicit form of "%1", is what the applier's type lookup takes)
           _n("Split", ["%1"], outputs=2, axis=last("%1.0"), split=[{"dim": ["w0", -1]}, {"dim": ["w1", -1]}])]
    ex = [_ex(None, x=[3, 4], w0=[4, 6], w1=[4, 3]), _ex(None, x=[2, 3, 4], w0=[4, 2], w1=[4, 7]),
          _ex(None, x=[4], w0=[4, 2], w1=[4, 3]), _ex(None, x=[3, 4], w0=[2, 4, 2], w1=[2, 4, 5])]
    return [_rule("b-matmul-merge", "matmul-merge", src, dst, [["%0", "%2.0"], ["%1", "%2.1"]],
                  const=["w0", "w1"], examples=ex)]


def _avgpool_conv() -> list:
    """AveragePool -> depthwise Conv with a constant kernel of 1/(kh*kw) (so it can merge with a parallel conv).
    Exact when every window divides by kh*kw: count_include_pad=1, or no padding; never in ceil mode. The kernel
    is ones / (kh*kw), two exactly representable constants divided (a static op, folded after a search), so the
    rule is exact in float64 too; there is one rule per kernel size (a Constant's value is a literal)."""
    out = []
    for kh, kw in ((3, 3), (2, 2)):
        for padded in (True, False):
            pads, cip = ("$p", 1) if padded else ([0, 0, 0, 0], "$c")
            src = [_n("AveragePool", ["x"], kernel=[kh, kw], strides="$s", pads=pads, ceil_mode=0,
                      count_include_pad=cip)]
            c = {"dim": ["x", 1]}
            dst = [{"op": "Constant", "inputs": [], "attrs": {"value": 1.0, "shape": [c, 1, kh, kw]}},
                   {"op": "Constant", "inputs": [], "attrs": {"value": float(kh * kw)}},
                   _n("Div", ["%0", "%1"]),
                   _conv("x", "%2", strides="$s", pads=pads, group=c)]
            if padded:
                ex = [_ex({"s": [1, 1], "p": [kh // 2, kw // 2, kh // 2, kw // 2]}, x=[1, 3, 6, 6]),
                      _ex({"s": [2, 2], "p": [1, 0, 0, 1]}, x=[2, 4, 7, 5])]
            else:
                ex = [_ex({"s": [1, 1], "c": 0}, x=[1, 3, 6, 6]), _ex({"s": [2, 1], "c": 1}, x=[2, 4, 7, 5])]
            out.append(_rule(f"b-avgpool-conv-{kh}x{kw}{'' if padded else '-nopad'}", "avgpool-as-conv",
                             src, dst, [["%0", "%3"]], examples=ex))
    return out


def _gemm() -> list:
    """MatMul(x, w) + b -> Gemm(x, w, b) for 2-D x and w, b broadcastable to the output (either Add order: the
    matcher binds a commutative op's operands in either order)."""
    gemm = _n("Gemm", ["x", "w", "b"], alpha=1.0, beta=1.0, transA=0, transB=0)
    ex = [_ex(None, x=[3, 4], w=[4, 5], b=[5]), _ex(None, x=[2, 3], w=[3, 4], b=[2, 1]),
          _ex(None, x=[2, 3], w=[3, 4], b=[2, 4]), _ex(None, x=[1, 3], w=[3, 2], b=[])]
    return [_rule("b-matmul-add-gemm", "matmul-add-gemm", [_n("MatMul", ["x", "w"]), _n("Add", ["%0", "b"])], [gemm],
                  [["%1", "%0"]], examples=ex)]


def _gemm_3d() -> list:
    """``b-matmul-add-gemm-3d``: MatMul(x, w) + b -> Gemm for a 3-D x of shape (B, M, K) (a transformer's
    batch x sequence x hidden activations), flattened to (B*M, K) around the Gemm and its (B*M, N) product
    reshaped back to (B, M, N). The Reshapes only re-view the data. Only 3-D x fits: the first Reshape reads
    axis 2 and keeps the element count only when x has no further axis (or a further axis of 1, where the
    product's type differs and the match is rejected); Gemm demands a 2-D w; and a bias that broadcasts per
    batch element or grows the output ((B, M, N), or (M, N) with B > 1) is not broadcastable to Gemm's
    (B*M, N), so it is rejected."""
    dim = lambda ref, axis: {"dim": [ref, axis]}  # noqa: E731
    flat = _n("Reshape", ["x"], shape=[{"prod": [dim("x", 0), dim("x", 1)]}, dim("x", 2)])
    gemm3 = _n("Gemm", ["%0", "w", "b"], alpha=1.0, beta=1.0, transA=0, transB=0)
    back = _n("Reshape", ["%1"], shape=[dim("x", 0), dim("x", 1), dim("w", 1)])
    ex = [_ex(None, x=[1, 3, 4], w=[4, 5], b=[5]), _ex(None, x=[2, 3, 4], w=[4, 2], b=[1, 2]),
          _ex(None, x=[1, 3, 2], w=[2, 4], b=[3, 4]), _ex(None, x=[2, 2, 3], w=[3, 2], b=[])]
    return [_rule("b-matmul-add-gemm-3d", "matmul-add-gemm", [_n("MatMul", ["x", "w"]), _n("Add", ["%0", "b"])],
                  [flat, gemm3, back], [["%1", "%2"]], examples=ex)]


def _split_add_merge() -> list:
    """``b-split-add-merge``: a constant added to each output of a two-way Split of a value's last axis ->
    one Add of the two constants concatenated, before the Split: ``Split(y)[j] + c_j -> Split(y + Concat(c0,
    c1))[j]``, one launch fewer. It follows the Q/K/V MatMul merge (each projection's bias sits behind the
    Split), after which the merged product's bias can join it as a Gemm (``b-matmul-add-gemm-3d``). The
    constants are concatenated on their last axis, so each must span its block of y's last axis: a constant
    that broadcasts along that axis (length 1 for a block longer than 1) makes the concatenation too short for
    y, which fails shape inference; leading axes broadcast as before (a constant of higher rank grows both
    sides alike)."""
    last = lambda r: {"sum": [{"rank": r}, -1]}  # noqa: E731
    src = [_n("Split", ["y"], outputs=2, axis=last("y"), split="$sp"),
           _n("Add", ["%0.0", "c0"]), _n("Add", ["%0.1", "c1"])]
    dst = [_n("Concat", ["c0", "c1"], axis=last("c0")), _n("Add", ["y", "%0"]),
           _n("Split", ["%1"], outputs=2, axis=last("%1.0"), split="$sp")]
    ex = [_ex({"sp": [2, 3]}, y=[2, 4, 5], c0=[2], c1=[3]), _ex({"sp": [1, 2]}, y=[3, 3], c0=[1], c1=[2]),
          _ex({"sp": [2, 2]}, y=[3, 4], c0=[3, 2], c1=[3, 2]), _ex({"sp": [3, 1]}, y=[4], c0=[2, 3], c1=[2, 1])]
    return [_rule("b-split-add-merge", "split-add-merge", src, dst, [["%1", "%2.0"], ["%2", "%2.1"]],
                  const=["c0", "c1"], examples=ex)]


def _elementwise_chains() -> list:
    out = []
    ex3 = [_ex(None, x=[2, 3, 4], y=[4], z=[3, 1]), _ex(None, x=[5], y=[], z=[5]),
           _ex(None, x=[2, 1, 4], y=[1, 3, 1], z=[2, 3, 4])]
    for op in ("Add", "Mul"):
        lo = op.lower()
        out.append(_rule(f"b-{lo}-assoc", f"{lo}-associativity", [_n(op, ["x", "y"]), _n(op, ["%0", "z"])],
                         [_n(op, ["y", "z"]), _n(op, ["x", "%0"])], [["%1", "%1"]],
                         examples=ex3))
    out.append(_rule("b-add-const-pair", "add-const-pair-fold",
                     [_n("Add", ["x", "c0"]), _n("Add", ["y", "c1"]), _n("Add", ["%0", "%1"])],
                     [_n("Add", ["x", "y"]), _n("Add", ["c0", "c1"]), _n("Add", ["%0", "%1"])],
                     [["%2", "%2"]], const=["c0", "c1"],
                     examples=[_ex(None, x=[2, 3], c0=[3], y=[2, 3], c1=[3]),
                               _ex(None, x=[2, 1, 4], c0=[], y=[3, 1], c1=[1, 3, 4])]))
    return out


def _scalar_mul() -> list[tuple[Rule, list[Example]]]:
    """Mul by a 0-D constant <-> TASO's ScalarMul. Imported models spell a scalar product ``Mul(x, c)``; the
    generated ScalarMul rules match only ``ScalarMul``, so these two rules connect them. ScalarMul's shape
    inference demands a 0-D scalar, so a Mul by anything else is never converted."""
    ex = [_ex(None, x=[2, 3], s=[]), _ex(None, x=[1, 4, 3, 3], s=[]), _ex(None, x=[5], s=[])]
    return [_rule("b-mul-to-scalarmul", "mul-by-0d-constant-as-scalarmul", [_n("Mul", ["x", "s"])],
                  [_n("ScalarMul", ["x", "s"])], [["%0", "%0"]], const=["s"], examples=ex),
            _rule("b-scalarmul-to-mul", "scalarmul-as-mul", [_n("ScalarMul", ["x", "s"])],
                  [_n("Mul", ["x", "s"])], [["%0", "%0"]], examples=ex)]


def _scalar_scale() -> list:
    """A product or quotient by a one-element constant ``s`` (attention's 1/sqrt(d), GELU's 0.5) moved along the
    graph until it reaches a weight, where the search's constant folding removes it: one launch fewer per scale.
    ``S`` below is ``Reshape(s, shape=[])``, which fails shape inference unless ``s`` has exactly one element, so a
    per-channel constant is never moved; a one-element ``s`` of higher rank that would broadcast the source's
    output to more dimensions changes the output type, so the match is rejected. For ``op`` in Mul and Div
    (``x op S``):

    - ``b-{op}-scalar-matmul-r`` / ``-l``: (a @ b) op s -> a @ (b op S) / (a op S) @ b;
    - ``b-{op}-scalar-across-matmul``: (a op s) @ b -> a @ (b op S) (where b is a weight, it folds);
    - ``b-{op}-scalar-transpose`` / ``-reshape``: Transpose / Reshape(t) op s -> Transpose / Reshape(t op S);
    - ``b-{op}-scalar-add-const``: (t + c) op s -> (t op S) + (c op S), c constant (folded);
    - ``b-{op}-scalar-head-split``: the last three at once, Transpose(Reshape(t + c)) op s -> Transpose(Reshape(
      (t op S) + (c op S))): a biased projection split into attention heads, which the scale crosses as a unit;
    - ``b-mul-scalar-hoist``: x * (y * s) -> (x * y) * S (GELU's x * (0.5 * t)).

    Each step but the last keeps the number of launches (the last folds the scale into a weight). Q/K/V's MatMul
    merge hides K's weight behind a Split: :func:`_scalar_split_weight` folds the scale from there."""
    out = []
    (scal,), _ = _channel_scale_scalar("s", 0)  # S: the first target node, "%0", in every rule below
    ex_mm = [_ex(None, a=[2, 3, 4], b=[4, 5], s=[]), _ex(None, a=[1, 2, 3, 4], b=[1, 2, 4, 3], s=[]),
             _ex(None, a=[3, 4], b=[4, 2], s=[1])]
    for op in ("Mul", "Div"):
        lo = op.lower()
        out.append(_rule(f"b-{lo}-scalar-matmul-r", f"{lo}-scalar-into-matmul-rhs",
                         [_n("MatMul", ["a", "b"]), _n(op, ["%0", "s"])],
                         [scal, _n(op, ["b", "%0"]), _n("MatMul", ["a", "%1"])], [["%1", "%2"]], const=["s"],
                         examples=ex_mm))
        out.append(_rule(f"b-{lo}-scalar-matmul-l", f"{lo}-scalar-into-matmul-lhs",
                         [_n("MatMul", ["a", "b"]), _n(op, ["%0", "s"])],
                         [scal, _n(op, ["a", "%0"]), _n("MatMul", ["%1", "b"])], [["%1", "%2"]], const=["s"],
                         examples=ex_mm))
        out.append(_rule(f"b-{lo}-scalar-across-matmul", f"{lo}-scalar-across-matmul",
                         [_n(op, ["a", "s"]), _n("MatMul", ["%0", "b"])],
                         [scal, _n(op, ["b", "%0"]), _n("MatMul", ["a", "%1"])], [["%1", "%2"]], const=["s"],
                         examples=ex_mm))
        out.append(_rule(f"b-{lo}-scalar-transpose", f"{lo}-scalar-through-transpose",
                         [_n("Transpose", ["t"], perm="$perm"), _n(op, ["%0", "s"])],
                         [scal, _n(op, ["t", "%0"]), _n("Transpose", ["%1"], perm="$perm")], [["%1", "%2"]],
                         const=["s"], examples=[_ex({"perm": [0, 2, 1, 3]}, t=[1, 3, 2, 4], s=[]),
                                                _ex({"perm": [1, 0]}, t=[3, 2], s=[1, 1])]))
        out.append(_rule(f"b-{lo}-scalar-reshape", f"{lo}-scalar-through-reshape",
                         [_n("Reshape", ["t"], shape="$shape"), _n(op, ["%0", "s"])],
                         [scal, _n(op, ["t", "%0"]), _n("Reshape", ["%1"], shape="$shape")], [["%1", "%2"]],
                         const=["s"], examples=[_ex({"shape": [1, 3, 2, 2]}, t=[1, 3, 4], s=[]),
                                                _ex({"shape": [6]}, t=[2, 3], s=[1])]))
        out.append(_rule(f"b-{lo}-scalar-add-const", f"{lo}-scalar-over-constant-add",
                         [_n("Add", ["t", "c"]), _n(op, ["%0", "s"])],
                         [scal, _n(op, ["t", "%0"]), _n(op, ["c", "%0"]), _n("Add", ["%1", "%2"])],
                         [["%1", "%3"]], const=["c", "s"],
                         examples=[_ex(None, t=[2, 3, 4], c=[4], s=[]), _ex(None, t=[4], c=[3, 4], s=[1]),
                                   _ex(None, t=[2, 1], c=[], s=[])]))
        out.append(_rule(f"b-{lo}-scalar-head-split", f"{lo}-scalar-through-head-split",
                         [_n("Add", ["t", "c"]), _n("Reshape", ["%0"], shape="$shape"),
                          _n("Transpose", ["%1"], perm="$perm"), _n(op, ["%2", "s"])],
                         [scal, _n(op, ["t", "%0"]), _n(op, ["c", "%0"]), _n("Add", ["%1", "%2"]),
                          _n("Reshape", ["%3"], shape="$shape"), _n("Transpose", ["%4"], perm="$perm")],
                         [["%3", "%5"]], const=["c", "s"],
                         examples=[_ex({"shape": [1, 3, 2, 2], "perm": [0, 2, 3, 1]}, t=[1, 3, 4], c=[4], s=[]),
                                   _ex({"shape": [2, 3], "perm": [1, 0]}, t=[6], c=[], s=[1]),
                                   _ex({"shape": [2, 2, 3], "perm": [0, 2, 1]}, t=[2, 6], c=[2, 6], s=[])]))
    ex_h = [_ex(None, x=[2, 3], y=[2, 3], s=[]), _ex(None, x=[3, 1], y=[4], s=[1]), _ex(None, x=[], y=[2, 2], s=[])]
    out.append(_rule("b-mul-scalar-hoist", "mul-scalar-hoist", [_n("Mul", ["y", "s"]), _n("Mul", ["x", "%0"])],
                     [scal, _n("Mul", ["x", "y"]), _n("Mul", ["%1", "%0"])], [["%1", "%2"]], const=["s"],
                     examples=ex_h))
    return out


def _scalar_split_weight() -> list:
    """A one-element scale on one output of a merged MatMul's Split folded into that output's block of the
    weight's columns: ``Split(a @ w)[j] op s -> Split(a @ Concat(.., w_j op S, ..))[j]``. Without these, merging
    Q/K/V first (each merge pays at once) hides K's weight behind the Split and the attention scale can never be
    folded; with them the order no longer matters. ``b-{op}-scalar-split-weight-{j}``: the scale on output j of
    a two-way Split; ``b-{op}-scalar-split2-weight-{i}{j}``: on output j of a Split of output i of a two-way
    Split (three merged MatMuls). Both Splits cut the product's last axis, so they cut w's last axis in the same
    blocks; a one-output ``Split`` of w along its second-last axis fails shape inference for a 1-D w (whose
    product has no axis of w's), so a vector w is never matched."""
    out = []
    (scal,), _ = _channel_scale_scalar("s", 0)          # %0: S
    last = lambda r: {"sum": [{"rank": r}, -1]}  # noqa: E731
    check = _n("Split", ["w"], axis={"sum": [{"rank": "w"}, -2]}, split=[{"dim": ["w", -2]}])  # %1: rank >= 2
    split = lambda ref, sp: _n("Split", [ref], outputs=2, axis=last(ref), split=sp)  # noqa: E731
    wsplit = lambda ref, sp: _n("Split", [ref], outputs=2, axis=last("w"), split=sp)  # noqa: E731
    pair = lambda j, scaled, ref: [scaled, f"{ref}.1"] if j == 0 else [f"{ref}.0", scaled]  # noqa: E731
    ex1 = lambda j: [_ex({"sp": [2, 4]}, a=[2, 3, 4], w=[4, 6], s=[]),  # noqa: E731
                     _ex({"sp": [3, 2]}, a=[3, 4], w=[4, 5], s=[1]),
                     _ex({"sp": [1, 4]}, a=[2, 3, 4], w=[2, 4, 5], s=[])]
    ex2 = lambda i: [_ex({"sp": [4, 2] if i == 0 else [2, 4], "sq": [1, 3]}, a=[2, 3, 4], w=[4, 6], s=[]),  # noqa: E731
                     _ex({"sp": [5, 2] if i == 0 else [2, 5], "sq": [2, 3]}, a=[3, 4], w=[4, 7], s=[1])]
    for op in ("Mul", "Div"):
        lo = op.lower()
        for j in (0, 1):
            src = [_n("MatMul", ["a", "w"]), split("%0", "$sp"), _n(op, [f"%1.{j}", "s"])]
            dst = [scal, check, wsplit("%1", "$sp"), _n(op, [f"%2.{j}", "%0"]),
                   _n("Concat", pair(j, "%3", "%2"), axis=last("w")), _n("MatMul", ["a", "%4"]),
                   split("%5.0", "$sp")]
            out.append(_rule(f"b-{lo}-scalar-split-weight-{j}", f"{lo}-scalar-into-split-weight", src, dst,
                             [[f"%1.{1 - j}", f"%6.{1 - j}"], ["%2", f"%6.{j}"]], const=["s"], examples=ex1(j)))
        for i in (0, 1):
            for j in (0, 1):
                src = [_n("MatMul", ["a", "w"]), split("%0", "$sp"), split(f"%1.{i}", "$sq"),
                       _n(op, [f"%2.{j}", "s"])]
                dst = [scal, check, wsplit("%1", "$sp"), wsplit(f"%2.{i}", "$sq"), _n(op, [f"%3.{j}", "%0"]),
                       _n("Concat", pair(j, "%4", "%3"), axis=last("w")),
                       _n("Concat", pair(i, "%5", "%2"), axis=last("w")), _n("MatMul", ["a", "%6"]),
                       split("%7.0", "$sp"), split(f"%8.{i}", "$sq")]
                out.append(_rule(f"b-{lo}-scalar-split2-weight-{i}{j}", f"{lo}-scalar-into-split-weight", src,
                                 dst, [[f"%1.{1 - i}", f"%8.{1 - i}"], [f"%2.{1 - j}", f"%9.{1 - j}"],
                                       ["%3", f"%9.{j}"]], const=["s"], examples=ex2(i)))
    return out


def _attention_fuse() -> list:
    """``b-attn-fuse-{k}-{scale}[-mask]``: the primitive attention pattern exporters write ->
    ``Attention(q', K, v[, m])`` (4-D form, ``scale=1``), only in graphs of opset >= 23 (``min_opset``)::

        MatMul(q, Kt) [* s | / s] [+ m] -> Softmax(axis=3) -> MatMul(., v)

    The score matrix is 4-D ``(B, H, Sq, Skv)``; ``Kt``, K transposed, comes in one of three forms:

    - ``kt``: any value ``(B, H, D, Skv)`` (Hugging Face exports through torch's SDPA decomposition, which scales
      K^T and reshapes it); the target transposes it back, ``Transpose(kt, perm=[0,1,3,2])``;
    - ``t``: ``Transpose(k, perm=[0,1,3,2])`` of ``k (B, H, Skv, D)``: the target takes ``k`` itself;
    - ``bshd``: ``Transpose(k, perm=[0,2,3,1])`` of ``k (B, Skv, H, D)``, the head split and the K transpose in one
      (the zoo's exports): the target takes ``Transpose(k, perm=[0,2,1,3])``.

    A one-element constant scale on the scores (``Mul`` or ``Div``: ``s`` pinned to one element by ``Reshape(s,
    shape=[])``, else the target fails inference) moves onto Q, ``Attention(q op S, ...)``, since ``(q K^T) op s ==
    (q op s) K^T``; the scalar-scale rules then fold it into Q's weight. A scale written on Q or K before the
    product (as torch's SDPA decomposition does) stays where it is, inside ``q`` or ``kt``. The mask ``m`` is
    any value added to the scaled scores (``Add(scores, m)``: an additive mask, causal or padding; GPT-2's
    causal mask written as an additive constant is one), broadcasting as ONNX's Attention does. Soundness over
    every binding: Attention's shape inference demands 4-D Q, K, V with one batch size, head counts that fit,
    and a mask that broadcasts to the scores, so a match where MatMul would broadcast differently is rejected;
    Softmax's literal ``axis=3`` is the scores' last axis. Where every key of a query row is masked out with
    ``-inf``, the fused op gives zeros where the composition gives NaN (ONNX's rule)."""
    out = []
    perm = [0, 1, 3, 2]
    k_forms = {"kt": ([], "kt", [_n("Transpose", ["kt"], perm=perm)]),
               "t": ([_n("Transpose", ["k"], perm=perm)], "%0", []),
               "bshd": ([_n("Transpose", ["k"], perm=[0, 2, 3, 1])], "%0", [_n("Transpose", ["k"], perm=[0, 2, 1, 3])])}
    k_shape = {"kt": lambda b, h, s, d: {"kt": [b, h, d, s]}, "t": lambda b, h, s, d: {"k": [b, h, s, d]},
               "bshd": lambda b, h, s, d: {"k": [b, s, h, d]}}
    for kname, (k_src, kref, k_dst) in k_forms.items():
        for scale in ("none", "Mul", "Div"):
            for mask in (False, True):
                src = list(k_src) + [_n("MatMul", ["q", kref])]
                if scale != "none":
                    src.append(_n(scale, [f"%{len(src) - 1}", "s"]))
                if mask:
                    src.append(_n("Add", [f"%{len(src) - 1}", "m"]))
                src += [_n("Softmax", [f"%{len(src) - 1}"], axis=3), _n("MatMul", [f"%{len(src)}", "v"])]
                dst, qref = [], "q"
                if scale != "none":
                    dst += [_n("Reshape", ["s"], shape=[]), _n(scale, ["q", "%0"])]
                    qref = "%1"
                kin = f"%{len(dst)}" if k_dst else ("kt" if kname == "kt" else "k")
                dst += k_dst
                dst.append(_n("Attention", [qref, kin, "v"] + (["m"] if mask else []), scale=1.0, is_causal=0,
                              q_num_heads=0, kv_num_heads=0))

                def ex(b, h, sq, skv, d, dv, m=None, s=()):
                    shapes = {"q": [b, h, sq, d], **k_shape[kname](b, h, skv, d), "v": [b, h, skv, dv]}
                    if scale != "none":
                        shapes["s"] = list(s)
                    if mask:
                        shapes["m"] = m
                    return _ex(None, **shapes)

                examples = [ex(1, 2, 3, 4, 2, 3, [1, 1, 1, 4]), ex(2, 1, 4, 2, 3, 2, [2, 1, 4, 2], [1]),
                            ex(1, 3, 2, 2, 2, 2, [2, 2])]
                rid = f"b-attn-fuse-{kname}-{scale.lower()}{'-mask' if mask else ''}"
                out.append(_rule(rid, "attention-fuse", src, dst, [[f"%{len(src) - 1}", f"%{len(dst) - 1}"]],
                                 const=["s"] if scale != "none" else (), examples=examples,
                                 min_opset=ATTENTION_OPSET))
    return out


def _attention_unfuse() -> list:
    """``b-attn-unfuse[-mask]``: ``Attention`` (4-D form, not causal) -> ``Softmax(q K^T * scale [+ m]) v``, the
    primitive ops (any opset), so a search can cross the fused op (e.g. merge Q/K/V projections or fold a scale
    through it, then fuse again). The scale becomes a 0-D float32 constant. MatMul broadcasts one K/V head to
    every query head, which is what Attention does with ``kv_num_heads = 1``; other grouped heads fail MatMul's
    shape inference (rejected)."""
    out = []
    for mask in (False, True):
        src = [_n("Attention", ["q", "k", "v"] + (["m"] if mask else []), scale="$sc", is_causal=0, q_num_heads=0,
                  kv_num_heads=0)]
        dst = [{"op": "Constant", "inputs": [], "attrs": {"value": "$sc"}},
               _n("Transpose", ["k"], perm=[0, 1, 3, 2]), _n("MatMul", ["q", "%1"]), _n("Mul", ["%2", "%0"])]
        if mask:
            dst.append(_n("Add", ["%3", "m"]))
        dst += [_n("Softmax", [f"%{len(dst) - 1}"], axis=3), _n("MatMul", [f"%{len(dst)}", "v"])]
        m = lambda shape: {"m": shape} if mask else {}  # noqa: E731
        examples = [_ex({"sc": 0.5}, q=[1, 2, 3, 4], k=[1, 2, 5, 4], v=[1, 2, 5, 3], **m([1, 1, 1, 5])),
                    _ex({"sc": 0.25}, q=[2, 3, 2, 2], k=[2, 1, 3, 2], v=[2, 1, 3, 2], **m([3, 2, 3])),
                    _ex({"sc": 1.5}, q=[1, 1, 2, 3], k=[1, 1, 2, 3], v=[1, 1, 2, 2], **m([2, 2]))]
        out.append(_rule(f"b-attn-unfuse{'-mask' if mask else ''}", "attention-unfuse", src, dst,
                         [["%0", f"%{len(dst) - 1}"]], examples=examples))
    return out


def fused_kernel_rules() -> list[tuple[Rule, list[Example]]]:
    """The fused-kernel family (config ``rules.fused_kernels``, off by default): the primitive attention
    patterns to ONNX's ``Attention`` (opset >= 23 graphs only) and back (any opset). GEMM + bias is the
    ``b-matmul-add-gemm*`` rules (Gemm carries the bias); Conv carries its bias and ReLU already."""
    return _attention_fuse() + _attention_unfuse()


def bias_fusion_rules() -> list[tuple[Rule, list[Example]]]:
    """The bias-fusion family (config ``rules.bias_fusion``, off by default): ``b-split-add-merge`` and
    ``b-matmul-add-gemm-3d``, which fold a transformer's projection biases into its (merged) GEMMs."""
    return _split_add_merge() + _gemm_3d()


def builtin_rules(bias_fusion: bool = False, fused_kernels: bool = False) -> list[tuple[Rule, list[Example]]]:
    """Every builtin rule (``verified`` still pending) with its example instantiations, in a fixed order; with
    ``bias_fusion`` the :func:`bias_fusion_rules` come after the default ones, then with ``fused_kernels`` the
    :func:`fused_kernel_rules` (so every other rule keeps its place)."""
    rules = (_conv_relu() + _conv_bn() + _conv_mul() + _conv_add() + _conv_enlarge_merge() + _conv_merge()
             + _matmul_merge() + _gemm() + _elementwise_chains() + _avgpool_conv() + _scalar_mul()
             + _scalar_scale() + _scalar_split_weight() + _conv_sum_concat() + _conv_group_merge()
             + (bias_fusion_rules() if bias_fusion else []) + (fused_kernel_rules() if fused_kernels else []))
    ids = [r.id for r, _ in rules]
    assert len(ids) == len(set(ids)), ids
    return rules


# ================================================================================================ checking
def _params(p: Mapping[str, Any]) -> dict:
    """Example parameters as a matched graph would bind them: lists as tuples, floats at float32 precision (the
    precision of ONNX float attributes, and of the 0-D float32 constants a target makes from them)."""
    def conv(v):
        if isinstance(v, (list, tuple)):
            return tuple(conv(x) for x in v)
        return float(np.float32(v)) if isinstance(v, float) else v
    return {k: conv(v) for k, v in p.items()}


def _as_float64(g: Graph) -> Graph:
    """The same graph computing in float64 (inputs, constants and every value)."""
    f64 = lambda t: TensorType(t.shape, "float64") if t.dtype == "float32" else t  # noqa: E731
    consts = {k: Constant(np.asarray(c.array, np.float64) if c.array.dtype == np.float32 else c.array)
              for k, c in g.constants.items()}
    return Graph(inputs=g.inputs, outputs=g.outputs, nodes=g.nodes, types={k: f64(t) for k, t in g.types.items()},
                 constants=consts, name=g.name, opset=g.opset)


def positive_vars(rule: Rule) -> set[str]:
    """Variables that must be positive in random tests: a BatchNormalization's variance (the target takes its
    square root)."""
    return {n.inputs[4] for n in rule.src if n.op == "BatchNormalization" and not n.inputs[4].startswith("%")}


def random_feeds(rule: Rule, types: Mapping[str, TensorType], rng: np.random.Generator) -> dict[str, np.ndarray]:
    pos = positive_vars(rule)
    feeds = {}
    for v in rule.variables:
        a = rng.standard_normal(types[v].shape)
        feeds[v] = np.abs(a) + 0.1 if v in pos else a
    return feeds


def compare(rule: Rule, shapes: Mapping[str, Sequence[int]], params: Mapping[str, Any], trials: int = 2,
            seed: int = 0) -> str | float:
    """Run both sides of ``rule`` at one binding. Returns ``"no-match"`` when the source pattern itself does not
    type-check there, ``"rejected"`` when the target fails shape inference or its output types differ (the
    matcher then rejects the match), else the worst relative difference of the outputs (float64, random data)."""
    from rlflow.graph.exec import get_runner, max_rel_diff

    types = {v: TensorType(tuple(int(d) for d in s)) for v, s in shapes.items()}
    params = _params(params)
    try:
        src = instantiate(rule, "src", types, params)
    except RLFlowError:
        return "no-match"
    try:
        dst = instantiate(rule, "dst", types, params)
    except RLFlowError:
        return "rejected"
    if [src.types[v] for v in src.outputs] != [dst.types[v] for v in dst.outputs]:
        return "rejected"
    rs, rd = get_runner(_as_float64(src), "torch"), get_runner(_as_float64(dst), "torch")
    rng = np.random.default_rng(seed)
    worst = 0.0
    for _ in range(trials):
        feeds = random_feeds(rule, types, rng)
        worst = max(worst, max_rel_diff(rs(feeds), rd(feeds)))
    return worst


def tolerance(rule: Rule) -> float:
    """The largest relative difference :func:`check_rule` accepts: float64 rounding (1e-9), or float32 rounding
    (1e-6) when the target makes a constant that float32 cannot hold exactly (a 1/9 pooling kernel: rules are
    for float32 graphs, and ``Constant`` nodes are float32)."""
    for n in rule.dst:
        v = n.attrs.get("value") if n.op == "Constant" else None
        if isinstance(v, float) and float(np.float32(v)) != v:
            return 1e-6
    return 1e-9


def check_rule(rule: Rule, examples: Sequence[Example], trials: int = 3, seed: int = 0,
               tol: float | None = None) -> dict:
    """Verify ``rule`` at every example binding (each must match and agree); returns the ``verified`` record.
    Raises RLFlowError naming the rule and the example that fails."""
    tol = tolerance(rule) if tol is None else tol
    worst = 0.0
    for k, ex in enumerate(examples):
        got = compare(rule, ex["vars"], ex.get("params", {}), trials, seed + k)
        if isinstance(got, str):
            raise RLFlowError(f"rule '{rule.id}': example {k} ({ex['vars']}): "
                              + ("the source pattern does not type-check" if got == "no-match" else
                                 "the target pattern fails shape inference or changes an output type"))
        if not got <= tol:
            raise RLFlowError(f"rule '{rule.id}': example {k} ({ex['vars']}): outputs differ "
                              f"(max relative difference {got:.3g})")
        worst = max(worst, got)
    return {"method": "random-float64", "trials": trials * len(examples), "examples": [dict(e) for e in examples],
            "max_rel_diff": worst}


def verified_builtin_rules(trials: int = 3, max_dim: int = 4, seed: int = 0, bias_fusion: bool = False,
                           fused_kernels: bool = False) -> list[Rule]:
    """The builtin rules with their ``verified`` records filled in by :func:`rlflow.rewrite.verify.verify`: every
    example must fit and agree in float64, plus random bindings drawn around them (``max(trials, #examples)``
    bindings in all, dimensions up to ``max_dim``). This is what the generate_rules stage writes into the rules
    file. A builtin rule that fails is a bug: RLFlowError naming the rule (and the failing example, if one does)."""
    from rlflow.rewrite.verify import verify

    out = []
    for rule, examples in builtin_rules(bias_fusion, fused_kernels):
        record = verify(rule, trials=max(trials, len(examples)), max_dim=max_dim, seed=seed, examples=examples)
        if record is None:
            check_rule(rule, examples, trials=1, seed=seed)  # raises, naming the example, if one fails
            raise RLFlowError(f"builtin rule '{rule.id}' ({rule.name}) fails numeric verification at random "
                              f"bindings around its examples")
        raw = rule.to_json()
        raw["verified"] = {**record, "examples": [dict(e) for e in examples]}
        out.append(rule_from_json(raw, "builtin rules"))
    return out
