"""The share of torch's op-by-op time outside the GEMMs (issue N's first figure: the part fusion can remove), and
what fusing attention does to that time.

The graph (a zoo model at paper size, opset raised to 23) runs on the torch runner, op by op (the TASO-runtime
analogue: each IR node one eager call). Two measurements of the original graph:

- per IR node, wall time of each call (torch's CPU ops are synchronous), summed by op over ``--rounds`` runs:
  GEMM time is MatMul + Gemm + Conv (+ Attention in the fused graph);
- torch.profiler over the same runs: self CPU time of the GEMM kernels (``aten::mm``, ``bmm``, ``addmm``, ...)
  against the total self CPU time (SDPA's own kernel counts as outside).

On a loaded machine, torch's default intra-op thread pool makes every small op wait for descheduled workers,
which inflates the non-GEMM share several times over (measured: 61-64% with 2 threads at load average 8 on 2
cores, 11-14% with ``--threads 1``); quote the load average and the threads.

Then the graph with its attention fused (greedy search with only the fused-kernel rules, cost target torch-eager)
and the original are timed end to end, interleaved, ``--rounds`` rounds each: the median ratio. The last lines
are ``gemm_share <model>: ...``.

  python benchmarks/gemm_share.py --model bert --rounds 20 [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import defaultdict

#: IR ops counted as GEMM time (Attention: its two products dominate it; in the fused graph only)
GEMM_OPS = ("MatMul", "Gemm", "Conv", "Attention")
GEMM_KERNELS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_mkldnn_matmul",
                "aten::mkldnn_convolution", "aten::convolution_overrideable")


def per_node_times(runner, feeds, rounds: int) -> dict[str, float]:
    """Seconds per IR op, summed over ``rounds`` runs of ``runner`` (a TorchRunner) node by node."""
    import torch

    by_op: dict[str, float] = defaultdict(float)
    for _ in range(rounds):
        env = dict(runner.consts)
        env.update(feeds)
        with torch.inference_mode():
            for n, fn in zip(runner.graph.nodes, runner.fns):
                t = time.perf_counter()
                outs = fn([env[v] for v in n.inputs if v])
                by_op[n.op] += time.perf_counter() - t
                env.update(zip(n.outputs, outs))
    return dict(by_op)


def profiler_share(runner, feeds, rounds: int) -> tuple[float, float]:
    """(GEMM kernels' self CPU seconds, all self CPU seconds) under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(rounds):
            runner.run_tensors(feeds)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_KERNELS) / 1e6
    del torch
    return gemm, total


def main() -> None:
    import numpy as np
    import torch

    from rlflow.config import load_config
    from rlflow.cost.targets import make_cost_model
    from rlflow.graph import load_onnx
    from rlflow.graph.exec import make_inputs
    from rlflow.graph.exec.torch_exec import TorchRunner
    from rlflow.graph.zoo import TINY_SIZES, export_model
    from rlflow.rewrite.builtin import fused_kernel_rules
    from rlflow.search.common import finish
    from rlflow.search.greedy import greedy_search

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert")
    p.add_argument("--size", choices=("tiny", "paper"), default="paper")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default). On a loaded machine 1 avoids the thread-pool "
                        "waits that otherwise inflate every small op")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()}, torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.onnx")
        export_model(args.model, path, TINY_SIZES[args.model] if args.size == "tiny" else None)
        graph = load_onnx(path)
    graph.opset = 23
    cost = make_cost_model(load_config(None, []), "cpu", kind="torch-eager")
    fused, _ = finish(greedy_search(graph, [r for r, _ in fused_kernel_rules()], cost).graph, cost)
    feeds = {k: torch.from_numpy(v) for k, v in make_inputs(graph, 0).items()}
    runners = {"original": TorchRunner(graph), "fused": TorchRunner(fused)}
    for r in runners.values():  # warm up
        for _ in range(3):
            r.run_tensors(feeds)
    lines = []
    for name, r in runners.items():
        by_op = per_node_times(r, feeds, args.rounds)
        total = sum(by_op.values())
        gemm = sum(by_op.get(op, 0.0) for op in GEMM_OPS)
        top = ", ".join(f"{op} {100 * t / total:.1f}%" for op, t in sorted(by_op.items(), key=lambda x: -x[1])[:8])
        pg, pt = profiler_share(r, feeds, args.rounds)
        lines.append(f"gemm_share {args.model} {name}: {len(r.graph.nodes)} nodes, op by op "
                     f"{1e3 * total / args.rounds:.2f} ms/run, outside MatMul/Gemm/Conv/Attention {100 * (1 - gemm / total):.1f}% "
                     f"(per-node wall time; {top}); torch.profiler: outside GEMM kernels "
                     f"{100 * (1 - pg / pt):.1f}% of self CPU time")
    e2e = {name: [] for name in runners}
    for _ in range(args.rounds):  # interleaved
        for name, r in runners.items():
            t = time.perf_counter()
            r.run_tensors(feeds)
            e2e[name].append(time.perf_counter() - t)
    med = {k: float(np.median(v)) for k, v in e2e.items()}
    print(f"load average {os.getloadavg()}")
    print("\n".join(lines))
    print(f"gemm_share {args.model}: end to end op by op (median of {args.rounds} interleaved): original "
          f"{1e3 * med['original']:.2f} ms, attention fused {1e3 * med['fused']:.2f} ms, ratio "
          f"{med['fused'] / med['original']:.3f}")


if __name__ == "__main__":
    main()
