"""Train RLFlow's controller in the dream, then let it optimise the model in the real environment (stage
train_controller; the sweep stages sweep_temperature and sweep_reward run this same code with one key fixed).

PPO with the hierarchical masked heads (rule, then location) on input [z, h] is trained ONLY in the dream
(rlflow.env.dream: the world model, temperature controller.temperature, reward env.reward on predicted metric
deltas, horizon env.max_steps). Then it runs in the real environment from the original graph
(controller.eval_episodes episodes: by default one greedy episode each of that many policy snapshots taken
over training, the best snapshot kept as the agent; with controller.eval_policies final the trained policy's,
the first greedy, the others sampled, seeded); the best graph seen,
weight-only nodes folded, is checked equal to the original under onnxruntime and written.
Real-environment interactions = the rollouts' steps (the encoder's and the world model's data) + this run's
steps; training used none. The code is rlflow.agents.driver, which train_model_free runs too.

Reads: seed, device, cost.model, cost.peak, env.max_steps, env.max_locations, env.reward, ppo.*, controller.*.
Writes, atomically:
  --out        the agent checkpoint, self-contained: policy, encoder and world model (states + constructor
               arguments), the rule set's fingerprint, the env settings, the config
               (`rlflow optimize IN.onnx --out OUT.onnx --method rlflow --agent controller.pt` runs it)
  --optimised  the best graph (ONNX), verified
  --trace      its trace, the searches' format (rlflow.search-trace/2, method "rlflow"): the rewrites up to the
               best step, cost before/after; `seconds` = the real run (the optimisation time), plus
               training_seconds, real_interactions {rollouts, training, evaluation, total}, max_rel_diff
  --metrics    dream curve, the real run, interactions, seconds
  --logs       dvclive folder: per PPO update the dream's reward, episode return and length, the PPO losses
               (rlflow.agents.logging; rebuilt from the start, with the saved curve, when a run resumes)
The policy is checkpointed every 10 updates to OUT.partial; a killed run, rerun with the same inputs and
config, resumes there.

Changing only the temperature or a reward parameter reruns this stage (and train_model_free for the reward),
nothing upstream: the temperature sweep of RLFlow's Table 3 is a matter of config.
"""

from __future__ import annotations

import argparse

from rlflow.stages.agent_common import run_agent

HELP = "train the controller in the dream, let it optimise the model in the real env (pipeline stage train_controller)"
SET_EXAMPLE = "controller.temperature=1.0"


def run(args: argparse.Namespace) -> int:
    return run_agent(args, "rlflow")
