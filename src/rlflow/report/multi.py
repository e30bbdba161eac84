"""The multi-model agent's page (stage ``report_multi``): results/multi/report.html from the metrics of
``train_multi_model`` (format ``rlflow.multi-model/1``).

One table: per model (the training models first, then the held-out ones) the agent's zero-shot improvement of the
cost-target runtime beside greedy's on the same graph, and the output check; then the real interactions (counted
as issue F counts them), the shared encoder's held-out error and the PPO curve. A metrics file that is not that
format is a one-line :class:`RLFlowError` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlflow.errors import RLFlowError
from rlflow.report import figures
from rlflow.report import html as h
from rlflow.report import paper

FORMAT = "rlflow.multi-model/1"


def load_multi(path: Path) -> dict:
    """The metrics document of ``train_multi_model`` at ``path``."""
    path = Path(path)
    if not path.is_file():
        raise RLFlowError(f"{path}: not found (run stage train_multi_model first: snakemake multi --cores 2)")
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RLFlowError(f"{path}: not a valid JSON document ({e.__class__.__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("rows"), list):
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise RLFlowError(f"{path}: not the metrics of train_multi_model (format {FORMAT} with 'rows'; got {got!r})")
    return doc


def verdicts(doc: dict) -> list[str]:
    """One line per held-out model: the agent's improvement against greedy's, and whether it beats greedy."""
    out = []
    for r in doc["rows"]:
        if not r.get("heldout"):
            continue
        a = (r.get("agents") or {}).get("multi_model") or {}
        ours, greedy = a.get("improvement_pct"), r.get("greedy_pct")
        if ours is None or greedy is None:
            out.append(f"{r.get('model')} (held out): no result")
            continue
        word = "beats greedy" if ours > greedy else "does not beat greedy"
        out.append(f"{r.get('model')} (held out): the agent {h.pct(ours, 2)}, greedy {h.pct(greedy, 2)}: {word}")
    return out


def to_html(doc: dict) -> str:
    """The self-contained page."""
    label = doc.get("cost_label") or doc.get("cost_target") or "cost target"
    rows = []
    for r in doc["rows"]:
        a = (r.get("agents") or {}).get("multi_model") or {}
        rows.append((r.get("model"), "held out" if r.get("heldout") else "trained on", h.count(r.get("nodes")),
                     h.num(r.get("initial_ms"), 4), h.pct(r.get("greedy_pct"), 2), h.pct(a.get("improvement_pct"), 2),
                     h.num(a.get("vs_greedy"), 2), h.num(a.get("final_ms"), 4), h.auto(a.get("max_rel_diff")),
                     h.count(a.get("real_steps")), h.num(a.get("seconds"), 1)))
    parts = [h.table(["model", "role", "nodes", f"cost before (ms, {label})", "greedy: improvement",
                      "agent: improvement", "agent: x greedy's", "agent: cost after (ms)", "max output difference",
                      "agent: real steps", "agent: seconds"], rows,
                     "The one agent, with no further training, on each model (greedy search on the same graph and "
                     "cost target beside it); x greedy's = the agent's improvement / greedy's; every agent graph "
                     "was checked equal to its original under onnxruntime (max relative output difference)",
                     cls="left2")]
    lines = verdicts(doc)
    parts.append(h.ul(lines) if lines else h.missing("No held-out model (multi_model.heldout is empty)."))
    it = doc.get("real_interactions") or {}
    enc = (doc.get("encoder") or {}).get("heldout") or {}
    parts.append(h.table(["rollouts", "PPO training", "evaluation", "total", "training (s)", "stage (s)",
                          "encoder: held-out runtime rel. error"],
                         [(h.count(it.get("rollouts")), h.count(it.get("training")), h.count(it.get("evaluation")),
                           h.count(it.get("total")), h.num(doc.get("training_seconds"), 1),
                           h.num(doc.get("seconds"), 1), h.auto(enc.get("runtime_rel_err")))],
                         "Real-environment interactions (steps) of all the training models together: the random "
                         "rollouts the shared encoder learned from, PPO's steps, and the zero-shot runs on every "
                         "model"))
    curve = [c for c in doc.get("curve") or [] if isinstance(c, dict) and "mean_reward" in c]
    parts.append(h.figure(figures.reward_curves(
        [("mean real reward per step", [c["update"] for c in curve], [c["mean_reward"] for c in curve])],
        "mean reward"), "PPO curve", "Mean reward per step in the real environments of the training models, "
                                     "per PPO update"))
    parts.append(h.paper(f"{paper.X_RLFLOW} trains one agent per model and names training one agent on many graphs "
                         "as the open problem; issue K's goal here: on a held-out model the agent beats greedy."))
    trained, held = doc.get("train_models") or [], doc.get("heldout") or []
    header = h.p(f"Trained on {', '.join(trained) or 'none'}; held out: {', '.join(held) or 'none'}; cost target: "
                 f"{label}. From results/multi/metrics.json (stage train_multi_model).", "meta")
    return h.page("RLFlow: one agent for several models", header, [], h.section("multi", "Zero-shot results",
                                                                                   "".join(parts)))
