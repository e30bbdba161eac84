"""What a controller's dream offers, against the real environment (issue K: a world model the controller cannot
exploit). Two probes of a trained controller (``results/<model>/controller/controller.pt``: its encoder, world
model and policy):

1. **Its own dream**: one greedy episode of the controller in the dream (the world model alone, from the original
   graph's z, as in training): the rules it applies and the improvement the dream predicts. A dream episode that
   keeps applying a rule the real graph runs out of is the world model being exploited.
2. **A real trace in the dream**: the steps of another method's trace (default: the model-free agent's,
   ``results/<model>/model_free/trace.json``) replayed in the real environment, with the world model advanced
   along them twice: as the controller's is in the real environment (z from the encoder on each real graph), and
   as in the dream (each next z sampled from the world model itself, the same actions). Per step: was the rule in
   the mask (predicted count > 0.5), and the real and the predicted reward (real z). A rewrite the dream does not
   offer is one the controller cannot learn to make.

  python benchmarks/dream_probe.py --model bert
  python benchmarks/dream_probe.py --model vit --follow results/vit/taso/trace.json

Cost target and reward: the config's. The last line is ``dream_probe <model>: ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert", help="a model the pipeline trained a controller on")
    ap.add_argument("--agent", type=Path, help="a controller checkpoint (default results/<model>/controller/controller.pt)")
    ap.add_argument("--follow", type=Path, help="a trace.json to replay (default results/<model>/model_free/trace.json)")
    ap.add_argument("--config", default=str(ROOT / "config.yaml"))
    a = ap.parse_args()
    agent_path = a.agent or ROOT / f"results/{a.model}/controller/controller.pt"
    follow = a.follow or ROOT / f"results/{a.model}/model_free/trace.json"
    onnx_path, rules_path = ROOT / f"results/{a.model}/model.onnx", ROOT / "results/rules/rules.json"
    for p in (agent_path, follow, onnx_path, rules_path):
        if not Path(p).is_file():
            print(f"dream_probe: needs {p} (run the pipeline for {a.model} first)", file=sys.stderr)
            return 2

    import torch

    from rlflow.agents.checkpoint import load_agent
    from rlflow.agents.real_env import encode
    from rlflow.config import load_config
    from rlflow.cost import METRIC_NAMES
    from rlflow.env import make_env
    from rlflow.env.dream import DreamEnv
    from rlflow.env.rewards import make_reward
    from rlflow.errors import RLFlowError
    from rlflow.problem import load_problem

    cfg = load_config([a.config])
    costs = ROOT / f"results/costs/auto/{a.model}.json"
    try:
        agent = load_agent(agent_path)
        if agent.world_model is None:
            raise RLFlowError(f"{agent_path}: a model-free agent has no dream; give a controller.pt")
        problem = load_problem(cfg, onnx_path, rules_path, costs if costs.is_file() else None)
    except RLFlowError as e:
        print(f"dream_probe: {e}", file=sys.stderr)
        return 2
    wm, ids = agent.world_model, [r.id for r in problem.rules]
    names = [r.name for r in problem.rules] + ["NO-OP"]
    reward = make_reward(cfg["env"]["reward"])
    env = make_env(cfg, problem.graph, problem.rules, problem.cost)
    obs, info = env.reset()
    z0 = encode(agent.encoder, [obs], "cpu")[0]
    first = {k: torch.tensor([info[k]], dtype=torch.float64) for k in METRIC_NAMES}
    start_metrics = torch.tensor([info[k] for k in METRIC_NAMES], dtype=torch.float64)
    start_counts = torch.as_tensor(env.counts(), dtype=torch.float32)

    # 1. the controller's own dream: one greedy episode (the dream's horizon one more than the loop's, so that the
    # last step's metrics are read before the copy restarts; a NO-OP or a predicted done ends it earlier, and then
    # the metrics are those before that step)
    gen = torch.Generator().manual_seed(int(cfg["seed"]))
    horizon = int(cfg["env"]["max_steps"])
    dream = DreamEnv(wm, z0, start_metrics, start_counts, reward, horizon + 1, int(cfg["env"]["max_locations"]),
                     float(cfg["controller"]["temperature"]), 1, generator=gen)
    d_obs, applied, d_metrics = dream.reset(), [], start_metrics
    with torch.no_grad():
        for _ in range(horizon):
            xfer, loc, _, _ = agent.policy.act(d_obs["features"], d_obs["xfer_mask"], d_obs["location_count"],
                                               generator=gen, greedy=True)
            d_obs, _, done = dream.step_batch(xfer, loc)
            applied.append(names[int(xfer[0])])
            if bool(done[0]):
                break
            d_metrics = dream.metrics[0].clone()
    dream_pct = 100 * (1 - float(d_metrics[0]) / float(start_metrics[0]))
    print(f"1. {agent_path.name}'s own dream, one greedy episode: {len(applied)} steps, predicted improvement "
          f"{dream_pct:.2f}% (runtime); rules: {dict(Counter(applied).most_common(8))}")

    # 2. a real trace, the world model advanced along it as the controller's would be
    trace = json.loads(Path(follow).read_text())
    if trace.get("num_rules") not in (None, len(ids)):
        print(f"dream_probe: {follow} is of {trace.get('num_rules')} rules, not these {len(ids)}", file=sys.stderr)
        return 2
    hidden, offered, missed, r_real, r_pred = wm.initial_hidden(1), 0, Counter(), [], []
    d_hidden, d_z, d_offered, d_missed = wm.initial_hidden(1), z0[None], 0, Counter()
    counts = d_counts = start_counts
    tau = float(cfg["controller"]["temperature"])
    with torch.no_grad():
        for step in trace["steps"]:
            k = ids.index(step["rule_id"])
            offered += bool(counts[k] > 0.5)
            d_offered += bool(d_counts[k] > 0.5)
            missed[step["rule_name"]] += not bool(counts[k] > 0.5)
            d_missed[step["rule_name"]] += not bool(d_counts[k] > 0.5)
            action = torch.tensor([[k, step["location"]]])
            d_out = wm.step(d_z, action, d_counts[None], d_hidden)  # the dream's own z and counts
            d_counts = torch.round(wm.counts(d_out.log_counts)[0])  # whole matches, as the dream carries them
            d_hidden, d_z = d_out.hidden, wm.sample_z(d_out, tau, gen)
            z = encode(agent.encoder, [obs], "cpu")
            prev = {n: torch.tensor([info[n]], dtype=torch.float64) for n in METRIC_NAMES}
            out = wm.step(z, action, torch.as_tensor(env.counts(), dtype=torch.float32)[None], hidden)
            hidden = out.hidden
            cur_m = torch.tensor([[info[n] for n in METRIC_NAMES]], dtype=torch.float64)
            after = wm.metrics_after(cur_m, out.deltas.double(), torch.sigmoid(out.changed) > 0.5)
            r_pred.append(float(reward(prev, {n: after[:, i] for i, n in enumerate(METRIC_NAMES)}, first)))
            obs, _, _, _, info = env.step((k, int(step["location"])))
            r_real.append(float(reward(prev, {n: torch.tensor([info[n]], dtype=torch.float64) for n in METRIC_NAMES},
                                       first)))
            counts = torch.round(wm.counts(out.log_counts)[0])
    n = len(trace["steps"])
    err = (torch.tensor(r_pred) - torch.tensor(r_real)).abs()
    drop = lambda c: {r: m for r, m in c.most_common(8) if m}  # noqa: E731
    print(f"2. {Path(follow).relative_to(ROOT) if Path(follow).is_relative_to(ROOT) else follow} replayed "
          f"({trace.get('method', '?')}, {n} steps):\n   with the real graphs' z, the world model offered {offered} "
          f"of them (not offered: {drop(missed)}); reward: real sum {sum(r_real):.3f}, predicted sum "
          f"{sum(r_pred):.3f}, mean |error| {float(err.mean()) if n else 0.0:.4f}\n   with its own sampled z (the "
          f"dream), {d_offered} of them (not offered: {drop(d_missed)})")
    top = Counter(applied).most_common(1)[0]
    print(f"dream_probe {a.model}: own dream {len(applied)} steps, {dream_pct:.2f}% predicted (top rule {top[0]} "
          f"x{top[1]}); {trace.get('method', '?')}'s {n} steps offered: {offered} with real z, {d_offered} in the dream")
    return 0


if __name__ == "__main__":
    sys.exit(main())
