"""Summarise an ONNX model as the IR sees it: op counts, opaque ops (kept unchanged, never rewritten),
inputs and outputs with shapes, parameter count, estimated flops and bytes moved.

  rlflow inspect model.onnx
  rlflow inspect model.onnx --input-shape input_ids=1x128 --json
"""

from __future__ import annotations

import json

from rlflow.commands.common import add_model_arguments

NAME = "inspect"
HELP = "summarise an ONNX model: ops, opaque ops, shapes, parameters, flops"


def add_arguments(p) -> None:
    add_model_arguments(p)


def summary(graph) -> dict:
    from rlflow.graph.ops import graph_bytes, graph_flops

    opaque: dict[str, int] = {}
    for n in graph.opaque_nodes():
        opaque[n.op_type_name()] = opaque.get(n.op_type_name(), 0) + 1
    return {
        "name": graph.name,
        "opset": graph.opset,
        "nodes": len(graph.nodes),
        "op_counts": graph.op_counts(),
        "opaque_ops": dict(sorted(opaque.items())),
        "inputs": {v: str(graph.types[v]) for v in graph.inputs},
        "outputs": {v: str(graph.types[v]) for v in graph.outputs},
        "parameters": graph.num_params(),
        "flops": graph_flops(graph),
        "bytes_moved": graph_bytes(graph),
        "structural_hash": graph.structural_hash(),
    }


def run(args) -> int:
    from rlflow.graph import load_onnx

    s = summary(load_onnx(args.model, args.input_shape))
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    print(f"{args.model}: graph '{s['name']}', opset {s['opset']}, {s['nodes']} nodes")
    for kind in ("inputs", "outputs"):
        for v, t in s[kind].items():
            print(f"  {kind[:-1]:<6} {v}: {t}")
    print(f"  parameters   {s['parameters']:,}")
    print(f"  flops        {s['flops']:,} ({s['flops'] / 1e9:.3f} GFLOP)")
    print(f"  bytes moved  {s['bytes_moved']:,} ({s['bytes_moved'] / 2**20:.1f} MiB)")
    print("  op counts:")
    for op, k in s["op_counts"].items():
        print(f"    {op:<22} {k}")
    if s["opaque_ops"]:
        print("  opaque ops (kept unchanged, never rewritten): "
              + ", ".join(f"{op} x{k}" for op, k in s["opaque_ops"].items()))
    else:
        print("  opaque ops: none")
    return 0
