"""Load everything a model's report shows from its results folder.

``evaluation.csv`` is required (a missing or malformed one is a one-line :class:`RLFlowError`); every other
input is optional: :class:`Input` carries either its data or that it is missing (its stage has not run), so each
section of the report can say so instead of failing. An optional input that exists but cannot be read (not
text, not valid JSON, not a JSON object, a CSV without rows) is damaged upstream output: a one-line
:class:`RLFlowError` naming the file and the stage that writes it, never a report that quietly leaves it out.

Files read, relative to ``results/<model>`` (``--results``)::

    evaluation.csv                       stage evaluate (required)
    metrics.json                         stage evaluate (DVC metrics)
    rollouts.json                        stage merge_rollouts (its summary; the episodes are not kept)
    encoder/metrics.json                 stage train_encoder
    world_model/metrics.json, loss.csv   stage train_world_model
    controller/metrics.json              stage train_controller (RLFlow; the method "rlflow")
    model_free/metrics.json              stage train_model_free
    generalise.json                      stage generalise (the agents zero-shot on other shapes)
    <folder>/trace.json                  taso, greedy, eqsat, eqsat_rl, model_free, controller: format rlflow.search-trace/1
    controller/temperature-<tau>/        stage sweep_temperature (each tau of sweeps.temperatures)
    controller/reward-<name>/            stage sweep_reward (each name of sweeps.rewards)

plus ``results/rules/stats.json`` (``--rules-stats``, stage generate_rules).
"""

from __future__ import annotations

import csv
import importlib.metadata
import io
import json
import math
import os
import platform
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlflow.errors import RLFlowError
from rlflow.pipeline.registry import METHODS, REPORTED_CONFIG, STAGES

#: the columns of evaluation.csv, in order (stage evaluate)
EVAL_COLUMNS = ("model", "method", "backend", "device", "latency_ms_median", "latency_ms_iqr", "ratio", "ci_low",
                "ci_high", "verdict", "detectable_effect", "sessions", "runs", "too_noisy", "roofline_ms", "headroom",
                "peak_memory_mb", "activation_memory_mb", "nodes", "cost_ms", "flops", "bytes", "launches", "optimisation_s",
                "training_s", "real_interactions", "rules_applied", "speed_check", "max_rel_diff", "status")
EVAL_TEXT = ("model", "method", "backend", "device", "verdict", "speed_check", "status")
#: columns read as booleans (``True`` / ``False``)
EVAL_BOOL = ("too_noisy",)
#: columns of newer evaluations, read when present (``True`` / ``False`` / empty -> None); None when absent
EVAL_OPTIONAL_BOOL = ("same_as_original",)
#: the A/A control's method name (rlflow.evaluation.protocol.AA): the original exported and imported again
AA = "original-aa"
#: every method in the report's order; "original" is the unoptimised graph
METHOD_ORDER = ("original", AA, *METHODS)
METHOD_LABEL = {"original": "original", AA: "A/A control (original re-exported)", "taso": "TASO search",
                "greedy": "greedy", "eqsat": "equality saturation", "eqsat_rl": "eqsat-rl (tree search)",
                "model_free": "model-free PPO", "rlflow": "RLFlow",
                # the machine track (the searches again, for this machine's own target) and its baseline
                "taso_machine": "TASO search (machine)", "greedy_machine": "greedy (machine)",
                "eqsat_machine": "equality saturation (machine)", "model_free_machine": "model-free PPO (machine)",
                "rlflow_machine": "RLFlow (machine)",
                "ort_optimizer": "onnxruntime transformer optimizer"}
BACKEND_ORDER = ("ort", "torch", "tf", "tf-xla")
BACKEND_LABEL = {"ort": "onnxruntime", "torch": "torch", "tf": "TensorFlow", "tf-xla": "TF-XLA"}
#: the packages whose versions the report lists: label -> distribution names to try
PACKAGES = {"torch": ("torch",), "onnx": ("onnx",), "onnxruntime": ("onnxruntime", "onnxruntime-gpu"),
            "tensorflow": ("tensorflow", "tensorflow-cpu"),
            "snakemake": ("snakemake",), "dvc": ("dvc",), "gymnasium": ("gymnasium",), "numpy": ("numpy",),
            "matplotlib": ("matplotlib",), "rlflow": ("rlflow",)}


@dataclass
class Input:
    """One optional input file: its data, or why there is none."""

    path: Path
    stage: str
    """The pipeline stage that writes it (named in the "not run" message)."""
    data: Any = None
    problem: str | None = None
    """None when ``data`` was read; ``missing`` when the file does not exist."""

    @property
    def ok(self) -> bool:
        return self.problem is None

    def why(self) -> str:
        """The sentence a section shows when this input is absent."""
        return f"Not run: {self.path} is missing (stage {self.stage} has not run)."

    def damaged(self, what: str) -> RLFlowError:
        """The error for a file that exists but cannot be read."""
        return RLFlowError(f"{self.path}: {what}; it is written by stage {self.stage}: rerun that stage (or delete "
                           f"the file if the stage has not run)")


@dataclass
class ReportData:
    model: str
    config: dict
    results: Path
    evaluation: list[dict]
    eval_metrics: Input
    rules_stats: Input
    rollouts: Input
    encoder: Input
    world_model: Input
    wm_curve: Input
    controller: Input
    model_free: Input
    traces: dict[str, Input]
    """method (``METHODS``) -> its trace."""
    generalise: Input | None = None
    """The agents' zero-shot runs on other shapes (stage generalise)."""
    temperatures: list[tuple[float, Input]] = field(default_factory=list)
    """(tau, controller metrics) for each configured sweeps.temperatures value."""
    rewards: list[tuple[str, Input]] = field(default_factory=list)
    """(reward name, controller metrics) for each configured sweeps.rewards value."""
    versions: dict[str, str] = field(default_factory=dict)
    machine: dict[str, str] = field(default_factory=dict)


# -- evaluation.csv (required) -----------------------------------------------------------------------------
def read_evaluation(path: Path, model: str | None = None) -> list[dict]:
    """The rows of ``evaluation.csv`` (read with pandas): text columns as str, ``too_noisy`` as bool, the others as
    float or None (an empty cell, or not finite)."""
    import pandas as pd

    if not path.is_file():
        raise RLFlowError(f"{path}: evaluation table not found (run stage evaluate first)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise RLFlowError(f"{path}: cannot read the evaluation table ({e.__class__.__name__})") from None
    lines = list(csv.reader(io.StringIO(text)))  # the shape only: every line has the header's cells
    for i, cells in enumerate(lines[1:], start=2):
        if cells and len(cells) != len(lines[0]):
            raise RLFlowError(f"{path}: line {i} does not have {len(lines[0])} cells")
    try:
        df = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, index_col=False)
    except pd.errors.EmptyDataError:
        raise RLFlowError(f"{path}: evaluation table lacks column(s) {', '.join(EVAL_COLUMNS)}") from None
    missing = [c for c in EVAL_COLUMNS if c not in df.columns]
    if missing:
        raise RLFlowError(f"{path}: evaluation table lacks column(s) {', '.join(missing)}")
    if df.empty:
        raise RLFlowError(f"{path}: the evaluation table has no rows")
    optional = [c for c in EVAL_OPTIONAL_BOOL if c in df.columns]
    df = df[list(EVAL_COLUMNS) + optional].apply(lambda col: col.str.strip())
    out = df[list(EVAL_TEXT)].copy()
    for c in EVAL_BOOL:
        bad = ~df[c].isin(["True", "False"])
        if bad.any():
            i = int(bad.idxmax())
            raise RLFlowError(f"{path}: line {i + 2}, column '{c}': not True or False ({df[c][i]!r})")
        out[c] = df[c] == "True"
    for c in optional:
        bad = ~df[c].isin(["True", "False", ""])
        if bad.any():
            i = int(bad.idxmax())
            raise RLFlowError(f"{path}: line {i + 2}, column '{c}': not True, False or empty ({df[c][i]!r})")
        out[c] = df[c].map({"True": True, "False": False, "": None})
    for c in EVAL_COLUMNS:
        if c in EVAL_TEXT or c in EVAL_BOOL:
            continue
        vals = pd.to_numeric(df[c].replace("", None), errors="coerce")
        bad = vals.isna() & (df[c] != "")
        if bad.any():
            i = int(bad.idxmax())
            raise RLFlowError(f"{path}: line {i + 2}, column '{c}': not a number ({df[c][i]!r})")
        out[c] = vals.where(vals.apply(lambda v: v == v and math.isfinite(v)))
    rows = [{k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()}
            for r in out[list(EVAL_COLUMNS) + optional].astype(object).to_dict("records")]
    for r in rows:
        for c in EVAL_OPTIONAL_BOOL:
            r.setdefault(c, None)
    for i, row in enumerate(rows, start=2):
        if row["status"] == "ok" and row["latency_ms_median"] is None:
            raise RLFlowError(f"{path}: line {i}: status ok but no latency_ms_median")
        if model is not None and row["model"] and row["model"] != model:
            raise RLFlowError(f"{path}: line {i} is for model '{row['model']}', not '{model}'")
    return rows


# -- optional inputs ---------------------------------------------------------------------------------------
def _text(inp: "Input") -> str | None:
    """The text of an upstream file; None (and ``inp.problem = "missing"``) if its stage has not run; a file
    that exists but cannot be read is a one-line error naming it and its stage."""
    if not inp.path.is_file():
        inp.problem = "missing"
        return None
    try:
        return inp.path.read_text()
    except OSError as e:
        raise inp.damaged(f"cannot be read ({e.strerror or e.__class__.__name__})") from None
    except UnicodeDecodeError:
        raise inp.damaged("not text") from None


def read_json(path: Path, stage: str, drop: tuple[str, ...] = ()) -> Input:
    """A JSON file as an :class:`Input` (``drop``: top-level keys not kept, e.g. the rollouts' episodes)."""
    inp = Input(path, stage)
    text = _text(inp)
    if text is None:
        return inp
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise inp.damaged(f"not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, dict):
        raise inp.damaged(f"expected a JSON object, found a {type(data).__name__}")
    inp.data = {k: v for k, v in data.items() if k not in drop}
    return inp


def read_curve(path: Path, stage: str) -> Input:
    """A CSV of numbers with a header (the world model's ``loss.csv``): ``{column: [float | None, ...]}``."""
    inp = Input(path, stage)
    text = _text(inp)
    if text is None:
        return inp
    try:
        rows = list(csv.DictReader(io.StringIO(text)))
    except csv.Error as e:
        raise inp.damaged(f"not a valid CSV ({e})") from None
    if not rows:
        raise inp.damaged("a CSV without rows")
    columns: dict[str, list[float | None]] = {c: [] for c in rows[0] if c}
    for r in rows:
        for c in columns:
            try:
                v = float(r.get(c) or "nan")
            except ValueError:
                v = float("nan")
            columns[c].append(v if math.isfinite(v) else None)
    inp.data = columns
    return inp


def _sweep_folders(base: Path, prefix: str) -> dict[str, Path]:
    return {p.name[len(prefix):]: p for p in sorted(base.glob(prefix + "*")) if p.is_dir()} if base.is_dir() else {}


def _temperature_runs(results: Path, taus: list) -> list[tuple[float, Input]]:
    """Each configured temperature's controller metrics (folder ``temperature-<tau>``; matched by value, so
    ``1`` and ``1.0`` name the same run)."""
    found = {}
    for name, folder in _sweep_folders(results / "controller", "temperature-").items():
        if re.fullmatch(r"\d+(\.\d+)?", name):
            found.setdefault(float(name), folder)
    runs = []
    for tau in taus:
        folder = found.get(float(tau), results / "controller" / f"temperature-{tau}")
        runs.append((float(tau), read_json(folder / "metrics.json", "sweep_temperature")))
    return runs


def _reward_runs(results: Path, names: list) -> list[tuple[str, Input]]:
    return [(str(n), read_json(results / "controller" / f"reward-{n}" / "metrics.json", "sweep_reward"))
            for n in names]


# -- environment -------------------------------------------------------------------------------------------
def package_versions() -> dict[str, str]:
    """Versions of the packages the pipeline uses, in the environment that makes the report (every stage runs
    in the same environment), plus python and the platform."""
    out = {}
    for label, dists in PACKAGES.items():
        version = "not installed"
        for d in dists:
            try:
                version = importlib.metadata.version(d) + ("" if d == dists[0] else f" ({d})")
                break
            except importlib.metadata.PackageNotFoundError:
                pass
        out[label] = version
    out["python"] = sys.version.split()[0]
    out["platform"] = platform.platform()
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(evaluation: list[dict], eval_metrics: Input) -> dict[str, str]:
    """Where the numbers were measured (the evaluation's device column and whatever the evaluate stage recorded
    about its hardware) and the machine that made the report."""
    devices = sorted({r["device"] for r in evaluation if r["device"]})
    info = {"evaluation device (evaluation.csv)": ", ".join(devices) or "not recorded"}
    if eval_metrics.ok:
        for key in ("device", "hardware", "gpu", "cpu", "machine", "host"):
            v = eval_metrics.data.get(key)
            if isinstance(v, (str, int, float)) and not isinstance(v, bool):
                info[f"{key} (evaluate metrics.json)"] = str(v)
    info["report made on: CPU"] = f"{_cpu_model()}, {os.cpu_count()} logical cores"
    info["report made on: OS"] = platform.platform()
    return info


# -- everything ------------------------------------------------------------------------------------------------
def load_report_data(model: str, results: Path, rules_stats: Path, config: dict) -> ReportData:
    """Read the model's results folder (``results/<model>``) and the rule statistics."""
    results = Path(results)
    evaluation = read_evaluation(results / "evaluation.csv", model)
    eval_metrics = read_json(results / "metrics.json", "evaluate")
    traces = {m: read_json(results / folder / "trace.json", _trace_stage(m)) for m, folder in METHODS.items()}
    sweeps = config.get("sweeps") or {}
    return ReportData(
        model=model,
        config=config,
        results=results,
        evaluation=evaluation,
        eval_metrics=eval_metrics,
        rules_stats=read_json(Path(rules_stats), "generate_rules"),
        rollouts=read_json(results / "rollouts.json", "merge_rollouts", drop=("episodes",)),
        encoder=read_json(results / "encoder" / "metrics.json", "train_encoder"),
        world_model=read_json(results / "world_model" / "metrics.json", "train_world_model"),
        wm_curve=read_curve(results / "world_model" / "loss.csv", "train_world_model"),
        controller=read_json(results / "controller" / "metrics.json", "train_controller"),
        model_free=read_json(results / "model_free" / "metrics.json", "train_model_free"),
        traces=traces,
        generalise=read_json(results / "generalise.json", "generalise"),
        temperatures=_temperature_runs(results, list(sweeps.get("temperatures") or [])),
        rewards=_reward_runs(results, list(sweeps.get("rewards") or [])),
        versions=package_versions(),
        machine=machine_info(evaluation, eval_metrics),
    )


def _trace_stage(method: str) -> str:
    """The stage that writes the method's trace (the registry's, by its output path)."""
    path = f"results/{{model}}/{METHODS[method]}/trace.json"
    return next(s.name for s in STAGES.values() if path in s.outputs.values())


def reported_config(config: dict, model: str) -> dict:
    """The config sections the report shows (``REPORTED_CONFIG``) and the model's own sizes."""
    out = {k: config[k] for k in REPORTED_CONFIG if k in config}
    zoo = (config.get("zoo") or {}).get(model)
    if zoo is not None:
        out["zoo"] = {model: zoo}
    return out
