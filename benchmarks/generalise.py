"""Does a trained agent generalise? Zero-shot runs of one agent on other input shapes and other models
(issue K, item 3; X-RLflow's claim: an agent trained once runs on other shapes of the same model).

The agent is a checkpoint of the pipeline's agent stages (``train_model_free``: results/<model>/model_free/
model_free.pt, or ``train_controller``: results/<model>/controller/controller.pt). Each variant is a zoo model
exported with one size changed (``seq=64``, ``batch=8``, ``image=384``; ``vit:image=384`` for another model), and
the agent optimises it with no training on it (its real episodes, as ``rlflow optimize --method rlflow`` runs
it). Beside it, on the same graph and cost target: greedy (and TASO with ``--taso``). The agent's improvement on
each variant is compared with its improvement on the shape it was trained on: ``kept`` = improvement(variant) /
improvement(training shape) (issue K's goal: >= 90% at bert seq 64 and 256).

  python benchmarks/generalise.py --agent results/bert/model_free/model_free.pt --model bert \\
      --variants seq=64 seq=256 batch=8
  python benchmarks/generalise.py --agent results/bert/controller/controller.pt --model bert --variants seq=64 \\
      vit:image=224 --taso

The pipeline's stage ``generalise`` runs the same comparison (:func:`rlflow.agents.zero_shot.zero_shot`) for
both agents of each model on ``generalise.variants``, and the report shows it. The cost target is the config's
(``--config``, default config.yaml: ``cost.target: auto`` = sim-h100 on a CPU), the one the pipeline's agents
trained on. Prints one row per graph and the last line
``generalise <agent>: kept <variant>=<x> ...``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> int:
    from rlflow.agents.checkpoint import load_agent
    from rlflow.config import get, load_config
    from rlflow.cost import make_cost_model
    from rlflow.cost.targets import resolve_target
    from rlflow.graph import load_onnx, zoo
    from rlflow.rewrite import load_rules
    from rlflow.agents.zero_shot import parse_variant, zero_shot

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agent", type=Path, required=True, help="an agent checkpoint (model_free.pt or controller.pt)")
    ap.add_argument("--model", required=True, choices=zoo.MODEL_NAMES, help="the zoo model the agent trained on")
    ap.add_argument("--variants", nargs="+", required=True, metavar="[MODEL:]KEY=INT",
                    help="shapes to run zero-shot: seq=64, batch=8, vit:image=384, ...")
    ap.add_argument("--rules", type=Path, default=ROOT / "results/rules/rules.json",
                    help="the rules the agent trained with (default results/rules/rules.json)")
    ap.add_argument("--config", type=Path, action="append", default=None,
                    help="config files, later ones win (default config.yaml): zoo sizes, cost target, search")
    ap.add_argument("--taso", action="store_true", help="also TASO's search (search.budget) on every graph")
    a = ap.parse_args()
    if not a.agent.is_file():
        print(f"generalise: {a.agent}: no such agent checkpoint (run the pipeline's agent stages first)",
              file=sys.stderr)
        return 2
    config = load_config(a.config or [ROOT / "config.yaml"])
    agent = load_agent(a.agent)
    rules = load_rules(a.rules)
    agent.check_rules(rules, str(a.rules))
    cost = make_cost_model(config, "cpu")
    variants = [parse_variant(v, a.model) for v in a.variants]
    print(f"agent {a.agent} ({agent.method}, trained on {a.model}); cost target {resolve_target(config)} "
          f"({cost.label}); {len(rules)} rules", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{a.model}.onnx"
        zoo.export_model(a.model, path, config["zoo"][a.model], opset=get(config, "export.opset"),
                         exporter=get(config, "export.exporter"), seed=get(config, "seed"))
        rows = zero_shot({agent.method: agent}, a.model, load_onnx(path), variants, rules, cost, config,
                         taso=a.taso, log=lambda line: print(line, flush=True))
    head = f"{'graph':<28}{'nodes':>7}{'cost ms':>11}{'agent %':>9}{'greedy %':>10}" + \
        (f"{'taso %':>8}" if a.taso else "") + f"{'kept':>7}{'s':>7}"
    print(head)
    for r in rows:
        ag = r["agents"][agent.method]
        kept = "n/a" if ag["kept"] is None else f"{ag['kept']:.2f}"
        print(f"{r['graph']:<28}{r['nodes']:>7}{r['initial_ms']:>11.4f}{ag['improvement_pct']:>9.3f}"
              f"{r['greedy_pct']:>10.3f}" + (f"{r['taso_pct']:>8.3f}" if a.taso else "") + f"{kept:>7}"
              f"{ag['seconds']:>7.1f}")
    kept = {r["graph"].replace(" ", "_"): r["agents"][agent.method]["kept"] for r in rows[1:]}
    print(f"generalise {a.agent}: kept " + " ".join(f"{k}={'n/a' if v is None else format(v, '.3f')}"
                                                    for k, v in kept.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
