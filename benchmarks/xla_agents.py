"""XLA pass ordering: PPO (plain, shaped, shaped + cost-feature value) vs XLA's default pipeline, random orders
and greedy, trained on some zoo graphs and evaluated on held-out ones (the paper's metric).

Every graph is a zoo model exported to ONNX and lowered to HLO by the JAX lowering of the IR; every pass is a
real XLA compile in the crash-isolated worker. Budgets default to config.yaml's ``xla`` section (what the
pipeline's train_pass_agent and evaluate_passes use; `snakemake xla` also times the modules on XLA CPU).

  python benchmarks/xla_agents.py                                   # paper sizes, config.yaml's budgets
  python benchmarks/xla_agents.py --sizes tiny --updates 2 --steps-per-update 32   # a quick check

Prints one line per held-out graph and method (op counts) and, per method, the geometric mean over the held-out
graphs of (ops_0 - ops_method) / (ops_0 - ops_default).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    import torch

    from rlflow.agents.pass_agent import (VARIANTS, default_pipeline, geomean_ratio, greedy, load_pass_agent,
                                          random_orders, reduction_ratio, run_agent, train_ppo)
    from rlflow.agents.ppo import PPOConfig
    from rlflow.config import load_config
    from rlflow.env.xla_pass_order import make_xla_env
    from rlflow.graph import zoo
    from rlflow.graph.exec.jax_exec import hlo_text
    from rlflow.graph.onnx_io import load_onnx

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", nargs="+", default=["bert", "resnet18"], choices=zoo.MODEL_NAMES)
    p.add_argument("--test", nargs="+", default=["gpt2", "vit"], choices=zoo.MODEL_NAMES)
    p.add_argument("--sizes", default="paper", choices=["paper", "tiny"])
    p.add_argument("--updates", type=int, help="default: xla.updates")
    p.add_argument("--steps-per-update", type=int, help="default: xla.steps_per_update")
    p.add_argument("--max-steps", type=int, help="the env's horizon (default: xla.max_steps)")
    p.add_argument("--random-orders", type=int, help="default: xla.random_orders")
    p.add_argument("--greedy-steps", type=int, help="default: xla.greedy_steps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    config = load_config([ROOT / "config.yaml"])
    x = config["xla"]
    for arg, key in (("updates", "updates"), ("steps_per_update", "steps_per_update"), ("max_steps", "max_steps"),
                     ("random_orders", "random_orders"), ("greedy_steps", "greedy_steps")):
        if getattr(args, arg) is None:
            setattr(args, arg, x[key])
    x["max_steps"] = args.max_steps
    with tempfile.TemporaryDirectory() as tmp:
        def hlo_file(model: str) -> Path:
            onnx_path = Path(tmp) / f"{model}.onnx"
            sizes = zoo.TINY_SIZES[model] if args.sizes == "tiny" else config["zoo"][model]
            zoo.export_model(model, onnx_path, sizes)
            path = Path(tmp) / f"{model}.hlo"
            path.write_text(hlo_text(load_onnx(onnx_path), config["xla"]["weights"]))
            return path

        train_env = make_xla_env(config, [hlo_file(m) for m in args.train])
        test_env = make_xla_env(config, [hlo_file(m) for m in args.test])
        try:
            cfg = PPOConfig.from_config(config.get("ppo", {}), args.steps_per_update)
            agents = {}
            for v in VARIANTS:  # each agent is evaluated from its checkpoint, as a stage would load it
                torch.save(train_ppo(train_env, v, cfg, args.updates, args.seed, x.get("shaping"), x["hidden"]).state(),
                           Path(tmp) / f"{v}.pt")
                agents[v] = load_pass_agent(Path(tmp) / f"{v}.pt")
            rng = np.random.default_rng(args.seed)
            ratios: dict[str, list] = {}
            for i, model in enumerate(args.test):
                _, info = test_env.reset(options={"module": i})
                ops0 = info["op_count"]
                default = default_pipeline(test_env, i).ops
                results = {"random": random_orders(test_env, i, args.random_orders, rng).ops,
                           "greedy": greedy(test_env, i, args.greedy_steps).ops}
                results.update({f"ppo-{v}": run_agent(test_env, a, i).ops for v, a in agents.items()})
                print(f"{model}: initial={ops0} default={default} "
                      + " ".join(f"{k}={v:g}" for k, v in results.items()))
                for k, v in results.items():
                    ratios.setdefault(k, []).append(reduction_ratio(ops0, v, default))
        finally:
            train_env.close()
            test_env.close()
    for k, r in ratios.items():
        g = geomean_ratio(r)
        print(f"geomean_reduction_ratio_vs_default {k}: {'n/a' if g is None else f'{g:.3f}'}")


if __name__ == "__main__":
    main()
