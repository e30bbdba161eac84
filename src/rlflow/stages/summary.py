"""Write the table across models (pipeline stage ``summary``): results/summary.csv and results/summary.html.

Reads every ``<model>.json`` headline in ``--headlines`` (written by each evaluate job: best backend, best
latency, speedup vs the original on onnxruntime, improvement vs TensorFlow, optimisation seconds, real
interactions per method) -- every model that was evaluated, the config's ``models`` first. One CSV row per model x
method x backend (a method whose graph is the original: the A/A control's figures, marked in its ``note``). The
HTML page leads with the answer per model and track (best method, its figure, what found nothing), is
self-contained and links each model's report.html by relative path. No headline files: one line, exit 2, nothing
written.
"""

from __future__ import annotations

import argparse


HELP = "write the table across every evaluated model (pipeline stage summary)"
SET_EXAMPLE = "models=[bert,vit]"


def run(args: argparse.Namespace) -> int:
    from rlflow.atomic import write_text
    from rlflow.config import load_config
    from rlflow.errors import RLFlowError
    from rlflow.report.headline import run_platform
    from rlflow.report.summary import read_headlines, summary_rows, to_csv, to_html

    for p in (args.csv, args.out):
        if p.is_dir():
            raise RLFlowError(f"{p}: is a folder, expected a file path")
    config = load_config(args.config, args.overrides)
    models = list(config.get("models") or [])
    headlines = read_headlines(args.headlines, models)
    default = run_platform(config)  # the platform of a method whose headline entry names none (older files)
    rows = summary_rows(headlines, default)
    have = {str(d["model"]) for d in headlines}
    html = to_html(rows, headlines, args.out, args.headlines, [m for m in models if m not in have], default)
    table = to_csv(rows)
    write_text(args.csv, table)
    write_text(args.out, html)
    print(f"summary: wrote {args.csv} and {args.out}: {len(headlines)} models, {len(rows)} rows", flush=True)
    return 0
