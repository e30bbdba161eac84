"""Train the graph encoder on the rollouts' graphs and encode every rollout step (pipeline stage train_encoder).

The episodes are split into training and held-out episodes (encoder.holdout, seeded); their graphs come from the
rollouts' graphs file (--graphs; encoder.replay_check episodes are replayed in the environment and must give the
stored graphs), or, without one, are rebuilt by replaying every episode's actions (slower: ~10 ms a step on
bert). The encoder (edge-to-node update, encoder.layers graph-attention layers, global update, z of
encoder.z_dim; X-RLflow's architecture) is trained for encoder.epochs on at most
encoder.max_graphs training graphs to predict each graph's cost metrics and per-rule match counts from z. It is
checkpointed every epoch to OUT.partial: a killed run, rerun with the same inputs and config, resumes there.

Outputs: the encoder checkpoint (--out), the z of every step of every episode with the episodes' actions,
metrics, counts and flags (--latents, npz; the world model's input; format in rlflow/agents/encoder_training.py)
and --metrics (held-out errors: relative runtime error, match-count accuracy; loss per epoch; seconds), and the
--logs folder (dvclive, rlflow.agents.logging: train and held-out losses per epoch, the final held-out errors;
rebuilt from epoch 1, with the checkpoint's saved epochs, when a run resumes).

Examples:
  rlflow train-encoder ... --set encoder.epochs=2 --set encoder.max_graphs=200      (a quick run)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from rlflow.config import get
from rlflow.errors import RLFlowError
from rlflow.problem import single_cpu_thread
from rlflow.stages.common import load_problem

HELP = "train the graph encoder on rollout graphs; write it and the z of every step (pipeline stage train_encoder)"
SET_EXAMPLE = "encoder.epochs=2"


def _load_rollouts(path: Path) -> dict:
    if not path.is_file():
        raise RLFlowError(f"{path}: no such rollouts file")
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise RLFlowError(f"{path}: not JSON ({e.__class__.__name__})") from None


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from rlflow.agents.checkpoint import Checkpointer, fingerprint
    from rlflow.agents.encoder_training import check_rollouts, encoder_payload, from_stored, train_encoder
    from rlflow.agents.rollouts import read_graphs, unpack_graphs
    from rlflow.agents.logging import TrainingLog
    from rlflow.atomic import write_npz, write_text
    from rlflow.env import make_env

    t0 = time.perf_counter()
    problem = load_problem(args)
    single_cpu_thread()
    config = problem.config
    seed, cfg = int(get(config, "seed")), dict(get(config, "encoder"))
    env = make_env(config, problem.graph, problem.rules, problem.cost, reward=False)
    doc = _load_rollouts(args.rollouts)
    check_rollouts(doc, problem.rules, env.max_steps, env.max_locations, str(args.rollouts))
    episodes = doc["episodes"]
    stored = None
    if args.graphs:
        arrays = read_graphs(args.graphs)
        stored = unpack_graphs(arrays, episodes, str(args.graphs))

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    values = {"encoder": cfg, "seed": seed, "env": {"max_steps": env.max_steps, "max_locations": env.max_locations},
              "cost": problem.cost.describe()}
    inputs = [p for p in (args.rollouts, args.graphs, args.onnx, args.rules, getattr(args, "costs", None))
              if p and Path(p).is_file()]
    ckpt = Checkpointer(args.out, fingerprint(values, inputs))
    print(f"train_encoder: {args.model}: {len(episodes)} episodes, {len(problem.rules)} rules, device "
          f"{problem.device}, {cfg['epochs']} epochs of at most {cfg['max_graphs']} graphs", flush=True)
    def log_epoch(epoch: int, loss: float, seconds: float) -> None:
        print(f"train_encoder: epoch {epoch}/{cfg['epochs']}: loss {loss:.4f} ({seconds:.1f} s)", flush=True)

    replayed, t_graphs = None, time.perf_counter()
    if stored is not None:
        replayed = from_stored(env, episodes, stored, int(cfg["replay_check"]), seed, not args.no_progress,
                               str(args.rollouts), str(args.graphs))
        print(f"train_encoder: {replayed[1]['stored_graphs']} graphs from {args.graphs}; {len(replayed[0])} episodes, "
              f"{replayed[1]['replayed_episodes']} of them replayed to check them ({time.perf_counter() - t_graphs:.1f} s)",
              flush=True)
    t_graphs = time.perf_counter() - t_graphs
    live = TrainingLog(args.logs, params=values)
    result = train_encoder(env, episodes, cfg, seed, problem.device, ckpt, progress=not args.no_progress,
                           on_epoch=log_epoch, live=live, source=str(args.rollouts), replayed=replayed)
    if result.metrics["resumed_from_epoch"]:
        print(f"train_encoder: resumed from epoch {result.metrics['resumed_from_epoch']} ({ckpt.partial})", flush=True)

    write_npz(args.latents, result.latents)
    seconds = time.perf_counter() - t0
    metrics = {"model": args.model, "device": problem.device, "cost": problem.cost.describe(), **result.metrics,
               "seconds": {**result.metrics["seconds"], "stored_graphs": t_graphs, "total": seconds}}
    write_text(args.metrics, json.dumps(metrics, indent=1) + "\n")
    ckpt.finish(encoder_payload(result, args.model, cfg, seed, problem.rules, episodes))
    h = result.metrics["heldout"]
    live.summary({"final/heldout_runtime_rel_err": h.get("runtime_rel_err"),
                  "final/heldout_counts_exact_acc": h.get("counts_exact_acc"),
                  "final/heldout_counts_mask_acc": h.get("counts_mask_acc"), "final/seconds": seconds})
    live.close()
    if h.get("graphs"):
        err = (f"held-out ({h['graphs']} graphs): runtime rel. error {h['runtime_rel_err']:.2e}, counts exact "
               f"{h['counts_exact_acc']:.4f}, mask {h['counts_mask_acc']:.4f}")
    else:
        err = "no held-out episodes"
    print(f"train_encoder: wrote {args.out}, {args.latents}, {args.metrics} in {seconds:.1f} s; final loss "
          f"{result.metrics['train_loss'][-1]:.4f}; {err}", flush=True)
    return 0

