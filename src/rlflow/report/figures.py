"""The report's figures: matplotlib (Agg backend) -> SVG -> a ``data:`` URI for an ``<img>`` tag.

Each image is its own SVG document (no id clashes between figures), with text drawn as paths (no font files),
so the HTML needs nothing outside itself. Output is deterministic (fixed hash salt, no date).
Each function returns the URI, or None when there is nothing to draw.
"""

from __future__ import annotations

import base64
import io
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from rlflow.report.data import BACKEND_LABEL, METHOD_LABEL  # noqa: E402

STYLE = {"svg.fonttype": "path", "svg.hashsalt": "rlflow-report", "font.size": 9, "axes.grid": True,
         "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False}
#: one colour per method, the same in every figure
COLOURS = {"original": "#7f7f7f", "original-aa": "#bcbd22", "taso": "#1f77b4", "greedy": "#2ca02c",
           "eqsat": "#9467bd", "eqsat_rl": "#8c564b", "model_free": "#ff7f0e", "rlflow": "#d62728"}


def _uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _colour(method: str, i: int = 0) -> str:
    return COLOURS.get(method, f"C{i % 10}")


def ratio_points(grid: dict) -> str | None:
    """Fig. 6: every graph's latency ratio to the original on the same backend with its 95% interval (error
    bars), grouped by backend; a dashed line at 1."""
    ms = [m for m in grid["methods"] if m != "original"]
    bs, cells = grid["backends"], grid["cells"]
    if not any(c is not None and c["status"] == "ok" and c.get("ci_low") is not None for c in cells.values()):
        return None
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(bs) + 2), 3.6))
        width = 0.8 / max(1, len(ms))
        for i, m in enumerate(ms):
            xs, ys, lo, hi = [], [], [], []
            for j, b in enumerate(bs):
                c = cells[(m, b)]
                if c is not None and c["status"] == "ok" and c.get("ci_low") is not None:
                    xs.append(j - 0.4 + width * (i + 0.5))
                    ys.append(c["ratio"])
                    lo.append(c["ratio"] - c["ci_low"])
                    hi.append(c["ci_high"] - c["ratio"])
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=METHOD_LABEL.get(m, m), color=_colour(m, i))
        ax.axhline(1.0, color="#444444", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(bs)), [BACKEND_LABEL.get(b, b) for b in bs])
        ax.set_ylabel("latency / original's (95% interval)")
        ax.legend(fontsize=8, ncols=min(3, len(ms)), loc="upper center", bbox_to_anchor=(0.5, -0.12))
        return _uri(fig)


def optimisation_bars(rows: list[dict]) -> str | None:
    """Fig. 7: optimisation time per method (and training time of the RL agents), log scale."""
    rows = [r for r in rows if r["optimisation_s"] is not None or r["training_s"] is not None]
    if not rows:
        return None
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(6.5, 0.45 * len(rows) + 1.2))
        ys = range(len(rows))
        opt = [r["optimisation_s"] or 0.0 for r in rows]
        train = [r["training_s"] or 0.0 for r in rows]
        ax.barh([y + 0.2 for y in ys], opt, 0.4, color=[_colour(r["method"]) for r in rows], label="optimisation")
        if any(train):
            ax.barh([y - 0.2 for y in ys], train, 0.4, color=[_colour(r["method"]) for r in rows], alpha=0.4,
                    hatch="//", label="training (RL agents)")
        ax.set_yticks(list(ys), [METHOD_LABEL.get(r["method"], r["method"]) for r in rows])
        ax.invert_yaxis()
        positive = [v for v in opt + train if v > 0]
        if positive and max(positive) / min(positive) > 100:
            ax.set_xscale("log")
        ax.set_xlabel("seconds")
        ax.legend(fontsize=8)
        return _uri(fig)


def world_model_curve(curve: dict) -> str | None:
    """Fig. 8: the MDN-RNN's loss and next-z negative log-likelihood per epoch, training and held-out."""
    epochs = curve.get("epoch") or list(range(1, 1 + max((len(v) for v in curve.values()), default=0)))
    panels = [("total loss", ("train_loss", "heldout_loss")), ("next-z NLL per dimension", ("train_nll", "heldout_nll"))]
    panels = [(t, cols) for t, cols in panels if any(any(v is not None for v in curve.get(c, [])) for c in cols)]
    if not panels or not epochs:
        return None
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels) + 0.6, 3.0), squeeze=False)
        for ax, (title, cols) in zip(axes[0], panels):
            for c, style in zip(cols, ("-o", "--s")):
                pts = [(e, v) for e, v in zip(epochs, curve.get(c, [])) if e is not None and v is not None]
                if pts:
                    ax.plot(*zip(*pts), style, ms=3, label=c.replace("_", " "))
            ax.set_title(title)
            ax.set_xlabel("epoch")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize=8)
        return _uri(fig)


def reward_curves(series: list[tuple[str, list[float], list[float]]], ylabel: str) -> str | None:
    """Fig. 9 (and Fig. 5's left panel): mean reward per PPO update, one line per series (label, x, y)."""
    series = [s for s in series if s[1]]
    if not series:
        return None
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(6.0, 3.0))
        for i, (label, xs, ys) in enumerate(series):
            ax.plot(xs, ys, "-o", ms=3, label=label, color=f"C{i % 10}")
        ax.set_xlabel("PPO update")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        return _uri(fig)


def small_panels(series: list[tuple[str, list[float], list[float]]], ylabel: str) -> str | None:
    """One small plot per series (different y scales): the reward curves of runs that are not comparable."""
    series = [s for s in series if s[1]]
    if not series:
        return None
    n = len(series)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.5 * rows), squeeze=False)
        for ax in axes.flat[n:]:
            ax.set_visible(False)
        for i, (ax, (label, xs, ys)) in enumerate(zip(axes.flat, series)):
            ax.plot(xs, ys, "-o", ms=3, color=f"C{i % 10}")
            ax.set_title(label, fontsize=9)
            ax.set_xlabel("PPO update")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(ylabel)
        fig.tight_layout()
        return _uri(fig)


def value_bars(labels: list[str], values: list[float | None], xlabel: str, log: bool = False) -> str | None:
    """Horizontal bars (one per label); labels without a value are left out."""
    pairs = [(lab, v) for lab, v in zip(labels, values) if v is not None]
    if not pairs:
        return None
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(6.0, 0.4 * len(pairs) + 1.0))
        ax.barh(range(len(pairs)), [v for _, v in pairs], color=[f"C{i % 10}" for i in range(len(pairs))])
        ax.set_yticks(range(len(pairs)), [lab for lab, _ in pairs])
        ax.invert_yaxis()
        vals = [v for _, v in pairs]
        if log and min(vals) > 0 and max(vals) / min(vals) > 100:  # log only where linear would hide a bar
            ax.set_xscale("log")
        ax.axvline(0, color="black", lw=0.6)
        ax.set_xlabel(xlabel)
        return _uri(fig)


def rules_heatmap(applied: dict, max_rules: int = 40) -> str | None:
    """Fig. 10: how often each method's trace applied each rule (rows: rules, columns: methods)."""
    ms, rules = applied["methods"], applied["rules"][:max_rules]
    if not ms or not rules:
        return None
    counts = [[applied["counts"].get((r, m), 0) for m in ms] for r in rules]
    with plt.rc_context({**STYLE, "axes.grid": False}):
        fig, ax = plt.subplots(figsize=(1.1 * len(ms) + 3.5, 0.28 * len(rules) + 1.4))
        im = ax.imshow(counts, cmap="Blues", aspect="auto", vmin=0)
        ax.set_xticks(range(len(ms)), [METHOD_LABEL.get(m, m) for m in ms], rotation=20, ha="right")
        ax.set_yticks(range(len(rules)), rules, fontsize=7)
        top = max(max(row) for row in counts) or 1
        for i, row in enumerate(counts):
            for j, n in enumerate(row):
                if n:
                    ax.text(j, i, str(n), ha="center", va="center", fontsize=7,
                            color="white" if n > top / 2 else "black")
        fig.colorbar(im, ax=ax, label="times applied", shrink=0.8)
        return _uri(fig)
