"""Check that an optimised graph computes what the original computes (onnxruntime, the same random inputs).

Every command that writes an optimised model calls :func:`check_equal` first and writes nothing if it fails.
"""

from __future__ import annotations

from rlflow.errors import RLFlowError
from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff
from rlflow.graph.ir import Graph


def check_equal(original: Graph, optimised: Graph, seed: int = 0, tol: float = 1e-4, device: str = "cpu") -> float:
    """Run both graphs under onnxruntime on the same random inputs (:func:`make_inputs` of ``original``, seed
    ``seed``) and return the largest relative output difference (:func:`max_rel_diff`). Raises RLFlowError,
    naming the output that differs most, if it exceeds ``tol`` (or the graphs' interfaces differ)."""
    if list(original.inputs) != list(optimised.inputs) or len(original.outputs) != len(optimised.outputs):
        raise RLFlowError(f"optimised graph '{optimised.name}' has inputs {list(optimised.inputs)} and "
                          f"{len(optimised.outputs)} outputs; the original has {list(original.inputs)} and "
                          f"{len(original.outputs)}")
    for name in original.inputs:
        if original.types[name] != optimised.types[name]:
            raise RLFlowError(f"optimised graph: input '{name}' is {optimised.types[name]}, "
                              f"the original's is {original.types[name]}")
    feeds = make_inputs(original, seed)
    want = get_runner(original, "ort", device)(feeds)
    got = get_runner(optimised, "ort", device)(feeds)
    diffs = [max_rel_diff([a], [b]) for a, b in zip(want, got)]
    worst = float("nan") if any(d != d for d in diffs) else max(diffs, default=0.0)
    if not worst <= tol:  # also catches NaN
        k = max(range(len(diffs)), key=lambda i: (diffs[i] != diffs[i], diffs[i]))
        raise RLFlowError(f"the optimised graph's output '{original.outputs[k]}' differs from the original's by "
                          f"{diffs[k]:.3g} (max |difference| relative to the output's magnitude; tolerance {tol:g}, "
                          f"onnxruntime, inputs seed {seed})")
    return worst
