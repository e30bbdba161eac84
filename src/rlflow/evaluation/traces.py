"""Read a method's ``trace.json`` (format ``rlflow.search-trace/2``) into the few figures the evaluation reports.

Every method writes one: the searches (``rlflow.search.result.SearchResult.to_json``) and the RL agents, which add
``training_seconds`` and ``real_interactions`` (``{..., "total": N}``, or a plain count). What is read:

* ``initial`` / ``final``: the cost model's estimate of the original / optimised graph (``nodes``, ``runtime_ms``,
  ``flops``, ``bytes``, ``launches``);
* ``steps``: the rewrites applied (their number is ``rules_applied``; none for eqsat and eqsat-rl, :func:`is_eqsat`,
  which apply rules to an e-graph, not to the graph one step at a time: their trace's ``stats`` count the matches
  applied);
* ``seconds``: the optimisation time; ``training_seconds``, ``real_interactions``: only the RL methods;
* ``platform``: the run's resolved platform (:mod:`rlflow.cost.platform`: target, label, device, backend,
  verifiable). Traces of format ``rlflow.search-trace/1`` were made before it was recorded: refused, with the
  command that remakes them.

A missing, unreadable or malformed trace is a one-line :class:`rlflow.errors.RLFlowError` naming the file and key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlflow.errors import RLFlowError

TRACE_FORMAT = "rlflow.search-trace/2"
#: the trace format before the resolved platform was recorded
OLD_FORMAT = "rlflow.search-trace/1"
#: the command that writes each method's trace
REMAKE = {"taso": "rlflow search-taso", "greedy": "rlflow search-greedy", "eqsat": "rlflow search-eqsat",
          "eqsat-mcts": "rlflow search-eqsat-rl",
          "model_free": "rlflow train-model-free", "rlflow": "rlflow train-controller",
          "ort_optimizer": "rlflow search-ortopt"}
#: the cost-model figures of ``initial`` and ``final`` (``runtime_ms`` is the estimate reported as ``cost_ms``)
COST_KEYS = ("nodes", "runtime_ms", "flops", "bytes", "launches")


def is_eqsat(method: str | None) -> bool:
    """The trace's ``method`` is equality saturation's (``eqsat``) or eqsat-rl's (``eqsat-rl``: a learned policy;
    ``eqsat-mcts``: the tree search; ``eqsat-random``): no sequence of rewrites."""
    return method is not None and (method == "eqsat" or method.startswith("eqsat-"))


@dataclass(frozen=True)
class TraceSummary:
    """What the evaluation takes from one method's trace."""

    path: str
    method: str | None
    """The trace's own ``method`` field, if any."""
    initial: dict[str, float]
    """Cost estimate of the original graph: ``COST_KEYS``."""
    final: dict[str, float]
    """Cost estimate of the graph the method delivers: ``COST_KEYS`` of the trace's ``final``, or its ``initial``
    when the never-slower check kept the original (:attr:`speed_check`)."""
    rules_applied: int | None
    """Rewrites on the path to the result (``steps``); None for eqsat and eqsat-rl (no path: they extract from an
    e-graph)."""
    optimisation_s: float
    training_s: float | None
    """RL methods: agent training time (absent for the searches)."""
    real_interactions: int | None
    """RL methods: real-environment steps in all (absent for the searches)."""
    speed_check: str | None = None
    """The never-slower check (trace ``speed_check.kept``): ``kept optimised`` | ``kept original``; None if the
    trace has no check."""
    searched: dict[str, float] | None = None
    """Cost estimate of the graph the method found (the trace's ``final``), whatever the never-slower check kept."""
    expansions: int | None = None
    """The trace's ``expansions`` (for the RL agents: their real steps while optimising), if any."""
    max_rel_diff: float | None = None
    """The written graph's largest relative output difference from the original (``max_rel_diff``), if any."""
    platform: dict | None = None
    """The resolved platform the method ran for (``target``, ``label``, ``device``, ``backend``, ``verifiable``;
    not verifiable: the graph found was kept ungated, labelled "simulated target: not verifiable on this
    machine")."""


def _number(doc: dict, key: str, path: Path, where: str = "") -> float:
    v = doc.get(key) if isinstance(doc, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        got = "missing" if not isinstance(doc, dict) or key not in doc else f"{v!r}"
        raise RLFlowError(f"{path}: trace key '{where}{key}' must be a finite number (got {got})")
    return float(v)


def _costs(doc: dict, key: str, path: Path) -> dict[str, float]:
    sub = doc.get(key)
    if not isinstance(sub, dict):
        raise RLFlowError(f"{path}: trace has no '{key}' mapping (cost of the {key} graph)")
    return {k: _number(sub, k, path, f"{key}.") for k in COST_KEYS}


def _interactions(v: Any, path: Path) -> int | None:
    if v is None:
        return None
    if isinstance(v, dict):
        if "total" not in v:
            raise RLFlowError(f"{path}: trace key 'real_interactions' has no 'total'")
        v = v["total"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != int(v):
        raise RLFlowError(f"{path}: trace key 'real_interactions' must be a count (got {v!r})")
    return int(v)


def load_trace(path: str | Path) -> TraceSummary:
    """Read and check one trace file."""
    path = Path(path)
    if not path.is_file():
        raise RLFlowError(f"{path}: trace file not found")
    try:
        doc = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise RLFlowError(f"{path}: not a JSON trace (not text)") from None
    except json.JSONDecodeError as e:
        raise RLFlowError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(doc, dict):
        raise RLFlowError(f"{path}: a trace must be a JSON object")
    if doc.get("format") == OLD_FORMAT:
        remake = REMAKE.get(doc.get("method"), "the stage that made it")
        raise RLFlowError(f"{path}: a trace made before traces recorded their platform ({OLD_FORMAT}); remake it "
                          f"with `{remake}` (in the pipeline: `dvc repro` or `snakemake` reruns it)")
    if doc.get("format") != TRACE_FORMAT:
        raise RLFlowError(f"{path}: trace format {doc.get('format')!r}, expected {TRACE_FORMAT!r}")
    steps = doc.get("steps")
    if not isinstance(steps, list):
        raise RLFlowError(f"{path}: trace has no 'steps' list")
    training = doc.get("training_seconds")
    method = doc.get("method") if isinstance(doc.get("method"), str) else None
    return TraceSummary(
        path=str(path),
        method=method,
        initial=_costs(doc, "initial", path),
        final=_costs(doc, "initial" if _speed_check(doc.get("speed_check"), path) == "kept original" else "final",
                     path),
        rules_applied=None if is_eqsat(method) else len(steps),
        optimisation_s=_number(doc, "seconds", path),
        training_s=None if training is None else _number(doc, "training_seconds", path),
        real_interactions=_interactions(doc.get("real_interactions"), path),
        speed_check=_speed_check(doc.get("speed_check"), path),
        searched=_costs(doc, "final", path),
        expansions=None if doc.get("expansions") is None else int(_number(doc, "expansions", path)),
        max_rel_diff=None if doc.get("max_rel_diff") is None else _number(doc, "max_rel_diff", path),
        platform=_platform(doc.get("platform"), path),
    )


def _platform(v: Any, path: Path) -> dict:
    keys = ("target", "label", "device", "backend", "verifiable")
    if not isinstance(v, dict) or not all(k in v for k in keys):
        raise RLFlowError(f"{path}: trace key 'platform' must be an object with {', '.join(keys)}")
    return {k: v[k] for k in keys}


def _speed_check(v: Any, path: Path) -> str | None:
    if v is None:
        return None
    if not isinstance(v, dict) or v.get("kept") not in ("optimised", "original"):
        raise RLFlowError(f"{path}: trace key 'speed_check' must be an object with 'kept': optimised | original")
    return f"kept {v['kept']}"
