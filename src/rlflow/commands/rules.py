"""Work with rule files (verified substitutions).

  rlflow rules generate --config config.yaml --out results/rules/rules.json   (the generate_rules stage)
  rlflow rules check results/rules/rules.json [--reverify]    validate a (hand-edited) file; optionally re-verify
  rlflow rules list results/rules/rules.json [--origin builtin] [--op Conv]

A malformed or hand-edited file gives one line naming the rule id and the problem, and exit status 2.
"""

from __future__ import annotations

import json

NAME = "rules"
HELP = "generate, check or list rule files (verified substitutions)"


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="rules_command", metavar="ACTION", required=True)
    gen = sub.add_parser("generate", help="generate and verify rules (the pipeline's generate_rules stage)")
    from rlflow.pipeline.registry import stage
    from rlflow.stages import generate_rules

    stage("generate_rules").add_cli_arguments(gen, generate_rules.SET_EXAMPLE)
    chk = sub.add_parser("check", help="validate a rules file; with --reverify, check every rule numerically again")
    chk.add_argument("file", metavar="RULES.json")
    chk.add_argument("--reverify", action="store_true", help="re-run the numeric verification of every rule")
    chk.add_argument("--trials", type=int, default=5, help="instantiations per rule with --reverify (default 5)")
    lst = sub.add_parser("list", help="one line per rule: id, origin, source ops -> target ops")
    lst.add_argument("file", metavar="RULES.json")
    lst.add_argument("--origin", choices=("generated", "builtin"), help="only rules of this origin")
    lst.add_argument("--op", help="only rules whose source uses this op")
    lst.add_argument("--json", action="store_true", help="print the selected rules as JSON")


def run(args) -> int:
    from rlflow.errors import RLFlowError
    from rlflow.rewrite import load_rules

    if args.rules_command == "generate":
        from rlflow.stages import generate_rules

        return generate_rules.run(args)
    rules = load_rules(args.file)
    if args.rules_command == "check":
        if args.reverify:
            from rlflow.rewrite.verify import verify

            for r in rules:
                if verify(r, trials=args.trials, examples=r.verified.get("examples")) is None:
                    raise RLFlowError(f"{args.file}: rule '{r.id}' ({r.name}) fails numeric verification")
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
