"""Run a model end to end on one backend and report its latency (warm-up, then repeats: median and IQR)
and peak memory where the backend can tell (CUDA devices).

Backends: ort (onnxruntime; CUDA provider when the device is cuda), torch (the IR interpreted with torch ops),
tf (a tf.function built op by op; Grappler on) and tf-xla (the same, compiled with XLA).
With --compare, also report the largest output difference from onnxruntime on the original file.

  rlflow run model.onnx --backend torch --repeats 50
  rlflow run model.onnx --backend tf-xla --config config.yaml      (repeats, warm-up and device from the config)
"""

from __future__ import annotations

import json

from rlflow.commands.common import add_model_arguments

NAME = "run"
HELP = "run a model on ort|torch|tf|tf-xla and report latency"


def add_arguments(p) -> None:
    from rlflow.graph.exec import BACKENDS

    add_model_arguments(p)
    p.add_argument("--backend", choices=BACKENDS, default="ort", help="executor (default: ort)")
    p.add_argument("--config", action="append", metavar="YAML",
                   help="take --repeats/--warmup/--device defaults from this config (run.repeats, run.warmup, device)")
    p.add_argument("--repeats", type=int, help="timed runs (default: run.repeats of --config, else 20)")
    p.add_argument("--warmup", type=int, help="untimed runs before timing (default: run.warmup of --config, else 5)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="device (default: device of --config, else auto)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    p.add_argument("--compare", action="store_true",
                   help="also report max |difference| from onnxruntime on the original file (relative)")


def run(args) -> int:
    from rlflow.config import resolve_device
    from rlflow.errors import RLFlowError
    from rlflow.graph import load_onnx
    from rlflow.graph.exec import backend_errors, check_memory, get_runner, make_inputs, max_rel_diff, time_runner

    if args.config:
        from rlflow.config import load_config

        cfg = load_config(args.config)
        args.repeats = args.repeats if args.repeats is not None else cfg["run"]["repeats"]
        args.warmup = args.warmup if args.warmup is not None else cfg["run"]["warmup"]
        args.device = args.device or cfg["device"]
    args.repeats = 20 if args.repeats is None else args.repeats
    args.warmup = 5 if args.warmup is None else args.warmup
    args.device = args.device or "auto"
    if args.repeats < 1 or args.warmup < 0:
        raise RLFlowError("--repeats must be >= 1 and --warmup >= 0")
    graph = load_onnx(args.model, args.input_shape)
    check_memory(graph, args.model, note=True)
    device = resolve_device({"device": args.device})
    feeds = make_inputs(graph, args.seed)
    with backend_errors(graph, args.backend, feeds, args.model):
        runner = get_runner(graph, args.backend, device)
        result = {"model": args.model, "backend": args.backend, "device": device}
        result.update(time_runner(runner, feeds, args.warmup, args.repeats))
    if args.compare:
        import onnxruntime as ort

        from rlflow.graph.exec.ort_exec import quiet_options

        with backend_errors(graph, "ort", feeds, args.model):
            session = ort.InferenceSession(args.model, quiet_options(), providers=["CPUExecutionProvider"])
            ref = session.run(list(graph.outputs), feeds)
        result["max_rel_diff_vs_ort_original"] = max_rel_diff(ref, runner(feeds))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        mem = result["peak_memory_bytes"]
        print(f"{args.model} on {args.backend} ({device}): median {result['median_ms']:.3f} ms, "
              f"IQR {result['iqr_ms']:.3f} ms over {args.repeats} runs; peak memory "
              + (f"{mem / 2**20:.1f} MiB" if mem is not None else "n/a (backend does not report it)"))
        if args.compare:
            print(f"max relative output difference vs onnxruntime on the original: "
                  f"{result['max_rel_diff_vs_ort_original']:.2e}")
    return 0
