"""One model-free agent trained on several models, tested on held-out ones (pipeline stage train_multi_model;
opt-in: ``snakemake multi --cores 2``).

The models in ``multi_model.train_models`` share one graph encoder (trained on all their random rollouts) and one
PPO policy (trained on real environments of all of them at once); :mod:`rlflow.agents.multi_model` holds both
loops. The trained agent then runs, with no further training, on every training model and every model in
``multi_model.heldout``, beside greedy search on the same graph and cost target; every agent graph is checked
equal to its original under onnxruntime (``evaluate.tolerance``: the stage fails, naming it, otherwise). Issue
K's goal: on a held-out model the agent beats greedy.

Reads: seed, device, cost.*, env.max_steps, env.max_locations, env.reward, encoder.*, ppo.*, multi_model.*,
timing.* (the e2e reward's measurements), evaluate.tolerance; per model ``<results-dir>/<model>/model.onnx``, the
costs ``<costs-root>/<device>/<model>.json`` (``device`` as the config says it) and, for the training models, the
rollouts ``<results-dir>/<model>/rollouts.json`` and, where there is one, their graphs
``<results-dir>/<model>/rollouts.graphs.npz`` (without it, every rollout episode is replayed to rebuild them).
Writes, atomically:
  --out       the agent checkpoint (``rlflow optimize --method rlflow --agent results/multi/agent.pt`` runs it on
              any model); its partial file OUT.partial while training (a killed run resumes there)
  --encoder   the shared encoder (rlflow.encoder/1)
  --metrics   JSON ``rlflow.multi-model/1``: per model (training and held-out) the agent's and greedy's
              improvement of the cost-target runtime, the output check, real interactions, the PPO curve
  --logs      dvclive folder: the PPO updates (real reward, episode return and length, interactions, losses)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rlflow.config import get
from rlflow.errors import RLFlowError

HELP = "train one model-free agent on several models, test it on held-out ones (pipeline stage train_multi_model)"
SET_EXAMPLE = "multi_model.updates=5"
FORMAT = "rlflow.multi-model/1"


def _problems(config: dict, names: list[str], results: Path, costs: Path, rules: Path) -> dict:
    """name -> Problem for each model; a missing input is a one-line error naming it and the stage that makes it."""
    from rlflow.problem import load_problem

    out = {}
    for m in names:
        onnx, cost = results / m / "model.onnx", costs / f"{m}.json"
        if not onnx.is_file():
            raise RLFlowError(f"{onnx}: no such model (stage export_model of {m})")
        out[m] = load_problem(config, onnx, rules, cost if cost.is_file() else None)
    return out


def _rollouts(results: Path, name: str) -> dict:
    path = results / name / "rollouts.json"
    if not path.is_file():
        raise RLFlowError(f"{path}: no such rollouts file (stages collect_rollouts, merge_rollouts of {name})")
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise RLFlowError(f"{path}: not JSON ({e.__class__.__name__})") from None


def run(args: argparse.Namespace) -> int:
    from rlflow.agents.checkpoint import Agent, Checkpointer, fingerprint, rules_fingerprint
    from rlflow.agents.driver import real_interactions
    from rlflow.agents.encoder_training import encoder_payload
    from rlflow.agents.logging import TrainingLog
    from rlflow.agents.multi_model import train_shared_encoder, train_shared_policy
    from rlflow.atomic import write_text
    from rlflow.config import load_config
    from rlflow.cost.targets import resolve_target
    from rlflow.env.rewards import make_reward
    from rlflow.problem import seed_for_training
    from rlflow.stages.search_common import e2e_meter
    from rlflow.agents.zero_shot import row_line, score_graph

    for p in (args.out, args.encoder, args.metrics):
        if p.is_dir():
            raise RLFlowError(f"{p}: is a folder, expected a file path")
    t0 = time.perf_counter()
    config = load_config(args.config, args.overrides)
    section = get(config, "multi_model")
    train_names, heldout = list(section["train_models"]), list(section["heldout"])
    both = sorted(set(train_names) & set(heldout))
    if both:
        raise RLFlowError(f"multi_model: {', '.join(both)} both trained on and held out")
    problems = _problems(config, train_names + heldout, args.results_dir,
                         args.costs_root / str(get(config, "device")), args.rules)
    training = {m: problems[m] for m in train_names}
    seed = seed_for_training(problems[train_names[0]])
    device = problems[train_names[0]].device
    log = lambda line: print(f"train_multi_model: {line}", flush=True)  # noqa: E731
    log(f"training on {', '.join(train_names)}; held out {', '.join(heldout) or 'none'}; cost target "
        f"{resolve_target(config)}; {section['updates']} updates x {section['envs_per_model'] * len(train_names)} "
        f"envs x {section['steps_per_update']} steps")

    rollouts = {m: _rollouts(args.results_dir, m) for m in train_names}
    used = {"seed": seed, "encoder": get(config, "encoder"), "ppo": get(config, "ppo"), "multi_model": section,
            "env.max_steps": get(config, "env.max_steps"), "env.max_locations": get(config, "env.max_locations"),
            "env.reward": get(config, "env.reward"), "env.no_revisit": get(config, "env.no_revisit")}
    stored = {m: args.results_dir / m / "rollouts.graphs.npz" for m in train_names}
    stored = {m: path for m, path in stored.items() if path.is_file()}
    inputs = [args.rules, *stored.values()] + [args.results_dir / m / f for m in train_names
                                               for f in ("model.onnx", "rollouts.json")]
    live = TrainingLog(args.logs, params=used)
    enc_ckpt = Checkpointer(args.encoder, fingerprint({k: used[k] for k in ("seed", "encoder", "env.max_steps",
                                                                           "env.max_locations")}
                                                     | {"models": train_names}, inputs))
    result, episodes = train_shared_encoder(training, rollouts, config, seed, enc_ckpt, not args.no_progress, log,
                                            stored=stored)
    encoder = result.model.eval()
    encoder.rollout_steps = sum(len(e["actions"]) for e in episodes)
    held = result.metrics["heldout"]
    log(f"encoder: held-out runtime rel. error {held.get('runtime_rel_err', float('nan')):.2e} on "
        f"{held.get('graphs', 0)} graphs of {len(train_names)} models")
    enc_ckpt.finish(encoder_payload(result, train_names, dict(get(config, "encoder")), seed,
                                    problems[train_names[0]].rules, episodes))

    ckpt = Checkpointer(args.out, fingerprint(used | {"models": train_names}, inputs))
    meter = e2e_meter(config) if make_reward(get(config, "env.reward")).needs_latency else None
    policy, policy_args, curve, training_steps, train_s = train_shared_policy(
        list(training.values()), encoder, config, seed, ckpt, not args.no_progress, log, live, meter)
    agent = Agent("model_free", policy, policy_args, encoder, rules_fingerprint(problems[train_names[0]].rules),
                  {"max_steps": get(config, "env.max_steps"), "max_locations": get(config, "env.max_locations"),
                   "episodes": section["eval_episodes"], "no_revisit": get(config, "env.no_revisit")},
                  config=used, info={"models": train_names, "cost": problems[train_names[0]].cost.describe(),
                                     "trained_seconds": train_s})

    rows, evaluation = [], 0
    for m in train_names + heldout:
        p = problems[m]
        row = {"model": m, "heldout": m in heldout,
               **score_graph({"multi_model": agent}, p.graph, p.rules, p.cost, config, device=device, label=m)}
        a = row["agents"]["multi_model"]
        row["beats_greedy"] = a["improvement_pct"] > row["greedy_pct"]
        if m in train_names:
            evaluation += a["real_steps"]
        rows.append(row)
        log(row_line(f"{m} ({'held out' if m in heldout else 'trained on'})", row))

    interactions = real_interactions(encoder.rollout_steps, training_steps, evaluation)
    ckpt.finish(agent.payload())
    doc = {"format": FORMAT, "train_models": train_names, "heldout": heldout, "cost_target": resolve_target(config),
           "cost_label": problems[train_names[0]].cost.label, "rows": rows, "real_interactions": interactions,
           "encoder": {"heldout": held, "epochs": len(result.metrics["history"])}, "curve": curve,
           "training_seconds": train_s, "seconds": time.perf_counter() - t0}
    write_text(args.metrics, json.dumps(doc, indent=1, default=float, allow_nan=False) + "\n")
    live.summary({"real_interactions": interactions["total"], "training_seconds": train_s,
                  **{f"{r['model']}/improvement_pct": r["agents"]["multi_model"]["improvement_pct"] for r in rows},
                  **{f"{r['model']}/greedy_pct": r["greedy_pct"] for r in rows}})
    live.close()
    wins = [r["model"] for r in rows if r["heldout"] and r["beats_greedy"]]
    log(f"wrote {args.out}, {args.encoder}, {args.metrics}: {interactions['total']} real interactions "
        f"({interactions['rollouts']} rollouts, {interactions['training']} training, {interactions['evaluation']} "
        f"evaluation); beats greedy on held-out: {', '.join(wins) or 'none'}; {doc['seconds']:.1f} s")
    return 0
