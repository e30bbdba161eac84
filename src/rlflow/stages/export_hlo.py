"""Lower a model's ONNX graph to its unoptimised XLA HLO module (pipeline stage ``export_hlo``).

The graph is imported into the IR and lowered op by op through the JAX lowering of the op registry
(:func:`rlflow.graph.exec.jax_exec.hlo_text`). Config key xla.weights: ``parameters`` (default) passes the
weights as module parameters, so the module holds the computation and stays small (what the pass-ordering env
needs: a step re-reads the module); ``constants`` prints every weight in full, so the module is the model. A
graph with an op outside the registry (an opaque node) has no lowering: one line naming the node, exit 2,
nothing written. Writes the HLO text, atomically.
"""

from __future__ import annotations

import argparse
import time

HELP = "lower a model's ONNX graph to its XLA HLO module (pipeline stage export_hlo)"
SET_EXAMPLE = "xla.weights=constants"


def run(args: argparse.Namespace) -> int:
    from rlflow.atomic import write_text
    from rlflow.config import get, load_config
    from rlflow.errors import RLFlowError
    from rlflow.graph.exec.jax_exec import hlo_text
    from rlflow.graph.onnx_io import load_onnx

    config = load_config(args.config, args.overrides)
    if args.out.is_dir():
        raise RLFlowError(f"{args.out}: --out is a folder, expected an .hlo file path")
    t0 = time.perf_counter()
    text = hlo_text(load_onnx(args.onnx), get(config, "xla.weights"))
    write_text(args.out, text)
    from rlflow.xla.hlo import histogram, parse

    ops = sum(histogram(parse(text, str(args.out))).values())
    print(f"export_hlo: wrote {args.out} ({args.model}: {ops} HLO ops, {len(text) / 1e6:.1f} MB) "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0
