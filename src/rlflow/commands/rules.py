"""Work with rule files (verified substitutions). `rlflow generate-rules` (the pipeline stage) makes one; the
rule set shipped with rlflow is the default of `rlflow optimize`.

  rlflow rules check results/rules/rules.json [--reverify]    validate a (hand-edited) file; optionally re-verify
  rlflow rules list [--origin builtin] [--op Conv]            the shipped rule set (or give a file)
  rlflow rules matches results/rules/rules.json model.onnx --target sim-h100   what each rule saves there at once

A malformed or hand-edited file gives one line naming the rule id and the problem, and exit status 2.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlflow.rewrite.rule import DEFAULT_RULES

NAME = "rules"
HELP = "check, list or match rule files (verified substitutions)"


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="rules_command", metavar="ACTION", required=True)
    chk = sub.add_parser("check", help="validate a rules file; with --reverify, check every rule numerically again")
    chk.add_argument("file", metavar="RULES.json", nargs="?", default=DEFAULT_RULES,
                     help="a rules file (default: the rule set shipped with rlflow)")
    chk.add_argument("--reverify", action="store_true", help="re-run the numeric verification of every rule")
    chk.add_argument("--trials", type=int, default=5, help="instantiations per rule with --reverify (default 5)")
    lst = sub.add_parser("list", help="one line per rule: id, origin, source ops -> target ops")
    lst.add_argument("file", metavar="RULES.json", nargs="?", default=DEFAULT_RULES,
                     help="a rules file (default: the rule set shipped with rlflow)")
    lst.add_argument("--origin", choices=("generated", "builtin"), help="only rules of this origin")
    lst.add_argument("--op", help="only rules whose source uses this op")
    lst.add_argument("--json", action="store_true", help="print the selected rules as JSON")
    mat = sub.add_parser("matches", help="the rules that match a model, with the cost change of applying each "
                                         "one step (best, mean and worst over its locations)",
                         description="The rules that match IN.onnx and what one step of each changes: every "
                                     "location of every matching rule is applied to the model on its own and the "
                                     "cost target's runtime compared with the model's (the immediate reward an "
                                     "agent sees; the locations an agent can pick are the first --max-locations). "
                                     "Rules are sorted by their best saving.")
    mat.add_argument("file", metavar="RULES.json")
    from rlflow.commands.common import add_model_arguments

    add_model_arguments(mat)
    mat.add_argument("--target", metavar="TARGET", default=None,
                     help="cost target: sim-v100 | sim-a100 | sim-h100 | analytic, or a measured one (ort-cpu, "
                          "torch-eager, cuda) with --costs (default: cost.target of --config, auto = sim-h100 on "
                          "a CPU)")
    mat.add_argument("--config", action="append", metavar="YAML", help="config file(s): cost.*, device")
    mat.add_argument("--costs", type=Path, metavar="CACHE.json",
                     help="a measured target's cost cache (from `rlflow measure-costs`)")
    mat.add_argument("--max-locations", type=int, default=None, metavar="N",
                     help="locations per rule (default: env.max_locations of the config)")


def run(args) -> int:
    from rlflow.errors import RLFlowError
    from rlflow.rewrite import load_rules

    rules = load_rules(args.file)
    if args.rules_command == "matches":
        return _matches(args, rules)
    if args.rules_command == "check":
        if args.reverify:
            from rlflow.rewrite.verify import verify, verify_rank_general

            for r in rules:
                if verify(r, trials=args.trials, examples=r.verified.get("examples")) is None:
                    raise RLFlowError(f"{args.file}: rule '{r.id}' ({r.name}) fails numeric verification")
                if r.rank_general_vars and verify_rank_general(r) is None:
                    raise RLFlowError(f"{args.file}: rule '{r.id}' ({r.name}) is marked rank-general but fails "
                                      f"verification at other ranks")
        print(f"{args.file}: {len(rules)} rules OK" + (" (re-verified)" if args.reverify else ""))
        return 0
    chosen = [r for r in rules if (not args.origin or r.origin == args.origin)
              and (not args.op or any(n.op == args.op for n in r.src))]
    if args.json:
        print(json.dumps([r.to_json() for r in chosen], indent=1))
        return 0
    for r in chosen:
        src = " ".join(n.op for n in r.src)
        dst = " ".join(n.op for n in r.dst) or "(its inputs)"
        print(f"{r.id:<24} {r.origin:<9} {src} -> {dst}   {r.name}")
    print(f"{len(chosen)} of {len(rules)} rules")
    return 0


def _matches(args, rules) -> int:
    """``rlflow rules matches``: each matching rule's one-step cost changes on the model."""
    from rlflow.config import get, load_config, resolve_device
    from rlflow.cost import make_cost_model, resolve_target
    from rlflow.cost.targets import MEASURED
    from rlflow.errors import RLFlowError
    from rlflow.graph import load_onnx
    from rlflow.rewrite.matcher import MatchIndex

    config = load_config(args.config)
    target = resolve_target(config, args.target)
    if target in MEASURED and args.costs is None:
        raise RLFlowError(f"target {target} is measured: give its cost cache with --costs (from `rlflow "
                          "measure-costs`), or use a simulated target (sim-h100) or analytic")
    if args.costs is not None and not args.costs.is_file():
        raise RLFlowError(f"{args.costs}: no such cost cache (make one with `rlflow measure-costs`)")
    limit = args.max_locations if args.max_locations is not None else int(get(config, "env.max_locations"))
    if limit < 1:
        raise RLFlowError(f"--max-locations must be >= 1 (got {limit})")
    graph = load_onnx(args.model, args.input_shape)
    cost = make_cost_model(config, resolve_device(config), args.costs, target)
    before = cost.graph_metrics(graph).runtime_ms
    index = MatchIndex(graph, rules)
    import sys

    from tqdm import tqdm

    rows = []
    for k, found in tqdm(list(enumerate(index.matches)), desc="rules", unit="rule", file=sys.stderr, leave=False,
                         mininterval=1.0, disable=None):
        if not found:
            continue
        saved = [before - cost.graph_metrics(index.apply(k, loc).graph).runtime_ms for loc in range(min(len(found),
                                                                                                         limit))]
        rows.append({"id": rules[k].id, "name": rules[k].name, "matches": len(found), "locations": len(saved),
                     "best_ms": max(saved), "mean_ms": sum(saved) / len(saved), "worst_ms": min(saved)})
    rows.sort(key=lambda r: (-r["best_ms"], r["id"]))
    if args.json:
        print(json.dumps({"model": str(args.model), "target": cost.name, "label": cost.label, "runtime_ms": before,
                          "rules": rows}, indent=1))
        return 0
    pct = lambda ms: f"{ms / before * 100:+.3f}%" if before > 0 else "n/a"  # noqa: E731
    print(f"{args.model}: {before:.4f} ms on {cost.label}; {len(rows)} of {len(rules)} rules match "
          f"(saving of one step, % of the model's cost: best / mean / worst over the first {limit} locations)")
    for r in rows:
        print(f"{r['id']:<28} {r['matches']:>4} matches  {pct(r['best_ms']):>9} {pct(r['mean_ms']):>9} "
              f"{pct(r['worst_ms']):>9}   {r['name']}")
    return 0
