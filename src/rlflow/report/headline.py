"""The report's answer, computed once: per track and backend, the best method, every method's verdict and
verified end-to-end ratio, the change in the target's estimate, and which methods found nothing.

A **track** is the group of methods that optimised for one cost target. A target this machine cannot run
(``sim-h100`` on a CPU box: its platform record says ``verifiable: false``) makes a *simulated* track: its answer
is the estimate (vs the original and vs TASO on the same target), and what its graphs do on the real backends
here is a finding beside it. A target this machine runs (``ort-cpu``) makes a *machine* track: its answer is the
verified end-to-end ratio on each backend.

A method whose graph is the original's (``same_as_original`` of evaluation.csv; an older table without that
column: its stage's never-slower check kept the original) has no figures of its own -- its rows are the A/A
control's comparison -- so it is listed as having found nothing, never ranked.

Everything here is plain data (no HTML): the report's first section, its verdict sentences elsewhere and the
summary across models all read one :class:`Headline` (:func:`build`, or :func:`from_evaluation_headline` for a
``results/summary/<model>.json`` file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from rlflow.report.data import AA, BACKEND_LABEL, BACKEND_ORDER, METHOD_LABEL, METHOD_ORDER
from rlflow.report.tables import TOO_NOISY, finding, ordered

if TYPE_CHECKING:
    from rlflow.report.data import ReportData

SIMULATED, MACHINE = "simulated", "machine"
FASTER, SLOWER = "faster", "slower"
#: the backend that verifies a target when its platform record does not say (the target's own executor)
TARGET_BACKEND = {"ort-cpu": "ort", "torch-eager": "torch", "cuda": "torch", "analytic": "torch"}


def method_label(method: str) -> str:
    """``TASO search``; a method optimised for another target: ``TASO search @ ort-cpu``."""
    base, _, target = method.partition("@")
    name = METHOD_LABEL.get(base, base)
    return f"{name} @ {target}" if target else name


#: the name ending of the machine track's copy of a method (``taso_machine``: TASO for this machine's target)
MACHINE_SUFFIX = "_machine"


def base_method(method: str) -> str:
    """``taso@ort-cpu``, ``taso_machine`` -> ``taso``."""
    return method.partition("@")[0].removesuffix(MACHINE_SUFFIX)


def backend_label(backend: str | None) -> str:
    return "?" if backend is None else BACKEND_LABEL.get(backend, backend)


@dataclass(frozen=True)
class Platform:
    """What a track optimised for (the platform record of its methods' artifacts)."""

    target: str
    label: str
    verifiable: bool
    """This machine can run the target's device (else its graphs are study results here)."""
    backend: str | None = None
    """The backend that verifies the target here (None when not verifiable)."""
    device: str | None = None

    @classmethod
    def from_record(cls, rec: Mapping[str, Any] | None, target: str | None = None) -> "Platform | None":
        """A platform from a record ``{target, label, device, backend, verifiable}`` (keys may be missing: a
        target ``sim-*`` is not verifiable, any other is), or from a bare ``target``; None without either."""
        rec = dict(rec or {})
        t = rec.get("target") if isinstance(rec.get("target"), str) else target
        if not t:
            return None
        verifiable = rec.get("verifiable")
        if not isinstance(verifiable, bool):
            verifiable = not t.startswith("sim-")
        backend = rec.get("backend") if isinstance(rec.get("backend"), str) else None
        if verifiable and backend is None:
            backend = TARGET_BACKEND.get(t)
        label = rec.get("label") if isinstance(rec.get("label"), str) and rec.get("label") else (
            f"simulated {t[4:].upper()}" if t.startswith("sim-") else t)
        device = rec.get("device") if isinstance(rec.get("device"), str) else None
        return cls(t, label, verifiable, backend if verifiable else None, device)


@dataclass(frozen=True)
class Cell:
    """One graph on one backend: the protocol's ratio to the original with its interval and finding."""

    backend: str
    latency_ms: float | None
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    finding: str
    """``faster`` | ``slower`` | ``no detectable difference`` | ``too noisy`` | a status (``unsupported``,
    ``mismatch``) | empty (not compared)."""

    def text(self) -> str:
        """``0.960 [0.950, 0.970] faster`` (or the status, or ``n/a``)."""
        if self.ratio is None:
            return self.finding or "n/a"
        ci = f" [{self.ci_low:.3f}, {self.ci_high:.3f}]" if self.ci_low is not None and self.ci_high is not None \
            else ""
        return f"{self.ratio:.3f}{ci}" + (f" {self.finding}" if self.finding else "")


@dataclass(frozen=True)
class MethodResult:
    method: str
    label: str
    same_as_original: bool
    """The graph that ran is the original's: its figures are the A/A control's comparison."""
    why_original: str
    """Why, in a few words (empty when the graph is its own)."""
    estimate_ms: float | None
    """The track target's estimate of the method's graph (the original's where its graph is the original)."""
    estimate_ratio: float | None
    """``estimate_ms`` / the original's estimate on the same target."""
    vs_taso: float | None
    """``estimate_ms`` / TASO's estimate on the same target (None for TASO itself or without TASO)."""
    cells: dict[str, Cell] = field(default_factory=dict)

    def one_line(self) -> str:
        """``TASO search: found nothing; its graph is the original``."""
        return f"{self.label}: {self.why_original}; its graph is the original"


@dataclass(frozen=True)
class Track:
    kind: str
    """:data:`SIMULATED` (the target is not verifiable here) or :data:`MACHINE`."""
    platform: Platform
    original_estimate_ms: float | None
    methods: tuple[MethodResult, ...]
    best_estimate: str | None
    """The method with the lowest estimate below the original's (None: no method lowered it)."""
    best: dict[str, str | None]
    """backend -> the method verified faster there with the lowest ratio (None: none verified faster)."""

    @property
    def found_nothing(self) -> list[MethodResult]:
        return [m for m in self.methods if m.same_as_original]

    @property
    def changed(self) -> list[MethodResult]:
        return [m for m in self.methods if not m.same_as_original]

    def method(self, name: str) -> MethodResult | None:
        return next((m for m in self.methods if m.method == name), None)

    @property
    def lead_backend(self) -> str | None:
        """The backend whose verdict answers the track: the one that verifies its target (machine), else None."""
        return self.platform.backend if self.kind == MACHINE else None

    @property
    def title(self) -> str:
        p = self.platform
        if self.kind == SIMULATED:
            return f"Simulated target: {p.label} ({p.target}), not verifiable on this machine"
        return f"This machine's target: {p.label} ({p.target}), verified on {backend_label(p.backend)}"


@dataclass(frozen=True)
class Headline:
    model: str
    backends: tuple[str, ...]
    noisy: tuple[str, ...]
    """Backends whose A/A control failed: no verdict there is a finding."""
    tracks: tuple[Track, ...]

    def method(self, name: str) -> MethodResult | None:
        for t in self.tracks:
            if (m := t.method(name)) is not None:
                return m
        return None

    def same_as_original(self, name: str) -> bool:
        m = self.method(name)
        return m is not None and m.same_as_original

    @property
    def methods(self) -> list[MethodResult]:
        return [m for t in self.tracks for m in t.methods]


# -- building ---------------------------------------------------------------------------------------------------
def _cell(r: Mapping[str, Any]) -> Cell:
    if r.get("status", "ok") != "ok":
        return Cell(r["backend"], None, None, None, None, str(r["status"]))
    return Cell(r["backend"], r.get("latency_ms_median"), r.get("ratio"), r.get("ci_low"), r.get("ci_high"),
                finding(dict(r)))


def _same(rows: list[Mapping[str, Any]]) -> bool:
    flags = [r.get("same_as_original") for r in rows if r.get("same_as_original") is not None]
    if flags:
        return bool(flags[0])
    return any(r.get("speed_check") == "kept original" for r in rows)  # the stage wrote the original


def build(model: str, rows: Sequence[Mapping[str, Any]], platforms: Mapping[str, Mapping | None] | None = None,
          estimates: Mapping[str, tuple[float | None, float | None]] | None = None,
          default: Mapping[str, Any] | None = None) -> Headline:
    """The headline of one model from its evaluation rows (``read_evaluation``'s dicts).

    ``platforms``: method -> the platform record of its artifacts (None: unknown); a method without one takes
    the target of an ``@target`` suffix of its name, else ``default`` (the run's resolved platform).
    ``estimates``: method -> (the original's, the method's found graph's) runtime estimate on its target (its
    trace's ``initial`` and ``final``); missing ones fall back to the rows' ``cost_ms`` (the original's: only on
    the first method's target, whose estimate evaluation.csv's original row holds)."""
    platforms, estimates = platforms or {}, estimates or {}
    bs = ordered((r["backend"] for r in rows), BACKEND_ORDER)
    noisy = tuple(b for b in bs if any(r["backend"] == b and r.get("too_noisy") for r in rows))
    orig_cost = next((r["cost_ms"] for r in rows if r["method"] == "original" and r.get("cost_ms")), None)
    groups: dict[str, list[str]] = {}
    plats: dict[str, Platform] = {}
    first_target = None  # evaluation.csv's original cost_ms is the first method's trace's initial: its target
    for m in ordered((r["method"] for r in rows), METHOD_ORDER):
        if m in ("original", AA):
            continue
        _, _, suffix = m.partition("@")
        p = (Platform.from_record(platforms.get(m), suffix or None) if platforms.get(m) or suffix
             else Platform.from_record(default)) or Platform("?", "unknown target", False)
        groups.setdefault(p.target, []).append(m)
        plats.setdefault(p.target, p)
        first_target = first_target or p.target
    tracks = []
    for target, names in groups.items():
        p = plats[target]
        kind = MACHINE if p.verifiable else SIMULATED
        initial = next((estimates[m][0] for m in names if m in estimates and estimates[m][0]), None) or (
            orig_cost if target == first_target else None)
        raw = []
        for m in names:
            mine = [r for r in rows if r["method"] == m]
            same = _same(mine)
            found = estimates.get(m, (None, None))[1]
            if found is None:
                found = next((r["cost_ms"] for r in mine if r.get("cost_ms") is not None), None)
            why = ""
            if same:
                kept = any(r.get("speed_check") == "kept original" for r in mine)
                why = ("its find was not faster on the check backend, so its stage kept the original" if kept
                       else "its rewrites do not survive the ONNX export" if found is not None and initial
                       and found < initial else "found nothing")
            raw.append((m, same, why, initial if same else found,
                        {r["backend"]: _cell(r) for r in mine}))
        taso = next((est for m, _, _, est, _ in raw if base_method(m) == "taso"), None)
        methods = tuple(MethodResult(
            m, method_label(m), same, why, est, est / initial if est is not None and initial else None,
            est / taso if est is not None and taso and base_method(m) != "taso" else None, cells)
            for m, same, why, est, cells in raw)
        lower = [x for x in methods if not x.same_as_original and x.estimate_ms is not None and initial
                 and x.estimate_ms < initial]
        best_estimate = min(lower, key=lambda x: x.estimate_ms).method if lower else None
        best = {}
        for b in bs:
            faster = [x for x in methods if not x.same_as_original and b in x.cells
                      and x.cells[b].finding == FASTER and x.cells[b].ratio is not None]
            best[b] = min(faster, key=lambda x: x.cells[b].ratio).method if faster else None
        tracks.append(Track(kind, p, initial, methods, best_estimate, best))
    tracks.sort(key=lambda t: t.kind != SIMULATED)  # the simulated answer first, then this machine's
    return Headline(model, tuple(bs), noisy, tuple(tracks))


def from_evaluation_headline(doc: Mapping[str, Any], default: Mapping[str, Any] | None = None) -> Headline:
    """The headline of one model from its ``results/summary/<model>.json`` (written by evaluate); ``default``:
    the platform of a method whose entry names none (an older file)."""
    rows, platforms, estimates = [], {}, {}
    for m, entry in (doc.get("methods") or {}).items():
        entry = entry if isinstance(entry, dict) else {}
        per = entry.get("backends") if isinstance(entry.get("backends"), dict) else {}
        for b, c in per.items():
            c = c if isinstance(c, dict) else {}
            rows.append({"method": m, "backend": b, "status": "ok", "latency_ms_median": _f(c.get("latency_ms")),
                         "ratio": _f(c.get("ratio")), "ci_low": _f(c.get("ci_low")), "ci_high": _f(c.get("ci_high")),
                         "verdict": c.get("verdict"), "too_noisy": c.get("finding") == TOO_NOISY,
                         "cost_ms": _f(entry.get("cost_ms")), "same_as_original": entry.get("same_as_original"),
                         "speed_check": entry.get("speed_check")})
        if isinstance(entry.get("platform"), dict):
            platforms[m] = entry["platform"]
        estimates[m] = (_f(entry.get("original_estimate_ms")), _f(entry.get("estimate_ms")))
    return build(str(doc.get("model", "?")), rows, platforms, estimates, default)


def from_report(d: "ReportData") -> Headline:
    """The headline of a model's report: its evaluation rows, each method's platform and estimates from its
    trace (``platform``, else the target of ``cost``), the run's resolved platform for a method without either."""
    platforms, estimates = {}, {}
    for m, inp in d.traces.items():
        doc = inp.data if inp.ok and isinstance(inp.data, dict) else {}
        if isinstance(doc.get("platform"), dict):
            platforms[m] = doc["platform"]
        elif isinstance(doc.get("cost"), dict) and isinstance(doc["cost"].get("target"), str):
            platforms[m] = {"target": doc["cost"]["target"], "label": doc["cost"].get("label")}
        elif m.endswith(MACHINE_SUFFIX) and (mine := run_platform(d.config, "machine")):
            platforms[m] = mine  # the machine track's method without a trace (yet): this machine's target
        estimates[m] = (_runtime(doc.get("initial")), _runtime(doc.get("final")))
    return build(d.model, d.evaluation, platforms, estimates, run_platform(d.config))


def run_platform(config: Mapping[str, Any], target: str | None = None) -> dict | None:
    """The config's resolved platform record (:func:`rlflow.cost.platform.resolve_platform`; ``target``: another
    target, or ``machine``), or the named target when that cannot be resolved here."""
    from rlflow.errors import RLFlowError

    try:
        from rlflow.cost.platform import resolve_platform

        return resolve_platform(config, target).as_dict()
    except (ImportError, RLFlowError, KeyError, ValueError):
        cost = config.get("cost") or {}
        target = target or cost.get("target") or cost.get("model")
        return {"target": str(target)} if target and target not in ("auto", "machine") else None


def _runtime(sub: Any) -> float | None:
    return _f(sub.get("runtime_ms")) if isinstance(sub, dict) else None


def _f(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


# -- sentences ----------------------------------------------------------------------------------------------------
def backend_sentence(hl: Headline, backend: str) -> str:
    """What the verdicts on ``backend`` support, every method of every track: faster / slower / no detectable
    difference, and the methods whose graph is the original (no comparison of their own). Empty when no method
    was compared there."""
    compared = [(m, m.cells[backend]) for m in hl.methods if backend in m.cells and m.cells[backend].ratio is not None]
    if not compared:
        return ""
    own = [(m, c) for m, c in compared if not m.same_as_original]
    original = [m.label for m, _ in compared if m.same_as_original]
    tail = f"; graph is the original (no comparison of its own): {', '.join(original)}" if original else ""
    if backend in hl.noisy:
        return f"On {backend_label(backend)} the run was too noisy: no method is reported faster or slower{tail}."
    parts = []
    for word, keep in (("faster than the original", lambda f: f == FASTER),
                       ("slower than the original", lambda f: f == SLOWER),
                       ("no detectable difference from the original", lambda f: f not in (FASTER, SLOWER))):
        names = [m.label for m, c in own if keep(c.finding)]
        if names:
            parts.append(f"{word}: " + ", ".join(names))
    if not parts:
        return f"On {backend_label(backend)}, every method's graph is the original: {', '.join(original)}."
    return f"On {backend_label(backend)}, " + "; ".join(parts) + f" (95% intervals){tail}."


def _ratio_vs(x: float | None, what: str) -> str:
    return "" if x is None else f"{x:.3f} of {what}"


def _estimate_text(m: MethodResult) -> str:
    """``0.940 of the original's and 0.989 of TASO's``."""
    return " and ".join(x for x in (_ratio_vs(m.estimate_ratio, "the original's"), _ratio_vs(m.vs_taso, "TASO's"))
                        if x) or "n/a"


def _per_backend(t: Track, noisy: Sequence[str], lead: str | None = None) -> list[str]:
    """Per backend (``lead`` first): the method verified faster with the lowest ratio, or that none is."""
    out = []
    for k in ([lead] if lead in t.best else []) + [k for k in t.best if k != lead]:
        compared = [x for x in t.changed if k in x.cells and x.cells[k].ratio is not None]
        if not compared:
            continue
        where = f"{backend_label(k)}{' (verifies the target)' if k == lead else ''}"
        if k in noisy:
            out.append(f"{where}: too noisy (its A/A control failed), no verdict is a finding")
        elif t.best[k] is not None:
            b = t.method(t.best[k])
            out.append(f"{where}: {b.label} {b.cells[k].text()}")
        else:
            out.append(f"{where}: no method verifiably faster")
    return out


def _slower(t: Track, noisy: Sequence[str]) -> list[str]:
    return [f"{x.label} on {backend_label(k)} {c.text()}" for x in t.changed for k, c in x.cells.items()
            if c.finding == SLOWER and k not in noisy]


def track_sentences(t: Track, noisy: Sequence[str] = (), nothing: bool = True) -> list[str]:
    """The track's answer in a few sentences: the best method and its figure, the best verified on each backend,
    what is slower, then (``nothing``) the methods that found nothing."""
    out = []
    if not t.methods:
        return out
    best_est = t.method(t.best_estimate) if t.best_estimate else None
    if t.kind == SIMULATED:
        if best_est is None:
            out.append(f"No method lowered the estimate on {t.platform.label}.")
        else:
            out.append(f"Best on {t.platform.label} (the cost model's estimate; this machine cannot verify it): "
                       f"{best_est.label}, estimated cost {_estimate_text(best_est)}.")
            here = [f"{backend_label(k)} {c.text()}" for k, c in best_est.cells.items() if c.ratio is not None]
            if here:
                out.append(f"Its graph on this machine (latency ratio to the original [95% CI]): {', '.join(here)}.")
        verified = _per_backend(t, noisy)
        if verified:
            out.append("Fastest verified on this machine's backends: " + "; ".join(verified) + ".")
    else:
        verified = _per_backend(t, noisy, t.lead_backend)
        if verified:
            out.append("Best verified (latency ratio to the original [95% CI]): " + "; ".join(verified) + ".")
        if best_est is not None:
            out.append(f"Lowest estimate on {t.platform.label}: {best_est.label}, {_estimate_text(best_est)}.")
    if (slower := _slower(t, noisy)):
        out.append("Slower than the original: " + "; ".join(slower) + ".")
    if nothing and t.found_nothing:
        out.append("Found nothing (their graph is the original): " + ", ".join(x.label for x in t.found_nothing)
                   + ".")
    return out
