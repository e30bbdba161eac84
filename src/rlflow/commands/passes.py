"""``rlflow passes MODEL.onnx --agent CKPT --out optimised.hlo``: order XLA's HLO passes for a model with a
trained pass agent (a checkpoint of stage train_pass_agent, e.g. results/xla/agent-shaped.pt).

The ONNX graph is lowered to HLO (the JAX lowering of the IR; ``--weights``: the weights as module parameters,
the default, or as constants printed in full, as the config key xla.weights of stage export_hlo); the agent picks XLA's
target-independent passes one at a time (real XLA passes in the crash-isolated worker) until it stops or
``--max-steps``; the module with the fewest ops on the way is written. Prints the op counts before, after and
with XLA's own default pipeline. Bad input (no such file, not ONNX, an op without a JAX lowering, not a pass
agent checkpoint) is one line, exit 2, nothing written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "passes"
HELP = "order XLA's HLO passes for an ONNX model with a trained pass agent; write the optimised HLO"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, metavar="MODEL.onnx", help="the model")
    parser.add_argument("--agent", type=Path, required=True, metavar="CKPT",
                        help="pass agent checkpoint (stage train_pass_agent: results/xla/agent-<variant>.pt)")
    parser.add_argument("--out", type=Path, required=True, metavar="HLO", help="the optimised HLO module (text)")
    parser.add_argument("--max-steps", type=int, metavar="N",
                        help="most passes the agent runs (default: the horizon it was trained with)")
    parser.add_argument("--weights", choices=("parameters", "constants"), default="parameters",
                        help="the weights as module parameters (default: the module stays small) or as constants "
                             "printed in full (the module is the model)")


def _agent(path: Path):
    from rlflow.agents.pass_agent import load_pass_agent
    from rlflow.errors import RLFlowError

    if not path.is_file():
        raise RLFlowError(f"{path}: no such pass agent checkpoint")
    try:
        return load_pass_agent(path)
    except RLFlowError:
        raise
    except Exception:  # torch.load of something else: pickle / zip errors (their messages run to paragraphs)
        raise RLFlowError(f"{path}: not a pass agent checkpoint (not a torch file of stage train_pass_agent)") from None


def run(args: argparse.Namespace) -> int:
    from rlflow.atomic import write_text
    from rlflow.errors import RLFlowError

    if not args.model.is_file():
        raise RLFlowError(f"{args.model}: no such file")
    if args.out.is_dir():
        raise RLFlowError(f"{args.out}: --out is a folder, expected an .hlo file path")
    if args.max_steps is not None and args.max_steps < 1:
        raise RLFlowError(f"--max-steps must be >= 1, got {args.max_steps}")
    agent = _agent(args.agent)
    from rlflow.agents.pass_agent import default_pipeline, run_agent
    from rlflow.env.xla_pass_order import DEFAULT_MAX_STEPS, XlaPassOrderEnv
    from rlflow.graph.exec.jax_exec import hlo_text
    from rlflow.graph.onnx_io import load_onnx

    text = hlo_text(load_onnx(args.model), args.weights)
    env = XlaPassOrderEnv([text], max_steps=args.max_steps or agent.max_steps or DEFAULT_MAX_STEPS)
    try:
        ops0 = env.reset(options={"module": 0})[1]["op_count"]
        best = run_agent(env, agent, 0)
        default = default_pipeline(env, 0).ops
    finally:
        env.close()
    write_text(args.out, best.text)
    print(f"passes: wrote {args.out}: {ops0} -> {best.ops:g} HLO ops with {agent.variant} agent "
          f"({len(best.passes)} passes: {', '.join(best.passes) or 'none'}); XLA's default pipeline: {default:g}")
    return 0
