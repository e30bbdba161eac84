"""Write the multi-model agent's page (pipeline stage report_multi; opt-in with ``snakemake multi --cores 2``).

Reads the metrics of ``train_multi_model`` (``--metrics``, JSON ``rlflow.multi-model/1``) and writes one
self-contained HTML page (``--out``): per model, the agent's zero-shot improvement beside greedy's and the output
check, whether it beats greedy on each held-out model, the real interactions and the PPO curve. A missing or
foreign metrics file is one line, exit 2, nothing written.
"""

from __future__ import annotations

import argparse

HELP = "write the multi-model agent's HTML page (pipeline stage report_multi)"
SET_EXAMPLE = "seed=0"


def run(args: argparse.Namespace) -> int:
    from rlflow.atomic import write_text
    from rlflow.errors import RLFlowError
    from rlflow.report.multi import load_multi, to_html, verdicts

    if args.out.is_dir():
        raise RLFlowError(f"{args.out}: is a folder, expected the page's file path")
    doc = load_multi(args.metrics)
    html = to_html(doc)
    write_text(args.out, html)
    print(f"report_multi: wrote {args.out} ({len(html) / 1024:.0f} KiB, {len(doc['rows'])} models)"
          + "".join(f"; {line}" for line in verdicts(doc)), flush=True)
    return 0
