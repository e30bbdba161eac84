"""Write a model's report: ONE self-contained HTML file with the RLFlow paper's tables and figures filled with this
run's numbers, the papers' numbers beside them (pipeline stage ``report``).

Reads the model's results folder (``--results results/<model>``): evaluation.csv (required: without it the stage
fails with one line and writes nothing), and, where they exist, the evaluate stage's metrics.json, the methods'
trace.json files, the encoder's, world model's (and its loss.csv), controller's and model-free agent's
metrics.json, the temperature and reward sweeps configured in sweeps.*, rollouts.json, and the rule statistics
(``--rules-stats``). A section whose inputs are missing says which stage has not run.

The config (every section of it is passed by the pipeline) is shown in the report, with package versions and the
machine. Figures are SVG made by matplotlib and embedded in the page; the page loads nothing from elsewhere.
"""

from __future__ import annotations

import argparse


HELP = "write a model's self-contained HTML report (pipeline stage report)"
SET_EXAMPLE = "sweeps.temperatures=[0.5,1.5]"


def run(args: argparse.Namespace) -> int:
    from rlflow.atomic import write_text
    from rlflow.config import load_config
    from rlflow.errors import RLFlowError
    from rlflow.report.data import load_report_data
    from rlflow.report.render import render_report

    if args.out.is_dir():
        raise RLFlowError(f"{args.out}: is a folder, expected the report's file path")
    config = load_config(args.config, args.overrides)
    data = load_report_data(args.model, args.results, args.rules_stats, config)
    html = render_report(data)
    write_text(args.out, html)
    absent = [name for name, inp in (("encoder", data.encoder), ("world model", data.world_model),
                                     ("controller", data.controller), ("model-free", data.model_free))
              if not inp.ok]
    print(f"report: wrote {args.out} ({len(html) / 1024:.0f} KiB, {len(data.evaluation)} evaluation rows)"
          + (f"; not run: {', '.join(absent)}" if absent else ""), flush=True)
    return 0
