"""onnxruntime's offline transformer optimizer as a baseline method (pipeline stage search_ortopt, method
``ort_optimizer`` of the machine track; docs/pipeline-tracks.md).

What a user of onnxruntime picks instead of a rewrite search: ``onnxruntime.transformers.optimizer.optimize_model``
with the model type of the zoo model (bert and taso-bert: bert; vit; gpt2), its head count and hidden size from
``zoo.<model>``, at the optimizer's default level. Its graph holds onnxruntime contrib ops (com.microsoft
SkipLayerNormalization, Gelu, Attention, ...), kept as opaque nodes: only onnxruntime runs them, so evaluate times
it on onnxruntime and marks the other backends' rows unsupported. For a model that is no transformer the optimizer
does not apply: the original graph is written and the trace says so. No never-slower check: the graph is the
tool's output as its users receive it. The graph is checked equal to the original under onnxruntime before
anything is written; the cost estimates in the trace are the machine target's (the cost cache --costs).

Reads these config keys: seed, device, cost.target (the machine track sets it to ``machine``), cost.gpus,
cost.peak, zoo.<model> (heads, hidden).
Writes OUT (the optimised ONNX) and TRACE (JSON: the contrib ops fused, cost before/after, seconds, max output
difference), atomically.
"""

from __future__ import annotations

import argparse
import time

HELP = ("onnxruntime's offline transformer optimizer (baseline); verified ONNX and trace "
        "(pipeline stage search_ortopt)")
SET_EXAMPLE = "cost.target=machine"


def run(args: argparse.Namespace) -> int:
    from rlflow.config import get, load_config, resolve_device
    from rlflow.cost import make_cost_model
    from rlflow.cost.platform import resolve_platform
    from rlflow.errors import RLFlowError
    from rlflow.graph.onnx_io import load_onnx
    from rlflow.search.ort_optimizer import model_type, ort_optimizer
    from rlflow.search.output import verify_and_write

    t0 = time.perf_counter()
    for p in (args.out, args.trace):
        if p.is_dir():
            raise RLFlowError(f"{p}: is a folder, expected a file path")
    config = load_config(args.config, args.overrides)
    device, seed = resolve_device(config), get(config, "seed")
    platform = resolve_platform(config)
    kind = model_type(args.model)
    sizes = (config.get("zoo") or {}).get(args.model) or {}
    heads, hidden = int(sizes.get("heads", 0)), int(sizes.get("hidden", 0))
    original = load_onnx(args.onnx)
    cost = make_cost_model(config, device, args.costs)
    print(f"search_ortopt: {args.model}: {len(original.nodes)} nodes; onnxruntime transformer optimizer, model type "
          f"{kind or 'none (not a transformer)'}, heads {heads}, hidden {hidden}; cost model {cost.name}", flush=True)
    result = ort_optimizer(original, args.onnx, kind, cost, heads, hidden)
    extra = {"model": args.model, "onnx": str(args.onnx), "device": device, "cost_model": cost.name,
             "cost": dict(cost.describe()), "platform": platform.as_dict(),
             "config": {"seed": seed, "device": config.get("device"), "cost.target": platform.target}}
    diff, _ = verify_and_write(original, result, args.out, args.trace, extra, seed=seed, device=device)
    print(f"search_ortopt: {result.stop_reason}; nodes {result.nodes_before} -> {result.nodes_after}, estimate "
          f"{result.initial.runtime_ms:.4f} -> {result.final.runtime_ms:.4f} ms ({cost.name}), max output difference "
          f"{diff:.2e}", flush=True)
    print(f"search_ortopt: wrote {args.out} and {args.trace} ({time.perf_counter() - t0:.1f} s in all)", flush=True)
    return 0
