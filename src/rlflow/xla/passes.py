"""XLA's CPU pass pipeline, read from XLA itself, and the target-independent passes the agent chooses from.

:func:`discover` compiles a module in a worker process with XLA's pass-pipeline logging on
(``TF_CPP_VMODULE=hlo_pass_pipeline=2``) and reads every pass XLA runs, in order, with the pipelines it runs in
(nested pipelines such as ``simplification`` are passes of their parent). Nothing here is a hand-copied list: a
different XLA version gives its own pipeline.

- :attr:`Pipeline.names`: every pass and nested-pipeline name XLA ran (what ``xla_disable_hlo_passes`` can name);
- :attr:`Pipeline.target_independent`: the leaf passes XLA runs before ``layout-assignment`` (its first
  target-specific pass), in order, each with the nested pipelines around it: XLA's own order;
- :func:`action_passes`: the distinct target-independent passes minus layout, fusion, copy insertion, float
  normalisation and the other legalisation passes (:data:`EXCLUDED`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FIRST_TARGET_SPECIFIC = "layout-assignment"

# legalisation: passes that make a module acceptable to a backend rather than optimise it
EXCLUDED = (r"layout", r"fusion", r"copy-insertion", r"float-normalization", r"sub-byte-size-setter",
            r"result_caster", r"operand_upcaster", r"change-op-data-type", r"canonicalizer$",
            r"stochastic_convert_decomposer", r"bitcast_dtypes_expander", r"sharding", r"shardy",
            r"strip-memory-placement-annotations", r"async-collective-replacer", r"all-reduce-promotion",
            r"all_to_all_decomposer", r"control-dep-rewriter", r"cse_barrier_expander")

_RUN_PIPELINE = re.compile(r"Running HLO pass pipeline on module (?P<module>.*?): (?P<name>.+)$")
_PASS_START = re.compile(r"\]\s+HLO pass (?P<name>[^:].*)$")
_PASS_END = re.compile(r"\]\s+HLO pass: (?P<name>.+?) time:")


@dataclass(frozen=True)
class PassRun:
    """One run of a leaf pass: its name and the nested pipelines it runs inside (outermost first)."""

    name: str
    pipelines: tuple[str, ...]


@dataclass(frozen=True)
class Pipeline:
    """XLA's pass pipeline as one compile ran it."""

    names: frozenset[str]
    runs: tuple[PassRun, ...]

    @property
    def target_independent(self) -> tuple[PassRun, ...]:
        for i, run in enumerate(self.runs):
            if run.name == FIRST_TARGET_SPECIFIC:
                return self.runs[:i]
        return self.runs

    def pipelines_of(self, name: str) -> tuple[str, ...]:
        """The nested pipelines around the first target-independent run of ``name``."""
        for run in self.target_independent:
            if run.name == name:
                return run.pipelines
        raise KeyError(name)


def parse_log(log: str, module: str) -> Pipeline:
    """The pipeline from XLA's pass-pipeline log of one compile of ``module`` (log lines of other modules, e.g.
    jax's own helper computations, are skipped)."""
    names: set[str] = set()
    runs: list[PassRun] = []
    stack: list[str] = []     # nested pipelines now running (outermost first)
    pending: str | None = None  # the pass started last, until it ends (a leaf) or runs as a pipeline
    mine = False
    for line in log.splitlines():
        m = _RUN_PIPELINE.search(line)
        if m:
            mine = m["module"] == module
            if not mine:
                continue
            if pending is not None and pending == m["name"]:
                stack.append(pending)      # a nested pipeline starts
            elif not (stack and stack[-1] == m["name"]):  # (else: a fixed-point pipeline's next iteration)
                stack = []                 # a top-level pipeline
            pending = None
            continue
        if not mine:
            continue
        m = _PASS_START.search(line)
        if m:
            pending = m["name"].strip()
            names.add(pending)
            continue
        m = _PASS_END.search(line)
        if m:
            if pending is not None and m["name"] == pending:
                runs.append(PassRun(pending, tuple(stack)))
            elif stack and stack[-1] == m["name"]:
                stack.pop()
            pending = None
    return Pipeline(frozenset(names), tuple(runs))


def excluded(name: str) -> bool:
    return any(re.search(p, name) for p in EXCLUDED)


def action_passes(pipeline: Pipeline) -> tuple[str, ...]:
    """The agent's actions: distinct target-independent leaf passes, in XLA's order of first use."""
    seen: list[str] = []
    for run in pipeline.target_independent:
        if run.name not in seen and not excluded(run.name):
            seen.append(run.name)
    return tuple(seen)


def disabled_for(pipeline: Pipeline, name: str, pipelines: tuple[str, ...] | None = None) -> list[str]:
    """``xla_disable_hlo_passes`` that leaves only ``name`` and the nested pipelines around it to run (those of
    its first target-independent run unless ``pipelines`` is given). In a fixed-point pipeline such as
    ``simplification`` the pass so runs until it changes nothing."""
    keep = {name, *(pipeline.pipelines_of(name) if pipelines is None else pipelines)}
    return sorted(n for n in pipeline.names if n not in keep)
