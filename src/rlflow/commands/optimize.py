"""Optimise an ONNX model with the verified rewrite rules and write the result.

Methods (default: eqsat, the strongest on this machine's target in the project's measurements: optimising for
ort-cpu, eqsat made paper-size taso-bert run 0.800 [0.794, 0.805] of the original's latency on onnxruntime
(interleaved, 60 rounds; FLOPs 4.43 -> 3.49 G) where TASO's search left it unchanged, and bert 0.928
[0.918, 0.938], TASO's graph, in a third of TASO's time; gpt2 0.959 [0.945, 0.972] (TASO's graph 0.979
[0.960, 0.999]) and vit 0.974 [0.957, 0.992] (TASO's: no detectable difference); equality saturation keeps the
results of all rewrites at once, where TASO and greedy follow paths of one rewrite at a time):
  taso    TASO's cost-based backtracking search (--alpha, --budget)
  greedy  apply the best cost-lowering rewrite until none lowers the cost
  eqsat   equality saturation over the rules (Tensat), then the cheapest graph the e-graph holds, extracted by
          an ILP (HiGHS; on ort-cpu a second ILP prices the kernels onnxruntime fuses), cycles filtered out
          during saturation (config section eqsat: node_limit, iter_limit, time_limit_s,
          multi_iterations, extraction, ilp_time_limit_s, ilp_node_limit; set them with --set eqsat.node_limit=...;
          time limits 0 and an ILP node limit: the same result on any machine and load)
  eqsat-rl  equality saturation whose rule families (multi-pattern, conv, matmul, concat-split, transpose,
          elementwise, other) an agent picks per iteration, under the same eqsat settings, then the same ILP
          (rlflow.search.eqsat_rl): with --agent POLICY.json a learned policy (benchmarks/eqsat_rl.py
          --save-policy trains one), else a tree search over the first iterations' choices (UCT,
          eqsat.rl_leaves leaves, default 2, each scored by a short ILP), whose time is part of the optimisation
          time; the pipeline's stage search_eqsat_rl runs the tree search
  rlflow  a trained agent (--agent CKPT) chooses the rewrites in the rewrite environment, from your graph, for
          at most the horizon it was trained with, keeping the cheapest graph seen, in the episodes it was
          trained to run: one greedy episode of the policy snapshot its stage kept (eval_policies: snapshots,
          the default), or eval_episodes episodes (eval_policies: final: the first greedy, the others sampled
          with a fixed seed); a rerun gives the same graph either way. CKPT is
          the checkpoint of the pipeline's train_controller stage (RLFlow's controller, trained in the world
          model's dream: results/<model>/controller/controller.pt) or of train_model_free (the model-free PPO
          baseline: results/<model>/model_free/model_free.pt); it holds the policy, the graph encoder and (the
          controller) the world model. The agent only runs with the rule set it was trained with (same rules,
          same order: checked); any ONNX model works, not only the one it was trained on.
The optimised graph, weight-only nodes folded, is checked equal to the original under onnxruntime on random
inputs (largest relative difference <= --tolerance) before OUT.onnx is written; if the check fails nothing is
written. Then it is checked never slower: the measurement protocol (rlflow.evaluation.protocol; config section
timing: several fresh sessions per graph, randomised interleaved rounds, budget timing.budget_s) compares it with
the original on --backend (default: the backend that verifies the target, on its device: ort for ort-cpu, torch
on the GPU for cuda); unless the protocol calls it faster, OUT.onnx gets the ORIGINAL graph and one line says so
("kept the original: no significant speedup, ratio 1.004 [0.991, 1.017] on ort"). A target this machine cannot
verify (--target sim-h100 on a CPU box) is not checked unless --backend names one: the graph found is written and
labelled "simulated target: not verifiable on this machine". A model with dynamic input dimensions is optimised
at the sizes --input-shape gives; OUT.onnx keeps the dimensions dynamic if, with them put back, it matches the
original under onnxruntime at two other sizes too, else it is written with the given sizes and one line says it
was specialised (rlflow.graph.dynamic). The trace records the check (speed_check) and the
resolved platform (target, backend, device); the summary's first line names them. --no-speed-check skips the
check. The model keeps its input's opset unless --opset raises it: a rule whose fused op a newer opset defines
(constraints.min_opset; Attention: 23) applies only then. Errors (a missing or damaged checkpoint, a rule set that does not match, ...) are one line, exit 2.

Cost target (--target; default: the cost.target of --config/--set if they give one, else `machine`, this
machine's runtime: cuda on a GPU box, else ort-cpu):
  ort-cpu      what onnxruntime will run here: its fusions learned from its optimised model, each kernel timed
               once (a few seconds; cached in --costs if given), the calibrated per-kernel overhead; kernels the
               rewrites create are estimated from the calibrated roofline scaled by measured ratios
  torch-eager  each distinct op timed as a torch eager call (the old --cost-model measured)
  cuda         each op timed on the GPU with CUDA events (needs a GPU)
  sim-v100 | sim-a100 | sim-h100   a simulated GPU (spec figures; results labelled "simulated <GPU>")
  analytic     roofline per op; no timing, fully deterministic

Defaults without --config are the schema defaults (alpha 1.05, budget 1000, no time limit, device auto, seed
0). The rules default to the rule set shipped with rlflow: what the pipeline's generate_rules stage makes
with config.yaml (results/rules/rules.json); --rules FILE takes another (`rlflow generate-rules` makes one).

  rlflow optimize bert.onnx --out bert.opt.onnx
  rlflow optimize model.onnx --out fast.onnx --method greedy --cost-model analytic --trace trace.json
  rlflow optimize bert.onnx --out opt.onnx --input-shape input_ids=1x128 --budget 200 --time-limit 60 --json
  rlflow optimize model.onnx --out opt.onnx --method rlflow --agent results/bert/controller/controller.pt \\
      --rules results/rules/rules.json --trace trace.json
  rlflow optimize model.onnx --out opt.onnx --backend tf --set timing.budget_s=60     (check on TensorFlow, longer)
  rlflow optimize bert.onnx --out opt.onnx --method taso       (TASO's search instead of the default eqsat)
  rlflow optimize bert.onnx --out opt.onnx --opset 23 --rules fused-rules.json   (attention fused into ONNX's
      Attention: the rules file from `rlflow generate-rules --set rules.fused_kernels=true`)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlflow.commands.common import add_model_arguments

NAME = "optimize"
HELP = ("optimise an ONNX model with the verified rules (equality saturation; or TASO's search, greedy, a "
        "trained RLFlow agent); keep it only if faster here")
#: methods of --method: the two searches and the learned agent
METHODS = ("taso", "greedy", "eqsat", "eqsat-rl", "rlflow", "ort-optimizer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from rlflow.config import add_config_arguments

    add_model_arguments(p)
    p.add_argument("--out", required=True, type=Path, metavar="OUT.onnx", help="where to write the optimised model")
    p.add_argument("--method", choices=METHODS, default="eqsat",
                   help="taso | greedy | eqsat | eqsat-rl (searches) | rlflow (a trained agent, needs --agent) | ort-optimizer "
                        "(baseline: onnxruntime's offline transformer optimizer, BERT-type fusions into its contrib "
                        "ops, which only onnxruntime runs; needs no rules) (default: eqsat, "
                        "the strongest measured on this machine's target: on ort-cpu it made taso-bert 0.800 "
                        "[0.794, 0.805] of the original's latency on onnxruntime, where taso changed nothing)")
    p.add_argument("--agent", type=Path, metavar="CKPT",
                   help="rlflow: the agent checkpoint (controller.pt of train_controller or model_free.pt of "
                        "train_model_free); eqsat-rl: a schedule policy (JSON of benchmarks/eqsat_rl.py "
                        "--save-policy; without one, the tree search over schedules)")
    add_config_arguments(p, "search.alpha=1.0")
    p.add_argument("--rules", type=Path, metavar="JSON",
                   help="rules file (default: the rule set shipped with rlflow, the same as the pipeline's "
                        "results/rules/rules.json with config.yaml's rules settings)")
    p.add_argument("--costs", type=Path, metavar="JSON",
                   help="cost cache to read and extend (created if missing; the measured targets only)")
    p.add_argument("--target", metavar="TARGET",
                   help="cost target: ort-cpu | torch-eager | cuda | sim-v100 | sim-a100 | sim-h100 | analytic | "
                        "auto | machine (default: cost.target of --config/--set, else machine)")
    p.add_argument("--cost-model", choices=("measured", "analytic"), help="old spelling of --target")
    p.add_argument("--alpha", type=float, help="taso: keep candidates cheaper than alpha x best (default: search.alpha)")
    p.add_argument("--budget", type=int, help="taso: graphs to expand (default: search.budget)")
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="stop the search after this many seconds (default: search.time_limit_s; eqsat: eqsat.time_limit_s, saturation only; 0 = none)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="largest allowed output difference, relative to output magnitude (default: 1e-4)")
    p.add_argument("--trace", type=Path, metavar="JSON", help="also write the search trace (rules applied, costs)")
    from rlflow.graph.exec import BACKENDS

    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="the never-slower check's backend: keep the optimised graph only if the measurement protocol "
                        "calls it faster here (default: the backend that verifies the target: ort for ort-cpu, "
                        "torch on the GPU for cuda)")
    p.add_argument("--opset", type=int, metavar="N",
                   help="write the optimised model at ONNX opset N (at least the input's; default: the input's). A "
                        "rule whose fused op needs a newer opset (Attention: 23) only applies when the graph's opset "
                        "allows it, so --opset 23 with a rule set that has the fused-kernel rules "
                        "(rules.fused_kernels) lets attention be fused")
    p.add_argument("--no-speed-check", action="store_true",
                   help="write the optimised graph without the never-slower check")
    p.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def run(args: argparse.Namespace) -> int:
    """``rlflow optimize``: :class:`rlflow.api.Optimiser` on the model, then the output, the trace and a summary."""
    import sys
    import time

    from rlflow.api import Optimiser, opset_for_output, summary_lines
    from rlflow.atomic import atomic_path, write_text
    from rlflow.config import load_config
    from rlflow.errors import RLFlowError
    from rlflow.graph import load_onnx
    from rlflow.graph.fold import at_opset
    from rlflow.graph.onnx_io import save_onnx

    t0 = time.perf_counter()
    for p in (args.out, args.trace):
        if p is not None and p.is_dir():
            raise RLFlowError(f"{p}: is a folder, expected a file path")
    config = load_config(args.config, args.overrides)
    explicit = args.config or any(o.startswith(("cost.target=", "cost.model=")) for o in args.overrides)
    # without a config naming one, optimise for this machine's runtime (the pipeline's `auto` simulates a GPU)
    target = args.target or args.cost_model or (None if explicit else "machine")
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print  # stdout: the JSON
    optimiser = Optimiser(config=config, target=target, method=args.method, rules=args.rules, agent=args.agent,
                          backend=args.backend, speed_check=not args.no_speed_check, tolerance=args.tolerance,
                          alpha=args.alpha, budget=args.budget, time_limit=args.time_limit, costs=args.costs,
                          progress=not args.no_progress and not args.json, log=log)
    graph = load_onnx(args.model, args.input_shape)
    if args.opset is not None:
        graph = at_opset(graph, opset_for_output(graph.opset, args.opset, args.model))
    run = optimiser.run(graph, model_name=str(args.model), source=args.model, input_shapes=args.input_shape,
                        not_written=f"{args.out} not written")
    if run.dynamic_model is None:
        save_onnx(run.graph, args.out)
    else:  # the graph with the original's dynamic dimensions, checked at other sizes (rlflow.graph.dynamic)
        with atomic_path(args.out) as tmp:
            tmp.write_bytes(run.dynamic_model.SerializeToString())
    if args.trace is not None:
        write_text(args.trace, json.dumps(run.trace, indent=1) + "\n")
    if args.json:
        doc = {k: v for k, v in run.trace.items() if k != "steps"}
        doc.update(out=str(args.out), trace=None if args.trace is None else str(args.trace),
                   ops_measured=run.ops_measured, rule_names=[s.rule_name for s in run.found.trace],
                   total_seconds=time.perf_counter() - t0)
        print(json.dumps(doc, indent=2))
    else:
        print(_platform_line(args, run.platform))
        print(summary_lines(run, args.method))
        print(f"wrote {args.out}" + (f" and {args.trace}" if args.trace else "")
              + f" ({time.perf_counter() - t0:.1f} s in all)")
    sys.stdout.flush()
    return 0


def _platform_line(args, platform) -> str:
    """``target ort-cpu (onnxruntime CPU (kernels timed)) on cpu; never-slower check: ort`` (printed before the
    summary: a run that fails prints only its error)."""
    check = "none (--no-speed-check)" if args.no_speed_check else (
        args.backend or platform.backend or "none (simulated target: not verifiable on this machine)")
    return f"target {platform.target} ({platform.label}) on {platform.device}; never-slower check: {check}"
