"""Episode-end cost of the XLA runtime reward (issue P): median and p90 seconds per episode end.

The env (rlflow/XlaPassOrder-v0 with ``runtime_reward`` on) runs --episodes episodes of uniform random passes
(--max-steps each, never the stop action) on one module: a zoo model lowered to HLO (as benchmarks/xla_step.py),
or --hlo FILE (e.g. a module of the HLO suite, results/xla/suite/). Each episode's end compiles the episode's
module in the persistent timing process (unless an earlier episode reached the same module) and times it against
XLA's default pipeline's module with the protocol (xla.runtime_budget_s seconds, 2 sessions). Printed: each
episode end's seconds and whether it compiled, then the median and p90.

--fresh K also times K episode ends the way they ran before the persistent worker (a fresh process per episode
end, every module compiled again: rlflow.xla.timing.time_modules), on the same machine, for comparison.

  python benchmarks/xla_runtime_reward.py --sizes tiny --episodes 8 --fresh 3   # a quick check
  python benchmarks/xla_runtime_reward.py --model resnet18 --episodes 20 --fresh 5

Last line: ``model=<m> episodes=<n> median_end_s=<x> p90_end_s=<y> compiled=<c> [fresh_median_end_s=<z>]``.
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
    from rlflow.evaluation.protocol import Protocol
    from rlflow.graph import zoo
    from rlflow.graph.exec.jax_exec import hlo_text
    from rlflow.graph.onnx_io import load_onnx
    from rlflow.xla.timing import time_modules, timing_disabled

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18", choices=zoo.MODEL_NAMES)
    p.add_argument("--sizes", default="paper", choices=["paper", "tiny"])
    p.add_argument("--hlo", type=Path, help="an HLO module file instead of --model")
    p.add_argument("--episodes", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=5)
    p.add_argument("--fresh", type=int, default=0, help="also time this many episode ends in a fresh process each")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    config = load_config([ROOT / "config.yaml"])
    config["xla"].update(runtime_reward=1.0, max_steps=args.max_steps)
    with tempfile.TemporaryDirectory() as tmp:
        if args.hlo is not None:
            hlo_path, name = args.hlo, args.hlo.stem
        else:
            onnx_path, name = Path(tmp) / f"{args.model}.onnx", args.model
            sizes = zoo.TINY_SIZES[args.model] if args.sizes == "tiny" else config["zoo"][args.model]
            zoo.export_model(args.model, onnx_path, sizes)
            hlo_path = Path(tmp) / f"{args.model}.hlo"
            hlo_path.write_text(hlo_text(load_onnx(onnx_path), config["xla"]["weights"]))
        env = make_xla_env(config, [hlo_path], runtime_reward=True)
        rng = np.random.default_rng(args.seed)
        ends, compiled, modules = [], [], []
        try:
            for k in range(args.episodes):
                env.reset(seed=args.seed + k)
                t0 = time.perf_counter()
                while True:
                    _, _, term, trunc, info = env.step(int(rng.integers(env.stop_action)))
                    if term or trunc:
                        break
                ends.append(info["runtime_s"])
                compiled.append(info["runtime_compiled"])
                modules.append(env.text)
                print(f"episode {k + 1}: end {info['runtime_s']:.2f} s ({info['runtime_compiled']} compiled), "
                      f"latency ratio {info['runtime_ratio']:.3f}, whole episode {time.perf_counter() - t0:.1f} s",
                      flush=True)
            default = env._default_text[0]
            fresh = []
            for k in range(min(args.fresh, len(modules))):
                protocol = Protocol(sessions=2, warmup=1, budget_s=env.runtime_budget_s, min_rounds=3, seed=k)
                t0 = time.perf_counter()
                time_modules([("xla_default", default), ("episode", modules[k])], protocol,
                             timing_disabled(env.pipeline))
                fresh.append(time.perf_counter() - t0)
                print(f"fresh process {k + 1}: end {fresh[-1]:.2f} s", flush=True)
        finally:
            env.close()
    line = (f"model={name} episodes={len(ends)} median_end_s={np.median(ends):.2f} "
            f"p90_end_s={np.percentile(ends, 90):.2f} compiled={sum(compiled)}")
    if fresh:
        line += f" fresh_median_end_s={np.median(fresh):.2f} fresh_p90_end_s={np.percentile(fresh, 90):.2f}"
    print(line)


if __name__ == "__main__":
    main()
