"""The XLA pass agents vs XLA's own pipeline and the baselines on every module of the HLO suite's held-out split
(pipeline stage ``evaluate_passes_suite``): the paper's test, graphs of families the agents never trained on.

Each held-out module (``--manifest``, from export_hlo_suite) is evaluated as evaluate_passes evaluates a model's
module (:func:`rlflow.stages.passes_common.evaluate_module`: XLA's default pipeline, random orders, greedy and
every agent of ``xla.variants``; with ``xla.time_modules`` the XLA CPU timing with an A/A control and each agent's
module chosen by latency, XLA's default module always a candidate), with the suite's own timing budgets
(``xla.suite_time_budget_s`` and ``xla.suite_select_budget_s``: the suite has many modules). Per method: the
geometric mean over the modules of the paper's ratio (ops_0 - ops_method) / (ops_0 - ops_default) (modules where
XLA's default pipeline adds ops have no ratio and are left out, and counted), and the runtime verdicts.

Writes ``--out`` (JSON ``rlflow.xla-suite-passes/1``: every module's evaluate_passes document, the geometric
means and the verdict counts) and ``--csv`` (evaluate_passes' columns, one row per module and method),
atomically.
"""

from __future__ import annotations

import argparse
import json
import time

HELP = ("XLA pass agents vs XLA's default pipeline, random orders and greedy on the HLO suite's held-out modules "
        "(pipeline stage evaluate_passes_suite)")
SET_EXAMPLE = "xla.suite_time_budget_s=5"
FORMAT = "rlflow.xla-suite-passes/1"


def summarise(docs: list[dict]) -> dict:
    """Per method: the geometric mean of the paper's ratio over the modules that have one, how many were left
    out, and the runtime verdicts against XLA's default module (``faster`` / ``slower`` / ``no detectable
    difference`` counts; modules whose A/A control failed counted as too noisy)."""
    from rlflow.xla.metric import geomean_ratio

    out: dict[str, dict] = {}
    for doc in docs:
        noisy = bool((doc.get("runtime") or {}).get("too_noisy"))
        for m in doc["methods"]:
            s = out.setdefault(m["method"], {"ratios": [], "no_ratio": 0, "verdicts": {}, "too_noisy": 0})
            if m["ratio_vs_default"] is None:
                s["no_ratio"] += 1
            else:
                s["ratios"].append(m["ratio_vs_default"])
            verdict = (m.get("runtime") or {}).get("verdict")
            if m["method"] != "xla_default" and verdict is not None:
                key = "too_noisy" if noisy else verdict
                s["verdicts"][key] = s["verdicts"].get(key, 0) + 1
    for s in out.values():
        s["geomean_ratio"] = geomean_ratio(s["ratios"])
        s["modules_with_ratio"] = len(s.pop("ratios"))
        s.pop("too_noisy")
    return out


def run(args: argparse.Namespace) -> int:
    from rlflow.atomic import write_text
    from rlflow.config import get, load_config
    from rlflow.stages.passes_common import CSV_COLUMNS, evaluate_module, load_agents, to_csv
    from rlflow.xla.suite import split_paths

    config = load_config(args.config, args.overrides)
    x = get(config, "xla")
    paths = split_paths(args.manifest, "heldout")
    agents = load_agents(config, args.agents_dir)
    t0 = time.perf_counter()
    print(f"evaluate_passes_suite: {len(paths)} held-out modules ({', '.join(x['suite']['heldout_families'])}); "
          f"agents {', '.join(agents)} trained on "
          f"{'the suite' if x['train_on'] == 'suite' else ', '.join(x['train_models'])}", flush=True)
    docs = []
    for i, path in enumerate(paths, 1):
        print(f"evaluate_passes_suite: module {i}/{len(paths)}: {path.stem}", flush=True)
        docs.append(evaluate_module(config, path, path.stem, agents, True, float(x["suite_time_budget_s"]),
                                    float(x["suite_select_budget_s"]),
                                    log=lambda line: print(f"evaluate_passes_suite: {line}", flush=True)))
    summary = summarise(docs)
    doc = {"format": FORMAT, "split": "heldout", "families": list(x["suite"]["heldout_families"]),
           "train_on": x["train_on"], "modules": docs, "summary": summary, "seconds": time.perf_counter() - t0}
    write_text(args.out, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    rows = [line for d in docs for line in to_csv(d).splitlines()[1:]]
    write_text(args.csv, "\n".join([",".join(CSV_COLUMNS), *rows]) + "\n")
    for method, s in summary.items():
        g = s["geomean_ratio"]
        print(f"evaluate_passes_suite: {method}: geometric mean of the paper's ratio "
              f"{'n/a' if g is None else f'{g:.3f}'} over {s['modules_with_ratio']} modules"
              + (f" ({s['no_ratio']} without one)" if s["no_ratio"] else "")
              + (f"; XLA CPU vs the default: {s['verdicts']}" if s["verdicts"] else ""), flush=True)
    print(f"evaluate_passes_suite: wrote {args.out} ({doc['seconds']:.0f} s)", flush=True)
    return 0
