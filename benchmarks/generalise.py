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

The cost target is the config's (``--config``, default config.yaml: ``cost.target: auto`` = sim-h100 on a CPU), the
one the pipeline's agents trained on. Prints one row per graph and the last line
``generalise <agent>: kept <variant>=<x> ...``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def parse_variant(text: str, model: str) -> tuple[str, dict]:
    """``seq=64`` (the agent's model) or ``vit:image=384`` (another zoo model) -> (model, size overrides)."""
    name, _, sizes = text.rpartition(":")
    name = name or model
    overrides = {}
    for part in filter(None, sizes.split(",")):
        key, eq, value = part.partition("=")
        if not eq or not value.isdigit():
            raise SystemExit(f"generalise: variant {text!r}: expected KEY=INT[,KEY=INT] (e.g. seq=64)")
        overrides[key] = int(value)
    return name, overrides


def improvement(result) -> float:
    a, b = result.initial.runtime_ms, result.final.runtime_ms
    return (a - b) / a * 100 if a else 0.0


def main() -> int:
    from rlflow.agents.checkpoint import load_agent
    from rlflow.config import get, load_config
    from rlflow.cost import make_cost_model
    from rlflow.cost.targets import resolve_target
    from rlflow.graph import load_onnx, zoo
    from rlflow.rewrite import load_rules
    from rlflow.search import greedy_search, taso_search

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
    target = resolve_target(config)
    variants = [(a.model, {})] + [parse_variant(v, a.model) for v in a.variants]
    print(f"agent {a.agent} ({agent.method}, trained on {a.model}); cost target {target} ({cost.label}); "
          f"{len(rules)} rules", flush=True)
    head = f"{'graph':<28}{'nodes':>7}{'cost ms':>11}{'agent %':>9}{'greedy %':>10}" + (f"{'taso %':>8}" if a.taso
                                                                                         else "") + f"{'kept':>7}{'s':>6}"
    print(head, flush=True)
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in variants:
            sizes = {**config["zoo"][name], **overrides}
            label = name + (" " + ",".join(f"{k}={v}" for k, v in overrides.items()) if overrides else " (trained)")
            if name != a.model and not overrides:
                label = name + " (other model)"
            path = Path(tmp) / f"{name}-{len(rows)}.onnx"
            zoo.export_model(name, path, sizes)
            graph = load_onnx(path)
            t0 = time.perf_counter()
            result, _ = agent.optimise(graph, rules, cost)
            mine = improvement(result)
            if base is None:
                base = mine
            greedy = improvement(greedy_search(graph, rules, cost))
            taso = improvement(taso_search(graph, rules, cost, alpha=get(config, "search.alpha"),
                                           budget=get(config, "search.budget"))) if a.taso else None
            kept = mine / base if base else None
            rows.append((label, kept))
            print(f"{label:<28}{len(graph.nodes):>7}{result.initial.runtime_ms:>11.4f}{mine:>9.3f}{greedy:>10.3f}"
                  + (f"{taso:>8.3f}" if a.taso else "") + (f"{kept:>7.2f}" if kept is not None else f"{'n/a':>7}")
                  + f"{time.perf_counter() - t0:>6.1f}", flush=True)
    print("generalise " + str(a.agent) + ": kept " + " ".join(
        f"{label.replace(' ', '_')}={'n/a' if k is None else f'{k:.3f}'}" for label, k in rows[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
