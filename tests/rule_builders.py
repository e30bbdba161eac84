"""Small builders of rules in their JSON form, for tests of the generator, the verifier and the matchers."""

from __future__ import annotations

from rlflow.rewrite import rule_from_json


def rule(src, dst, outputs, const=(), rid="t"):
    """A generated rule, not yet verified, from source and target node lists (``n(...)``) and output refs."""
    raw = {"id": rid, "name": rid, "origin": "generated", "src": src, "dst": dst, "outputs": outputs,
           "verified": {"method": "pending", "trials": 0}}
    if const:
        raw["constraints"] = {"const": list(const)}
    return rule_from_json(raw, "test")


def n(op, inputs, outputs=1, **attrs):
    """One pattern node: ``op`` over ``inputs`` (variable names or node refs), with its attributes."""
    d = {"op": op, "inputs": list(inputs), "attrs": attrs}
    if outputs != 1:
        d["outputs"] = outputs
    return d
