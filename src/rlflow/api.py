"""The Python API: read an ONNX model, optimise it with the verified rewrite rules, estimate its cost, write it.

    import rlflow

    fast = rlflow.optimize("model.onnx")        # an onnx.ModelProto: checked equal to the original, never slower
    rlflow.save(fast, "fast.onnx")
    rlflow.estimate_cost("fast.onnx", target="sim-h100")["runtime_ms"]

A model is a path, the bytes of an ONNX file, an ``onnx.ModelProto`` or an rlflow :class:`~rlflow.graph.ir.Graph`.
Bad input raises :class:`rlflow.errors.RLFlowError` with a one-line message. ``rlflow optimize`` is
:class:`Optimiser` with a command line around it; the pipeline's stages do not use this module.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from rlflow.errors import RLFlowError

if TYPE_CHECKING:
    import onnx

    from rlflow.graph.ir import Graph

#: the methods of :func:`optimize`: three searches, a trained agent and onnxruntime's transformer optimizer
METHODS = ("eqsat", "taso", "greedy", "rlflow", "ort-optimizer", "eqsat-rl")
#: at most this many searches again after timing the kernels of the graph found (a measured target)
MEASURE_ROUNDS = 3


# ================================================================================================ load and save
def load(model, input_shapes: Mapping[str, Sequence[int]] | Sequence[str] | None = None) -> Graph:
    """The model as rlflow's graph: weights folded, every input shape static.

    ``input_shapes`` fixes dynamic dimensions, e.g. ``{"input_ids": (1, 128)}`` or ``["input_ids=1x128"]``; a
    model with a dynamic dimension needs it. A Graph is returned as it is.
    """
    from rlflow.graph.ir import Graph
    from rlflow.graph.onnx_io import load_onnx

    if isinstance(model, Graph):
        return model
    if not isinstance(model, (str, os.PathLike, bytes, bytearray)):
        model = _onnx_bytes(model)
    return load_onnx(model, input_shapes)


def save(model, path: str | os.PathLike) -> None:
    """Write a Graph or an ``onnx.ModelProto`` to ``path`` (atomically; a Graph is checked by ONNX's checker)."""
    from rlflow.atomic import atomic_path
    from rlflow.graph.ir import Graph
    from rlflow.graph.onnx_io import save_onnx

    if isinstance(model, Graph):
        save_onnx(model, path)
        return
    data = _onnx_bytes(model)
    with atomic_path(Path(path)) as tmp:
        tmp.write_bytes(data)


def _onnx_bytes(model) -> bytes:
    import onnx

    if not isinstance(model, onnx.ModelProto):
        raise RLFlowError(f"expected a path, ONNX bytes, an onnx.ModelProto or an rlflow Graph, got "
                          f"{type(model).__name__}")
    return model.SerializeToString()


# ================================================================================================ optimise
@dataclass
class Optimised:
    """What :meth:`Optimiser.run` chose and why."""

    graph: Graph            #: the graph to use: the one found, or the original where the never-slower check said so
    found: Any              #: the method's result (rlflow.search.result.SearchResult): the graph found, its trace
    trace: dict             #: the trace document (``--trace``): rules applied, costs, both checks' records
    cost: Any               #: the target's cost model
    platform: Any           #: the resolved platform (target, backend, device)
    max_rel_diff: float     #: largest output difference of the graph found, relative to the outputs' magnitude
    ops_measured: int       #: op (kernel) signatures timed on the way (a measured target)
    #: the graph kept as an ONNX model with the original's dynamic dimensions, where it is shape-generic
    #: (rlflow.graph.dynamic); None: the graph is written as it is, static
    dynamic_model: onnx.ModelProto | None = None
    dynamic_note: str | None = None  #: what happened to the original's dynamic dimensions (None: it had none)

    def to_onnx(self) -> onnx.ModelProto:
        """The graph kept, as an ONNX model (with its dynamic dimensions where they were kept)."""
        from rlflow.graph.onnx_io import to_onnx

        return self.dynamic_model if self.dynamic_model is not None else to_onnx(self.graph)


def opset_for_output(have: int, want: int, model) -> int:
    """The opset an optimised model is written at: ``want`` (``--opset``), which must be one the importer and
    exporter know and not below the model's own ``have`` (ops are not converted down)."""
    from rlflow.graph.onnx_io import MAX_OPSET, MIN_OPSET

    if not MIN_OPSET <= want <= MAX_OPSET:
        raise RLFlowError(f"--opset {want}: rlflow reads and writes opsets {MIN_OPSET}-{MAX_OPSET}")
    if want < have:
        raise RLFlowError(f"--opset {want}: {model} is at opset {have}; an optimised model keeps its opset or "
                          f"goes up, never down")
    return want


def optimize(model, *, method: str = "eqsat", target: str | None = None, rules: str | os.PathLike | None = None,
             agent: str | os.PathLike | None = None, input_shapes=None, config=None,
             settings: Mapping[str, Any] | None = None, backend: str | None = None, speed_check: bool = True,
             tolerance: float = 1e-4, time_limit: float | None = None, progress: bool = False,
             verbose: bool = False, opset: int | None = None):
    """Optimise ``model`` with the verified rewrite rules; returns the optimised model, an ``onnx.ModelProto``
    (a Graph if ``model`` is one).

    The graph found is checked equal to the original under onnxruntime on random inputs (largest relative output
    difference <= ``tolerance``; otherwise RLFlowError). With ``speed_check`` it is then timed against the
    original on this machine (the measurement protocol); unless it is significantly faster, the ORIGINAL graph is
    returned. Either way the result's weight-only nodes are folded. Its inputs keep the original's dynamic
    dimensions if the result computes what the original computes at other sizes too (checked at two); else its
    shapes are the ones given (``input_shapes``), with a warning saying so.

    * ``method``: ``eqsat`` (equality saturation, the default), ``taso``, ``greedy``, ``rlflow`` (a trained
      agent: ``agent`` is its checkpoint from the pipeline), ``eqsat-rl`` (eqsat with an agent choosing the rule
      families per iteration: ``agent`` a schedule policy JSON, else a tree search over schedules) or
      ``ort-optimizer``.
    * ``target``: the cost target the search minimises: ``machine`` (this machine's runtime: ``ort-cpu`` on a
      CPU, ``cuda`` on a GPU), ``ort-cpu``, ``torch-eager``, ``cuda``, ``sim-h100`` (and ``sim-a100``,
      ``sim-v100``: simulated GPUs, not checked for speed here) or ``analytic``. Default: the config's
      ``cost.target`` if ``config`` or ``settings`` names one, else ``machine``.
    * ``rules``: a rules file; default: the rule set shipped with rlflow (the pipeline's default rules).
    * ``config``: a YAML config file (or a list of them), ``settings`` dotted keys over it, e.g.
      ``{"eqsat.node_limit": 5000, "timing.budget_s": 10}``; without either, the schema's defaults.
    * ``backend``: the never-slower check's backend (``ort``, ``torch``, ``tf``, ...); default: the target's.
    * ``verbose``: print what the command line prints (the check's verdict, the cost before and after).
    * ``opset``: the ONNX opset of the result (at least the model's; default: the model's). Rules whose fused op
      a newer opset defines (``Attention``: 23) apply only when it allows them (docs/fused-kernels.md).
    """
    from rlflow.graph.fold import at_opset
    from rlflow.graph.ir import Graph

    settings = dict(settings or {})
    cfg = load_settings(config, settings)
    names_target = config is not None or any(k in settings for k in ("cost.target", "cost.model"))
    optimiser = Optimiser(config=cfg, target=target or (None if names_target else "machine"), method=method,
                          rules=rules, agent=agent, backend=backend, speed_check=speed_check, tolerance=tolerance,
                          time_limit=time_limit, progress=progress, log=print if verbose else (lambda line: None))
    source = None if isinstance(model, Graph) else (
        model if isinstance(model, (str, os.PathLike, bytes, bytearray)) else _onnx_bytes(model))
    graph = load(model if source is None else source, input_shapes)
    name = str(model) if isinstance(model, (str, os.PathLike)) else "the model"
    if opset is not None:  # a copy (never the caller's Graph), masks additive from opset 23
        graph = at_opset(graph, opset_for_output(graph.opset, opset, name))
    run = optimiser.run(graph, model_name=name, source=source, input_shapes=input_shapes)
    if verbose:
        print(summary_lines(run, method))
    elif run.dynamic_note and run.dynamic_model is None:
        warnings.warn(run.dynamic_note, stacklevel=2)
    return run.graph if isinstance(model, Graph) else run.to_onnx()


def load_settings(config=None, settings: Mapping[str, Any] | None = None) -> dict:
    """The validated config: ``config`` (a YAML file or a list of them; None: the schema defaults) with the
    dotted ``settings`` applied over it."""
    from rlflow.config import load_config

    return load_config(config, [f"{k}={json.dumps(v)}" for k, v in (settings or {}).items()])


class Optimiser:
    """The work of :func:`optimize` and ``rlflow optimize``: built from the settings (checked, and the rules, the
    agent and the platform loaded, before any model is read), then :meth:`run` on each loaded graph.

    ``target`` None: the config's ``cost.target``. ``alpha``, ``budget``: TASO's; ``time_limit``: the search's
    (eqsat: saturation only). ``costs``: a measured target's cost cache, read and extended. ``log`` gets the
    never-slower check's one line."""

    def __init__(self, *, config: dict, target: str | None = "machine", method: str = "eqsat",
                 rules: str | os.PathLike | None = None, agent: str | os.PathLike | None = None,
                 backend: str | None = None, speed_check: bool = True, tolerance: float = 1e-4,
                 alpha: float | None = None, budget: int | None = None, time_limit: float | None = None,
                 costs: Path | None = None, progress: bool = False, log: Callable[[str], None] = print):
        from rlflow.config import get, resolve_device
        from rlflow.rewrite.rule import DEFAULT_RULES, load_rules

        if method not in METHODS:
            raise RLFlowError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")
        if method not in ("rlflow", "eqsat-rl") and agent is not None:
            raise RLFlowError(f"--agent is the trained agent of --method rlflow (or eqsat-rl's schedule policy); "
                              f"--method {method} is a search and takes none")
        if method == "rlflow":
            if agent is None:
                raise RLFlowError("--method rlflow needs --agent CKPT (results/<model>/controller/controller.pt of "
                                  "train_controller or results/<model>/model_free/model_free.pt of "
                                  "train_model_free)")
            given = [f for f, v in (("--alpha", alpha), ("--budget", budget), ("--time-limit", time_limit))
                     if v is not None]
            if given:
                raise RLFlowError(f"{', '.join(given)}: search options; --method rlflow runs one episode of the "
                                  "agent and takes none")
        if method == "eqsat" and (alpha is not None or budget is not None):
            raise RLFlowError("--alpha, --budget: TASO's settings (add --method taso); --method eqsat, the "
                              "default, reads the config's eqsat section (--set eqsat.node_limit=...)")
        if method == "eqsat-rl" and (alpha is not None or budget is not None):
            raise RLFlowError("--alpha, --budget: TASO's settings (add --method taso); --method eqsat-rl reads the "
                              "config's eqsat section (--set eqsat.node_limit=...)")
        self.method, self.config, self.costs, self.progress, self.log = method, config, costs, progress, log
        self.alpha = get(config, "search.alpha") if alpha is None else alpha
        self.budget = get(config, "search.budget") if budget is None else budget
        self.limit = get(config, "search.time_limit_s") if time_limit is None else time_limit
        self.time_limit, self.tolerance, self.backend, self.speed_check = time_limit, tolerance, backend, speed_check
        if self.alpha < 1.0 or self.budget < 1 or self.limit < 0 or not tolerance >= 0:
            raise RLFlowError("need --alpha >= 1, --budget >= 1, --time-limit >= 0 and --tolerance >= 0")
        self.rules_path = None if method == "ort-optimizer" else Path(rules if rules is not None else DEFAULT_RULES)
        if self.rules_path is not None and not self.rules_path.is_file():
            raise RLFlowError(f"{self.rules_path}: rules file not found")
        self.kind = _target(config, target, costs)
        self.platform = _platform(config, self.kind, costs)
        self.seed = get(config, "seed")
        self.device = resolve_device(config)
        self.agent_path, self.agent = agent, None
        if method == "eqsat-rl" and agent is not None:  # read now: a bad policy file fails before any model
            from rlflow.search.eqsat_rl import LinearPolicy

            LinearPolicy.load(agent)
        if method == "rlflow":
            from rlflow.agents.checkpoint import load_agent

            self.agent = load_agent(Path(agent), self.device)
        self.rules = [] if self.rules_path is None else load_rules(self.rules_path)
        if self.agent is not None:
            self.agent.check_rules(self.rules, str(self.rules_path))

    def run(self, graph: Graph, *, model_name: str = "the model", source: str | os.PathLike | None = None,
            input_shapes=None, not_written: str | None = None) -> Optimised:
        """Optimise ``graph``: run the method for the cost target, check the graph found equal to the original,
        then (with the speed check) never slower. ``source``, ``input_shapes``: the ONNX file the graph was
        loaded from and how (``ort-optimizer`` works on the file; without one, on the graph written out).
        ``not_written`` ends the message of a failed equality check (``out.onnx not written``). With a
        ``source`` (a path or the bytes of an ONNX file) whose inputs have dynamic dimensions, the result keeps
        them where the graph is shape-generic (:func:`rlflow.graph.dynamic.keep_dynamic`); ``log`` gets a line
        saying which."""
        from rlflow.graph.dynamic import keep_dynamic
        from rlflow.graph.exec import check_memory
        from rlflow.search.output import verify_and_choose

        check_memory(graph, model_name, note=True)
        cost, measured = _cost_model(self.config, self.device, graph, self.kind, self.costs, self.progress,
                                     model_name)
        extra = {"model": model_name, "rules": self.rules_path and str(self.rules_path),
                 "num_rules": len(self.rules), "device": self.device, "cost_model": cost.name, "target": cost.name,
                 "cost": cost.describe(), "platform": self.platform.as_dict()}
        if self.agent is not None:
            result, episode = self.agent.optimise(graph, self.rules, cost, self.device)
            extra.update(config={"seed": self.seed, "device": self.config.get("device"), "cost.target": self.kind},
                         agent=str(self.agent_path), agent_method=self.agent.method, agent_env=self.agent.env,
                         agent_trained_on=self.agent.info.get("model"),
                         real_interactions={"evaluation": episode["steps"], "total": episode["steps"]})
        else:
            result, more = self._search(graph, cost, source, input_shapes)
            measured += more
            extra["config"] = self._config_used()
        check = _speed_check(self.config, self.platform, self.backend) if self.speed_check else None
        chosen, diff, doc = verify_and_choose(graph, result, extra, seed=self.seed, device=self.device,
                                              tol=self.tolerance, speed_check=check, log=self.log,
                                              not_written=not_written)
        dynamic, note = (None, None) if source is None else keep_dynamic(chosen, source, self.seed, self.tolerance)
        if note:
            self.log(note)
            doc["dynamic_axes"] = {"kept": dynamic is not None, "note": note}
        return Optimised(graph=chosen, found=result, trace=doc, cost=cost, platform=self.platform,
                         max_rel_diff=diff, ops_measured=measured, dynamic_model=dynamic, dynamic_note=note)

    def _search(self, graph, cost, source, input_shapes):
        """Run the search method; on a measured target, time the kernels of the graph found that the cost model
        has not timed and search again (a search takes an optimistic estimate for a gain), until the graph found
        has none (``MEASURE_ROUNDS`` at most). Returns (result, signatures timed)."""
        from rlflow.cost.targets import MEASURED
        from rlflow.search.output import run_method
        from rlflow.stages.search_common import eqsat_settings

        if self.method == "ort-optimizer":  # onnxruntime's transformer optimizer (BERT-type fusions; no rules)
            return _ort_optimizer(graph, cost, source, input_shapes), 0
        settings = eqsat_settings(self.config, self.method)
        if self.time_limit is not None:
            settings["time_limit_s"] = self.time_limit
        search = lambda: run_method(self.method, graph, self.rules, cost, alpha=self.alpha,  # noqa: E731
                                    budget=self.budget, time_limit_s=self.limit, progress=self.progress,
                                    eqsat=settings, policy=self.agent_path if self.method == "eqsat-rl" else None)
        result, timed = search(), 0
        if self.kind not in MEASURED:
            return result, timed
        for _ in range(MEASURE_ROUNDS):
            n = cost.measure([result.graph], progress=self.progress)
            if not n:
                break
            timed += n
            result = search()
        if timed and self.costs is not None:
            _save_costs(cost, self.costs, self.config, self.kind)
        return result, timed

    def _config_used(self) -> dict:
        """The config values the search ran with, by dotted key (the trace's ``config``)."""
        from rlflow.stages.search_common import config_used, eqsat_settings

        used = config_used(self.config, self.method, self.alpha, self.budget, self.limit)
        if self.method in ("eqsat", "eqsat-rl"):
            used["eqsat.time_limit_s"] = (eqsat_settings(self.config, self.method)["time_limit_s"] if self.time_limit is None
                                          else self.time_limit)
        used["cost.target"] = self.kind
        used["timing.check_backend"] = (self.backend or self.platform.backend) if self.speed_check else None
        return used


def _ort_optimizer(graph, cost, source, input_shapes):
    """onnxruntime's transformer optimizer on ``source`` (the file the graph came from), else on the graph
    written out."""
    import tempfile

    from rlflow.graph.onnx_io import save_onnx
    from rlflow.search.ort_optimizer import ort_optimizer

    if isinstance(source, (str, os.PathLike)):
        return ort_optimizer(graph, source, "bert", cost, input_shapes=input_shapes)
    with tempfile.TemporaryDirectory(prefix="rlflow-") as tmp:
        path = Path(tmp) / "model.onnx"
        save_onnx(graph, path)
        return ort_optimizer(graph, path, "bert", cost)


def summary_lines(run: Optimised, method: str) -> str:
    """The terminal summary of a run (cost before and after, the search's figures, the rules applied)."""
    from rlflow.search.output import summary

    if method == "rlflow":
        from rlflow.agents.real_env import agent_summary

        label = "rlflow" if run.trace.get("agent_method") == "rlflow" else "rlflow (model-free agent)"
        text = agent_summary(run.found, run.max_rel_diff, label)
    else:
        text = summary(run.found, run.max_rel_diff, method)
    if run.cost.name.startswith("sim-"):  # a simulated GPU's figures say so on every line
        return "\n".join(f"{line}   [{run.cost.label}]" if line.strip() else line for line in text.splitlines())
    return f"cost target: {run.cost.label} ({run.cost.name})\n{text}"


def _target(config: dict, target: str | None, costs: Path | None) -> str:
    from rlflow.cost import resolve_target
    from rlflow.cost.targets import MEASURED

    kind = resolve_target(config, target)
    if costs is not None and kind not in MEASURED:
        raise RLFlowError(f"--costs is a cache of the measured targets ({', '.join(MEASURED)}); the target is {kind}")
    return kind


def _platform(config: dict, kind: str, costs: Path | None):
    """The resolved platform of target ``kind``; a cost cache made for another platform, or before caches
    recorded theirs, is refused."""
    from rlflow.cost.platform import check_cache, resolve_platform

    platform = resolve_platform(config, kind)
    if costs is not None:
        check_cache(costs, platform, remake=f"delete {costs} and rerun this command (it remakes it)")
    return platform


def _cost_model(config: dict, device: str, graph, kind: str, costs: Path | None, progress: bool, name: str):
    """The target's cost model; a measured one first times the graph's untimed ops or kernels (and updates
    ``costs``); ort-cpu also learns the graph's fusions and uses this machine's calibration.
    Returns (cost model, number of signatures timed)."""
    from rlflow.cost import make_cost_model
    from rlflow.cost.targets import MEASURED

    cost = make_cost_model(config, device, costs if costs is not None and costs.exists() else None, kind=kind)
    measured = 0
    if kind in MEASURED:
        from rlflow.graph.exec import backend_errors

        backend = "ort" if kind == "ort-cpu" else "torch"
        with backend_errors(graph, backend, what=name):  # the user's ops: a failing one is one line
            if kind == "ort-cpu":
                from rlflow.cost.calibration import load_or_measure

                if cost.calibration is None:
                    cost.set_calibration(load_or_measure("ort", "cpu"))
                if not cost.fusion:
                    cost.learn([graph])
            measured = cost.measure([graph], progress=progress)
        if costs is not None and measured:
            _save_costs(cost, costs, config, kind)
    return cost, measured


def _save_costs(cost, costs: Path, config: dict, kind: str) -> None:
    from rlflow.cost.platform import record_in_cache, resolve_platform

    cost.save(costs)
    record_in_cache(costs, resolve_platform(config, kind))


def _speed_check(config: dict, platform, backend: str | None):
    """The never-slower check: on ``backend``, else on the platform's backend; a platform this machine cannot
    verify keeps the graph found, labelled."""
    from rlflow.cost.platform import chosen_backend
    from rlflow.evaluation.protocol import Protocol, never_slower
    from rlflow.stages.search_common import not_verifiable_check

    chosen = chosen_backend(backend, platform)
    if chosen is None:
        return not_verifiable_check(platform)
    return never_slower(Protocol.from_config(config), chosen[0], chosen[1], config.get("seed", 0))


# ================================================================================================ cost
def estimate_cost(model, *, target: str = "analytic", input_shapes=None, config=None,
                  settings: Mapping[str, Any] | None = None) -> dict:
    """The model's cost on a cost target: ``runtime_ms`` (the sum of per-kernel estimates, TASO's cost),
    ``flops``, ``bytes`` (memory read and written by all ops), ``launches`` (kernels) and
    ``roofline_bound_ms`` (all flops at peak compute or all bytes at peak bandwidth, whichever is larger), with
    the target's ``target`` name and ``label``.

    ``target``: ``analytic`` (the default: a roofline per op, deterministic, nothing run), ``sim-h100`` /
    ``sim-a100`` / ``sim-v100`` (simulated GPUs), or a measured one that times the model's kernels here:
    ``machine``, ``ort-cpu``, ``torch-eager``, ``cuda``.
    """
    from rlflow.config import resolve_device

    cfg = load_settings(config, settings)
    graph = load(model, input_shapes)
    device = resolve_device(cfg)
    kind = _target(cfg, target, None)
    cost, _ = _cost_model(cfg, device, graph, kind, None, False, "the model")
    m = cost.graph_metrics(graph)
    return {"target": cost.name, "label": cost.label, "runtime_ms": m.runtime_ms, "flops": m.flops,
            "bytes": m.bytes, "launches": int(m.launches), "roofline_bound_ms": cost.roofline_bound_ms(graph)}
