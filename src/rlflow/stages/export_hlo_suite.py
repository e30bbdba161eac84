"""Export the HLO suite: zoo families and their variants, inference and training form, split into training and
held-out sets by family (pipeline stage ``export_hlo_suite``).

Config ``xla.suite``: ``train_families`` and ``heldout_families`` (zoo models; a family is in one split only),
``forms`` (``inference``: the forward pass; ``training``: forward and backward through ``jax.grad``) and
``variants`` (per family, a list of size overrides over ``zoo.<family>``; a family without variants gets one
module at its configured sizes). See :mod:`rlflow.xla.suite`.

Writes every module under ``--out-dir/<split>/<name>.hlo`` and ``--manifest`` (JSON ``rlflow.xla-suite/1``: the
families of each split, module counts per split and family, each module's sizes, op count and file), atomically.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

HELP = "export the HLO suite of zoo families and variants, split by family (pipeline stage export_hlo_suite)"
SET_EXAMPLE = "xla.suite.forms=[inference]"


def run(args: argparse.Namespace) -> int:
    from rlflow.atomic import write_text
    from rlflow.config import get, load_config
    from rlflow.errors import RLFlowError
    from rlflow.xla.suite import export_suite, plan

    config = load_config(args.config, args.overrides)
    suite = dict(get(config, "xla.suite"))
    modules = plan(suite)  # checked before anything is written
    if args.out_dir.resolve().parent != args.manifest.resolve().parent:
        raise RLFlowError(f"--manifest {args.manifest} must sit beside --out-dir {args.out_dir} (same folder)")
    t0 = time.perf_counter()
    print(f"export_hlo_suite: {len(modules)} modules", flush=True)
    if args.out_dir.exists():
        shutil.rmtree(args.out_dir)  # a module of an earlier config must not stay behind
    doc = export_suite(suite, dict(get(config, "zoo")), args.out_dir, int(get(config, "seed")),
                       log=lambda line: print(f"export_hlo_suite: {line}", flush=True))
    doc["seconds"] = time.perf_counter() - t0
    write_text(args.manifest, json.dumps(doc, indent=2) + "\n")
    counts = "; ".join(f"{s}: " + ", ".join(f"{f} {n}" for f, n in c.items()) for s, c in doc["counts"].items())
    print(f"export_hlo_suite: wrote {args.manifest}: {counts} ({doc['seconds']:.1f} s)", flush=True)
    return 0
