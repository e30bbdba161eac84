"""What do single rounds of an A/A comparison look like? The figures behind the protocol's per-session estimator.

Runs ``--comparisons`` A/A comparisons of a paper-size zoo model (default bert) on onnxruntime under the measurement
protocol (rlflow.evaluation.protocol; ``--set timing.sessions=8`` and ``--budget`` 60 s per comparison by default),
records every timed call with its position in the round, and prints:

- the per-round log ratio's percentiles (how heavy its tails are);
- the position effect: per session, the mean log ratio of the rounds where the original ran first minus that of
  the rounds where it ran second, averaged over the sessions with its t statistic (the protocol's mirrored round
  pairs make both kinds equally many);
- per candidate per-session estimator (median, mean, 10% and 20% trimmed means): the spread of the session
  values, a Shapiro-Wilk normality test over them (the t interval assumes normal session values), and, from
  ``--resamples`` comparisons of ``timing.sessions`` sessions drawn from the recorded ones (centred, so the null
  holds), the false-positive rate of the t interval and the median smallest detectable effect.

Use a quiet machine. ``--save FILE`` keeps the recorded rounds (JSON) and ``--load FILE`` analyses them again.

  python benchmarks/aa_rounds.py                        # 6 comparisons of bert, 8 sessions, 60 s each (~7 min)
  python benchmarks/aa_rounds.py --short                # a check that it works: tiny bert, 2 x 2 s
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

ESTIMATORS = {
    "median": np.median,
    "mean": np.mean,
    "trim10": lambda x: stats.trim_mean(x, 0.1),
    "trim20": lambda x: stats.trim_mean(x, 0.2),
}


def record(model: str, sizes: dict, comparisons: int, protocol, seed: int) -> list[list[dict]]:
    """Per comparison, per session: ``{"first": [1 if the original ran first in round k], "log_ratio": [...]}``."""
    from dataclasses import replace

    from rlflow.evaluation.protocol import aa_copy, compare
    from rlflow.graph import zoo
    from rlflow.graph.exec import get_runner, make_inputs
    from rlflow.graph.onnx_io import load_onnx

    with tempfile.TemporaryDirectory(prefix="rlflow-aa-rounds-") as tmp:
        path = Path(tmp) / f"{model}.onnx"
        zoo.export_model(model, path, sizes)
        original = load_onnx(path)
    copy = aa_copy(original)
    feeds = make_inputs(original, seed)
    out = []
    for k in range(comparisons):
        calls: list[str] = []  # who ran, in order (warm-up calls included)

        def make_runner(graph):
            run, who = get_runner(graph, "ort", "cpu"), "original" if graph is original else "copy"

            def logged(f):
                calls.append(who)
                return run(f)

            return logged

        p = replace(protocol, seed=seed + 1000 * k)
        c = compare([("original", original), ("copy", copy)], feeds, p, make_runner)
        sessions, pos = [], 0
        for s, n_rounds in enumerate(c.rounds):
            pos += 2 * p.warmup
            firsts = [calls[pos + 2 * r] == "original" for r in range(n_rounds)]
            pos += 2 * n_rounds
            ref = np.asarray(c["original"].times_ms[s])
            other = np.asarray(c["copy"].times_ms[s])
            sessions.append({"first": [int(f) for f in firsts], "log_ratio": np.log(other / ref).tolist()})
        out.append(sessions)
        e = c["copy"]
        print(f"comparison {k + 1}/{comparisons}: ratio {e.interval()} -> {e.verdict}", flush=True)
    return out


def analyse(data: list[list[dict]], n_sessions: int, resamples: int, seed: int) -> None:
    sessions = [s for comp in data for s in comp]
    lr_all = np.concatenate([s["log_ratio"] for s in sessions]) * 100
    pct = np.percentile(lr_all, [5, 25, 50, 75, 95])
    print(f"{len(sessions)} sessions, {len(lr_all)} rounds; per-round log ratio (%) percentiles 5/25/50/75/95: "
          + " / ".join(f"{v:+.2f}" for v in pct))
    diffs = []
    for s in sessions:
        lr, first = np.asarray(s["log_ratio"]) * 100, np.asarray(s["first"], bool)
        if first.any() and (~first).any():
            diffs.append(lr[first].mean() - lr[~first].mean())
    if len(diffs) > 1:
        d = np.asarray(diffs)
        se = d.std(ddof=1) / np.sqrt(len(d))
        print(f"position effect (original first minus original second): {d.mean():+.2f}% (t = {d.mean() / se:.1f}, "
              f"{len(d)} sessions)")
    rng = np.random.default_rng(seed)
    q = stats.t.ppf(0.975, n_sessions - 1)
    q_power = stats.t.ppf(0.8, n_sessions - 1)
    for name, fn in ESTIMATORS.items():
        vals = np.array([fn(np.asarray(s["log_ratio"])) for s in sessions])
        centred = vals - vals.mean()
        fp, ses = 0, []
        for _ in range(resamples):
            x = centred[rng.integers(len(centred), size=n_sessions)]
            se = x.std(ddof=1) / np.sqrt(n_sessions)
            ses.append(se)
            fp += bool(se > 0 and abs(x.mean()) / se > q)
        shapiro = stats.shapiro(vals).pvalue if len(vals) >= 3 else float("nan")
        print(f"{name:7s} session values: sd {100 * vals.std(ddof=1):.2f}%, mean {100 * vals.mean():+.2f}%, "
              f"Shapiro-Wilk p {shapiro:.3f}; {n_sessions} resampled sessions: false positives "
              f"{100 * fp / resamples:.1f}%, median smallest detectable {100 * np.expm1((q + q_power) * np.median(ses)):.2f}%")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert")
    ap.add_argument("--comparisons", type=int, default=6)
    ap.add_argument("--budget", type=float, default=60.0, help="seconds of timing per comparison")
    ap.add_argument("--resamples", type=int, default=20000)
    ap.add_argument("--short", action="store_true", help="tiny sizes, 2 comparisons of 2 s")
    ap.add_argument("--save", type=Path, help="write the recorded rounds here (JSON)")
    ap.add_argument("--load", type=Path, help="analyse rounds recorded earlier instead of timing")
    ap.add_argument("--config", action="append", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()

    from rlflow.config import load_config
    from rlflow.errors import RLFlowError
    from rlflow.evaluation.protocol import Protocol
    from rlflow.graph import zoo

    try:
        config = load_config(args.config or [ROOT / "config.yaml"], ["timing.sessions=8", *args.overrides])
        protocol = Protocol.from_config(config, 2.0 if args.short else args.budget)
    except RLFlowError as e:
        print(f"aa_rounds: {e}", file=sys.stderr)
        return 2
    if args.load:
        data = json.loads(args.load.read_text())
    else:
        if args.model not in config["zoo"]:
            print(f"aa_rounds: unknown model {args.model!r} (zoo: {', '.join(config['zoo'])})", file=sys.stderr)
            return 2
        sizes = dict(zoo.TINY_SIZES[args.model]) if args.short else dict(config["zoo"][args.model])
        t0 = time.perf_counter()
        data = record(args.model, sizes, 2 if args.short else args.comparisons, protocol, int(config["seed"]))
        print(f"recorded in {time.perf_counter() - t0:.0f} s", flush=True)
        if args.save:
            args.save.write_text(json.dumps(data))
    analyse(data, protocol.sessions, args.resamples, int(config["seed"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
