"""Check that an optimised graph computes what the original computes (onnxruntime, the same random inputs).

Every command that writes an optimised model calls :func:`check_equal` first and writes nothing if it fails.
"""

from __future__ import annotations

import numpy as np

from rlflow.errors import RLFlowError
from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff, output_tolerance, run_model
from rlflow.graph.ir import Graph


def check_equal(original: Graph, optimised: Graph, seed: int = 0, tol: float = 1e-4, device: str = "cpu",
                what: str = "the original model") -> float:
    """Run both graphs under onnxruntime on the same random inputs (:func:`make_inputs` of ``original``, seed
    ``seed``) and return the largest relative output difference (:func:`max_rel_diff`). Raises RLFlowError,
    naming the output that differs most, if an output's exceeds ``tol`` (float32's; a float16 or bfloat16
    output's is at least :data:`rlflow.graph.exec.DTYPE_TOLERANCE`'s) or the graphs' interfaces differ, and naming
    ``what`` (the user's file) and the node if onnxruntime cannot run the original."""
    if list(original.inputs) != list(optimised.inputs) or len(original.outputs) != len(optimised.outputs):
        raise RLFlowError(f"optimised graph '{optimised.name}' has inputs {list(optimised.inputs)} and "
                          f"{len(optimised.outputs)} outputs; the original has {list(original.inputs)} and "
                          f"{len(original.outputs)}")
    for name in original.inputs:
        if original.types[name] != optimised.types[name]:
            raise RLFlowError(f"optimised graph: input '{name}' is {optimised.types[name]}, "
                              f"the original's is {original.types[name]}")
    feeds = make_inputs(original, seed)
    want = run_model(original, "ort", feeds, device, what=what)  # the user's model: one line
    got = get_runner(optimised, "ort", device)(feeds)
    diffs = [max_rel_diff([a], [b]) for a, b in zip(want, got)]
    tols = [output_tolerance(original.types[v].dtype, tol) for v in original.outputs]
    worst = float("nan") if any(d != d for d in diffs) else max(diffs, default=0.0)
    over = [k for k, (d, t) in enumerate(zip(diffs, tols)) if not d <= t]  # also catches NaN
    if over:
        k = max(over, key=lambda i: (diffs[i] != diffs[i], diffs[i] / tols[i]))
        dtype = original.types[original.outputs[k]].dtype
        raise RLFlowError(f"the optimised graph's output '{original.outputs[k]}' differs from the original's "
                          f"{_how(want[k], got[k], diffs[k])} (max |difference| relative to the output's magnitude; "
                          f"tolerance {tols[k]:g} for {dtype}, onnxruntime, inputs seed {seed})")
    return worst


def _how(want, got, diff: float) -> str:
    """How two outputs differ, in words: by how much, or where their NaN/infinite entries differ."""
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    if diff != float("inf"):
        return f"by {diff:.3g}"
    if want.shape != got.shape:
        return f"in shape ({list(got.shape)} vs {list(want.shape)})"
    odd = ~np.isfinite(want) | ~np.isfinite(got)
    same = np.isnan(want) & np.isnan(got) | (want == got)
    k = int(np.count_nonzero(odd & ~same))
    if k == 0:
        return "by inf"  # finite values so far apart that their difference overflows
    return f"at {k} entr{'y' if k == 1 else 'ies'} where one is NaN or infinite and the other is not the same"
