"""Train the model-free PPO baseline on the real environment, then let it optimise the model (stage
train_model_free).

The same PPO and hierarchical heads as the controller, on real environments (model_free.num_envs), with the
trained encoder's z of the real graph as input (rlflow.agents.driver, the code both agent stages run). Every real
step is counted, with the rollouts the encoder learned from. Then a greedy run from the original graph; the best graph seen, weight-only nodes folded, is checked equal to the original under onnxruntime and
written.

Reads: seed, device, cost.model, cost.peak, env.max_steps, env.max_locations, env.reward, ppo.*, model_free.*.
Writes, atomically:
  --out        the agent checkpoint, self-contained: policy and encoder (states + constructor arguments), the
               rule set's fingerprint, the env settings, the config (`rlflow optimize ... --method rlflow
               --agent model_free.pt` runs it)
  --optimised  the best graph (ONNX), verified
  --trace      its trace (rlflow.search-trace/2, method "model_free"; `seconds` = the real run, plus
               training_seconds, real_interactions {rollouts, training, evaluation, total}, max_rel_diff)
  --metrics    the reward curve, the real run, interactions, seconds
  --logs       dvclive folder: per PPO update the real reward, episode return and length, interactions so far,
               the PPO losses (rebuilt from the start, with the saved curve, when a run resumes)
The policy is checkpointed after every update to OUT.partial; a killed run resumes there.
"""

from __future__ import annotations

import argparse

from rlflow.stages.agent_common import run_agent

HELP = "train the model-free PPO baseline on the real env, let it optimise the model (pipeline stage train_model_free)"
SET_EXAMPLE = "model_free.updates=5"


def run(args: argparse.Namespace) -> int:
    return run_agent(args, "model_free")
