"""Fused kernels against TASO on torch op by op, with the measurement protocol (issue N's torch-eager figures).

For each model (zoo export at paper size, its opset raised to 23 with :func:`rlflow.graph.fold.at_opset`, which
also writes GPT-2's multiplicative causal mask as an additive one), on the cost target ``--target`` (default
``torch-eager``: each op a torch eager call on this CPU, timed and cached):

1. **TASO without the fused rules**: ``taso`` (the config's alpha and budget) with the shipped rule set.
2. **The fused graph**: each of ``--methods`` with the shipped rules plus the verified fused-kernel family
   (:func:`rlflow.rewrite.builtin.fused_kernel_rules`); the one the target scores lowest is kept (one currency:
   the target's estimate chooses, not the timing below).
3. **Outputs**: both graphs against the original on onnxruntime and on torch (largest relative difference; the
   project's tolerance 1e-4).
4. **Time outside the GEMMs** (the part fusion can remove) per graph, torch op by op: per-node wall time outside
   MatMul / Gemm / Conv / Attention, and torch.profiler's self CPU time outside the GEMM kernels (SDPA's kernel,
   which does its own products, counts as outside there), both in ms per run.
5. **The protocol** (:func:`rlflow.evaluation.protocol.compare`, ``--sessions`` fresh runners per graph,
   ``--budget-s`` of timing) on torch, op by op: TASO's graph the reference, then the fused graph, the original
   and an A/A copy of TASO's graph (which must come out "same"); the fused graph against the original from the
   same rounds. Then on onnxruntime: the original the reference, the fused graph ungated (never-slower not
   applied) and an A/A copy.

Goal (issue N): the fused graph removes at least half of the original's time outside the GEMMs, i.e. its ratio to
the original is at most ``1 - share / 2``, and it is at least 5% faster than TASO's graph (ratio <= 0.95).

  python benchmarks/fused_protocol.py --models bert vit gpt2 --budget-s 60
  python benchmarks/fused_protocol.py --models bert --size tiny --budget-s 5 --methods greedy   # a quick look
  python benchmarks/fused_protocol.py --device cuda --methods taso greedy --budget-s 20   # on a GPU (gpu_check's
                                                                                          # part "fused")

On ``--device cuda`` the target is ``cuda`` (each op timed with CUDA events), the share outside the GEMMs is the
kernels' GPU time outside cuBLAS' and CUTLASS' GEMM kernels (torch.profiler; SDPA's kernels count as outside),
and onnxruntime is not compared (the GPU machines lent here carry its CPU build).

The last lines are ``fused_protocol <model>: ...``, one per model.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemm_share import GEMM_OPS, per_node_times, profiler_share  # noqa: E402


def _search(method: str, graph, rules, cost, config):
    from rlflow.search.common import finish
    from rlflow.search.output import run_method
    from rlflow.stages.search_common import eqsat_settings

    s = config["search"]
    t0 = time.perf_counter()
    found = run_method(method, graph, rules, cost, alpha=s["alpha"], budget=s["budget"],
                       time_limit_s=s["time_limit_s"], eqsat=eqsat_settings(config, method))
    out, metrics = finish(found.graph, cost)
    return out, metrics.runtime_ms, time.perf_counter() - t0


def _outside_ms(graph, feeds, rounds: int, device: str) -> tuple[float, float, float]:
    """(op-by-op ms per run; of it, ms outside MatMul/Gemm/Conv/Attention by per-node wall time (NaN on cuda,
    where a node's wall time is its launch, not its kernel); ms outside the GEMM kernels by torch.profiler: self
    CPU time on the CPU, kernel time on cuda, scaled to the op-by-op time)."""
    import torch

    from rlflow.graph.exec.torch_exec import TorchRunner

    r = TorchRunner(graph, device)
    for _ in range(3):
        r.run_tensors(feeds)
    if device == "cpu":
        by_op = per_node_times(r, feeds, rounds)
        total = sum(by_op.values())
        node_out = total - sum(by_op.get(op, 0.0) for op in GEMM_OPS)
        pg, pt = profiler_share(r, feeds, rounds)
        return 1e3 * total / rounds, 1e3 * node_out / rounds, 1e3 * total / rounds * (1 - pg / pt)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        r.run_tensors(feeds)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    pg, pt = kernel_share(r, feeds, rounds)
    return 1e3 * total / rounds, float("nan"), 1e3 * total / rounds * (1 - pg / pt)


def kernel_share(runner, feeds, rounds: int) -> tuple[float, float]:
    """(GEMM kernels' GPU seconds, all kernels' GPU seconds) under torch.profiler: a kernel counts as GEMM when
    its name says gemm or matmul (cuBLAS' and CUTLASS' kernels); SDPA's flash kernels count as outside."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from rlflow.cost.gpu_profile import is_device_event

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            runner.run_tensors(feeds)
        torch.cuda.synchronize()
    kernels = [(e.name.lower(), float(e.time_range.end - e.time_range.start)) for e in prof.events()
               if is_device_event(e)]  # read as the H200 calibration's profile reads them
    total = sum(us for _, us in kernels) / 1e6
    gemm = sum(us for name, us in kernels if "gemm" in name or "matmul" in name) / 1e6
    return gemm, total


def run(model: str, args, config) -> str:
    import torch

    from rlflow.cost.targets import make_cost_model
    from rlflow.evaluation.protocol import Protocol, aa_copy, backend_runner, compare, ratio_interval, verdict
    from rlflow.graph import load_onnx
    from rlflow.graph.exec import get_runner, make_inputs, max_rel_diff
    from rlflow.graph.exec.check import check_equal
    from rlflow.graph.fold import at_opset
    from rlflow.graph.zoo import TINY_SIZES, export_model
    from rlflow.rewrite.builtin import verified_builtin_rules
    from rlflow.rewrite.rule import load_rules
    from rlflow.search.common import finish

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{model}.onnx")
        export_model(model, path, TINY_SIZES[model] if args.size == "tiny" else None)
        graph = at_opset(load_onnx(path), 23)
    shipped = load_rules(args.rules) if args.rules else load_rules()
    fused_rules = [r for r in verified_builtin_rules(fused_kernels=True) if r.name.startswith("attention-")]
    cost = make_cost_model(config, args.device, kind=args.target)
    orig_ms = finish(graph, cost)[1].runtime_ms
    taso, taso_est, taso_s = _search("taso", graph, shipped, cost, config)
    print(f"{model}: TASO without the fused rules {taso_est:.4f} ms on {args.target} ({taso_s:.0f} s)", flush=True)
    found = {}
    for m in args.methods:
        g, est, secs = _search(m, graph, shipped + fused_rules, cost, config)
        n_attn = sum(n.op == "Attention" for n in g.nodes)
        print(f"{model}: {m} with the fused rules {est:.4f} ms ({n_attn} Attention, {secs:.0f} s)", flush=True)
        found[m] = (g, est)
    best = min(found, key=lambda m: found[m][1])
    fused, fused_est = found[best]

    feeds_np = make_inputs(graph, 0)
    diffs = {name: (check_equal(graph, g, tol=1e-4),
                    max_rel_diff(get_runner(graph, "torch", args.device)(feeds_np),
                                 get_runner(g, "torch", args.device)(feeds_np)))
             for name, g in (("taso", taso), ("fused", fused))}

    feeds = {k: torch.from_numpy(v).to(args.device) for k, v in feeds_np.items()}
    outside = {name: _outside_ms(g, feeds, args.rounds, args.device) for name, g in
               (("original", graph), ("taso", taso), ("fused", fused))}

    protocol = Protocol(sessions=args.sessions, budget_s=args.budget_s, seed=0)
    with backend_runner("torch", args.device) as make:
        c = compare([("taso", taso), ("fused", fused), ("original", graph), ("aa", aa_copy(taso))], feeds_np,
                    protocol, make)
    f_t, o_t, aa = c["fused"], c["original"], c["aa"]
    r, lo, hi, _ = ratio_interval(o_t.times_ms, f_t.times_ms, confidence=protocol.confidence)
    ort_line = "not run (--device cuda: onnxruntime's verdict is the CPU's)"
    if args.device == "cpu":
        with backend_runner("ort", "cpu") as make:
            c_ort = compare([("original", graph), ("fused", fused), ("aa", aa_copy(graph))], feeds_np, protocol,
                            make)
        ort_line = (f"fused (ungated) / original {c_ort['fused'].interval()} ({c_ort['fused'].verdict}); A/A "
                    f"{c_ort['aa'].interval()} ({c_ort['aa'].verdict})")

    total, node_out, prof_out = outside["original"]
    share = prof_out / total
    removed = {k: 1 - outside["fused"][k] / outside["original"][k] for k in (1, 2)}
    goal_half = hi <= 1 - share / 2
    goal_taso = f_t.ci_high <= 0.95
    ms = " ".join(f"{name} {v[0]:.2f} ms (outside: nodes {v[1]:.2f}, profiler {v[2]:.2f})"
                  for name, v in outside.items())
    return (f"fused_protocol {model} {args.size}: target {args.target}: original "
            f"{orig_ms:.4f} ms, TASO {taso_est:.4f}, fused ({best}) "
            f"{fused_est:.4f} ms; Attention ops {sum(n.op == 'Attention' for n in fused.nodes)}; "
            f"max rel diff ort/torch taso {diffs['taso'][0]:.1e}/{diffs['taso'][1]:.1e}, fused "
            f"{diffs['fused'][0]:.1e}/{diffs['fused'][1]:.1e}\n"
            f"  torch op by op, {args.rounds} runs each: {ms}; original's share outside the GEMMs {share:.1%} "
            f"(per node {node_out / total:.1%}); the fused graph removes {removed[2]:.0%} of it (per node "
            f"{removed[1]:.0%})\n"
            f"  protocol on torch ({protocol.sessions} sessions, {protocol.budget_s:g} s): fused / TASO "
            f"{f_t.interval()} ({f_t.verdict}); original / TASO {o_t.interval()}; fused / original {r:.3f} "
            f"[{lo:.3f}, {hi:.3f}] ({verdict(lo, hi)}); A/A {aa.interval()} ({aa.verdict})\n"
            f"  protocol on onnxruntime: {ort_line}\n"
            f"  goals: removes >= half of the time outside the GEMMs (fused / original <= {1 - share / 2:.3f}): "
            f"{'met' if goal_half else 'not met'}; >= 5% faster than TASO (interval below 0.95): "
            f"{'met' if goal_taso else 'not met'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["bert", "vit", "gpt2"])
    p.add_argument("--size", choices=("tiny", "paper"), default="paper")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where torch runs the graphs (cuda: a GPU; onnxruntime is then not compared)")
    p.add_argument("--target", help="the cost target every search optimises for (default: torch-eager on the "
                                    "CPU, cuda on a GPU: each op timed on the device)")
    p.add_argument("--methods", nargs="+", default=["taso", "greedy", "eqsat"],
                   help="searches run with the fused rules; the lowest estimate is the fused graph")
    p.add_argument("--rules", help="rules file (default: the shipped rule set)")
    p.add_argument("--rounds", type=int, default=10, help="runs for the time-outside-the-GEMMs figures")
    p.add_argument("--sessions", type=int, default=4, help="protocol sessions (fresh runners per graph)")
    p.add_argument("--budget-s", type=float, default=60.0, help="protocol seconds of timing per comparison")
    p.add_argument("--config", help="config file (default: the schema defaults)")
    args = p.parse_args()
    args.target = args.target or ("cuda" if args.device == "cuda" else "torch-eager")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.exit(2, "fused_protocol: --device cuda needs a CUDA GPU and torch sees none\n")

    from rlflow.config import load_config

    config = load_config(args.config, [])
    print(f"load average {os.getloadavg()}, torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}",
          flush=True)
    lines = [run(m, args, config) for m in args.models]
    print(f"load average {os.getloadavg()}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
