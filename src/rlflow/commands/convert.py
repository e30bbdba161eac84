"""Import an ONNX model into the IR and write it back: constant shape computations folded, dynamic input
dimensions fixed (--input-shape), every op kept (ops outside the IR's set are carried through unchanged).
The written file passes the full ONNX checker and computes the same outputs (checked with onnxruntime).

  rlflow convert model.onnx --out static.onnx --input-shape input_ids=1x128
"""

from __future__ import annotations

from rlflow.commands.common import add_model_arguments

NAME = "convert"
HELP = "import an ONNX model and write it back static and folded (outputs verified)"


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--out", required=True, metavar="OUT.onnx", help="where to write the converted model")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest allowed output difference, relative to output magnitude (default: 1e-4)")


def run(args) -> int:
    import json

    import onnxruntime as ort

    from rlflow.errors import RLFlowError
    from rlflow.graph import load_onnx, save_onnx, to_onnx
    from rlflow.graph.exec import backend_errors, check_memory, make_inputs, max_rel_diff
    from rlflow.graph.exec.ort_exec import quiet_options

    graph = load_onnx(args.model, args.input_shape)
    check_memory(graph, args.model, note=True)
    feeds = make_inputs(graph)
    with backend_errors(graph, "ort", feeds, args.model):  # the user's file: its errors are one line
        session = ort.InferenceSession(args.model, quiet_options(), providers=["CPUExecutionProvider"])
        ref = session.run(list(graph.outputs), feeds)
    new = ort.InferenceSession(to_onnx(graph).SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(list(graph.outputs), feeds)
    diff = max_rel_diff(ref, new)
    if not diff <= args.tolerance:
        raise RLFlowError(f"{args.model}: converted outputs differ by {diff:.2e} (> {args.tolerance}); nothing written")
    save_onnx(graph, args.out)
    result = {"out": args.out, "nodes": len(graph.nodes), "max_rel_diff": diff}
    print(json.dumps(result) if args.json else f"wrote {args.out}: {len(graph.nodes)} nodes, "
          f"max relative output difference {diff:.2e}")
    return 0
