"""Run a model end to end on one backend and report its latency (warm-up, then repeats: median and IQR)
and peak memory where the backend can tell (CUDA devices).

Backends: ort (onnxruntime; CUDA provider when the device is cuda), torch (the IR interpreted with torch ops),
tf (a tf.function built op by op; Grappler on) and tf-xla (the same, compiled with XLA).
With --compare [REF.onnx], also compare it with REF (default: the model itself, exported and imported again
through the IR: an A/A test of the machine's noise) under the measurement protocol (rlflow.evaluation.protocol:
config section timing, --budget seconds): the latency ratio model / REF on the backend with its 95% interval
(paired by round; Student's t over several fresh sessions per graph, randomised interleaved rounds), the verdict
(faster / slower / no detectable difference) and the smallest effect the comparison could detect; and the
largest output difference from onnxruntime running REF's file.

  rlflow run model.onnx --backend torch --repeats 50
  rlflow run model.onnx --backend tf-xla --config config.yaml      (repeats, warm-up and device from the config)
  rlflow run opt.onnx --compare model.onnx --budget 60             (is opt.onnx faster than model.onnx on ort?)
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
    p.add_argument("--compare", nargs="?", const="", metavar="REF.onnx",
                   help="also compare with REF.onnx (default: the model re-exported, an A/A test) under the "
                        "measurement protocol: latency ratio with 95%% interval and verdict, and max |difference| "
                        "from onnxruntime on REF's file (relative)")
    p.add_argument("--budget", type=float, metavar="SECONDS",
                   help="--compare: seconds of timing (default: timing.budget_s of --config, else the schema's)")


def run(args) -> int:
    from rlflow.config import load_config, resolve_device
    from rlflow.errors import RLFlowError
    from rlflow.graph import load_onnx
    from rlflow.graph.exec import backend_errors, check_memory, get_runner, make_inputs, max_rel_diff, time_runner

    cfg = load_config(args.config) if args.config else load_config(None)
    if args.config:
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
    if args.compare is not None:
        import onnxruntime as ort

        from rlflow.evaluation.protocol import Protocol, aa_copy, backend_runner, compare
        from rlflow.evaluation.runs import check_interface
        from rlflow.graph.exec.ort_exec import quiet_options

        ref_path = args.compare or args.model
        reference = load_onnx(ref_path, args.input_shape) if args.compare else aa_copy(graph)
        check_interface(reference, graph, str(args.model))
        with backend_errors(reference, "ort", feeds, ref_path):
            session = ort.InferenceSession(ref_path, quiet_options(), providers=["CPUExecutionProvider"])
            ref = session.run(list(graph.outputs), feeds)
        result["max_rel_diff_vs_ort_original"] = max_rel_diff(ref, runner(feeds))
        runner = None
        if args.budget is not None and not args.budget > 0:
            raise RLFlowError("--budget must be > 0")
        protocol = Protocol.from_config({**cfg, "seed": args.seed}, budget_s=args.budget)
        with backend_errors(graph, args.backend, feeds, args.model), backend_runner(args.backend, device) as fresh:
            c = compare([("reference", reference), ("model", graph)], feeds, protocol, fresh)
        e = c["model"]
        result["compare"] = {"reference": ref_path if args.compare else f"{ref_path} (re-exported: A/A)",
                             "ratio": e.ratio, "ci_low": e.ci_low, "ci_high": e.ci_high, "verdict": e.verdict,
                             "detectable_effect": e.detectable, "sessions": protocol.sessions, "runs": e.runs,
                             "reference_median_ms": c["reference"].median_ms, "median_ms": e.median_ms,
                             "seconds": c.seconds}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        mem = result["peak_memory_bytes"]
        print(f"{args.model} on {args.backend} ({device}): median {result['median_ms']:.3f} ms, "
              f"IQR {result['iqr_ms']:.3f} ms over {args.repeats} runs; peak memory "
              + (f"{mem / 2**20:.1f} MiB" if mem is not None else "n/a (backend does not report it)"))
        if args.compare is not None:
            cmp = result["compare"]
            print(f"max relative output difference vs onnxruntime on {cmp['reference']}: "
                  f"{result['max_rel_diff_vs_ort_original']:.2e}")
            print(f"vs {cmp['reference']} on {args.backend}: ratio {cmp['ratio']:.3f} [{cmp['ci_low']:.3f}, "
                  f"{cmp['ci_high']:.3f}] (95%, {cmp['sessions']} sessions each, {cmp['seconds']:.0f} s): "
                  f"{cmp['verdict']}; smallest detectable effect {100 * cmp['detectable_effect']:.1f}%")
    return 0
