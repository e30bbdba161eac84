"""XLA pass-step latency of rlflow/XlaPassOrder-v0 (issue I's goal: median <= 100 ms on BERT at paper size).

The model (a zoo model, exported to a temporary ONNX file, or results/<model>/model.onnx when present at paper
size) is lowered to HLO through the JAX lowering of the IR; the env then runs --steps random passes (uniform over
the target-independent passes, never the stop action), restarting the episode at the horizon. Each step is one
real XLA compile in the crash-isolated worker (the env's transition cache is switched off here). Also printed:
the module's op count and the op count after XLA's own target-independent pipeline (its compile dumped just
before layout assignment).

  python benchmarks/xla_step.py                          # bert at the paper size
  python benchmarks/xla_step.py --sizes tiny --steps 20  # a quick check

Also printed: the worker's CPU time per step, split into XLA's compile and the rest (ours). Last line:
``model=<m> ops=<n> default_pipeline_ops=<k> median_step_ms=<x> p90_step_ms=<y> steps=<s>``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    from rlflow.config import load_config
    from rlflow.env.xla_pass_order import make_xla_env
    from rlflow.graph import zoo
    from rlflow.graph.exec.jax_exec import hlo_text
    from rlflow.graph.onnx_io import load_onnx

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bert", choices=zoo.MODEL_NAMES)
    p.add_argument("--sizes", default="paper", choices=["paper", "tiny"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    config = load_config([ROOT / "config.yaml"])
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = ROOT / "results" / args.model / "model.onnx"
        if args.sizes == "tiny" or not onnx_path.exists():
            onnx_path = Path(tmp) / f"{args.model}.onnx"
            sizes = zoo.TINY_SIZES[args.model] if args.sizes == "tiny" else config["zoo"][args.model]
            zoo.export_model(args.model, onnx_path, sizes)
        hlo_path = Path(tmp) / f"{args.model}.hlo"
        hlo_path.write_text(hlo_text(load_onnx(onnx_path), config["xla"]["weights"]))
        config["xla"]["cache_size"] = 0  # every step a real XLA compile: the env's transition cache is off
        env = make_xla_env(config, [hlo_path])
        try:
            rng = np.random.default_rng(args.seed)
            _, info = env.reset(seed=args.seed)
            ops = info["initial_op_count"]
            default_ops = sum(env.worker.reference(hlo_path.read_text()).stats["histogram"].values())
            times, statuses, compile_ms, other_ms = [], {}, [], []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                _, _, term, trunc, info = env.step(int(rng.integers(env.stop_action)))
                times.append((time.perf_counter() - t0) * 1e3)
                statuses[info["status"]] = statuses.get(info["status"], 0) + 1
                if env.last_cpu_ms:
                    compile_ms.append(env.last_cpu_ms["compile_ms"])
                    other_ms.append(env.last_cpu_ms["other_ms"])
                if term or trunc:
                    env.reset()
        finally:
            env.close()
    print(f"step statuses: {statuses}")
    if compile_ms:  # CPU time, all threads of the worker: less dependent on other load than the wall clock
        print(f"worker CPU per step: XLA compile median {np.median(compile_ms):.1f} ms, the rest (parse, "
              f"histogram, cost analysis, fingerprint, dump I/O) median {np.median(other_ms):.1f} ms")
    print(f"model={args.model} ops={ops} default_pipeline_ops={default_ops} "
          f"median_step_ms={np.median(times):.1f} p90_step_ms={np.percentile(times, 90):.1f} steps={len(times)}")


if __name__ == "__main__":
    main()
