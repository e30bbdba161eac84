"""Generate and verify the rule set (pipeline stage ``generate_rules``): TASO's substitution generator over small
symbolic graphs, numeric verification in float64 at several shapes, TASO's pruning, plus the builtin rules, then
the pruning of the whole set (rlflow.rewrite.prune.prune_final: rules that only swap operands of commutative ops,
a rank-general rule's copies at other ranks, rules another rule covers).

Reads these config keys: rules.max_ops, rules.max_outputs, rules.max_elements, rules.ops, rules.variables,
rules.seed (generation and verification), rules.trials, rules.max_dim, rules.builtin, rules.bias_fusion and rules.fused_kernels.
Writes the rules file (``--out``, format of rlflow.rewrite.rule) and ``stats.json`` beside it (counts at every
step and seconds), atomically and together. A progress bar goes to stderr; a one-line summary to stdout.

Config: --config may be given several times; later files are deep-merged over earlier ones, then every
--set KEY=VALUE applies (VALUE is YAML or JSON). Without --config the schema defaults apply.

Examples:
  rlflow generate-rules --config config.yaml --set rules.max_ops=2 --out /tmp/rules/rules.json
  rlflow generate-rules --config config.yaml --config tests/configs/tiny.yaml --out /tmp/rules.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import replace

from rlflow.config import get, load_config
from rlflow.errors import RLFlowError

HELP = "generate, verify and prune substitution rules (pipeline stage generate_rules)"
SET_EXAMPLE = "rules.max_ops=2"
STATS_FORMAT = 1


def _progress_factory(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return lambda desc, total: tqdm(desc=desc, total=total, file=sys.stderr, leave=False, mininterval=1.0, disable=None,
                                    unit=" graphs" if total is None else "")


def _builtin_verifier():
    """:func:`rlflow.rewrite.builtin.verified_builtin_rules`; a rules file without the builtin rules (they carry
    most matches on real models) is never written silently, so a failed import is an error."""
    try:
        from rlflow.rewrite.builtin import verified_builtin_rules
    except ImportError as e:
        raise RLFlowError(f"rules.builtin is true but the builtin rules (rlflow.rewrite.builtin) cannot be "
                          f"imported: {e}; fix the installation, or --set rules.builtin=false to write a rules file "
                          f"without them") from e
    return verified_builtin_rules


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    rc = get(config, "rules")
    if args.out.exists() and args.out.is_dir():
        raise RLFlowError(f"{args.out}: --out is a folder, expected a .json file path")
    stats_path = args.out.with_name("stats.json")

    from rlflow.atomic import atomic_path
    from rlflow.rewrite.generator import GeneratorConfig, generate, rule_id
    from rlflow.rewrite.prune import prune_final
    from rlflow.rewrite.rule import rule_from_json, rules_document

    verified_builtin_rules = _builtin_verifier() if rc["builtin"] else None  # before minutes of generation
    cfg = GeneratorConfig(max_ops=rc["max_ops"], max_outputs=rc["max_outputs"], max_elements=rc["max_elements"],
                          ops=tuple(rc["ops"]), variables=dict(rc["variables"]), seed=rc["seed"])
    t0 = time.perf_counter()
    progress = _progress_factory(not getattr(args, "no_progress", False))
    res = generate(cfg, trials=rc["trials"], max_dim=rc["max_dim"], verify_seed=rc["seed"],
                   progress_factory=progress)
    t1 = time.perf_counter()
    builtins = [] if verified_builtin_rules is None else \
        [r.to_json() for r in verified_builtin_rules(rc["trials"], rc["max_dim"], rc["seed"], rc["bias_fusion"],
                                                 rc["fused_kernels"])]
    t_builtin = time.perf_counter() - t1

    rules = [rule_from_json(r, "generated rules") for r in res.rules + builtins]
    ids = [r.id for r in rules]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise RLFlowError(f"rule id '{dup}' is used by a generated and a builtin rule")
    t2 = time.perf_counter()
    keep, final_steps = prune_final(rules)
    rules = [rules[i] for i in keep]
    t_final = time.perf_counter() - t2
    generated = [r for r in rules if r.origin == "generated"]  # numbered again: g0001... without gaps
    new_id = {r.id: rule_id(n, len(generated)) for n, r in enumerate(generated)}
    rules = [replace(r, id=new_id.get(r.id, r.id)) for r in rules]
    params = {**cfg.to_json(), "trials": rc["trials"], "max_dim": rc["max_dim"], "builtin": rc["builtin"],
              **({"bias_fusion": True} if rc["builtin"] and rc["bias_fusion"] else {}),
              **({"fused_kernels": True} if rc["builtin"] and rc["fused_kernels"] else {}),
              "method": "TASO enumeration + int64 fingerprint; random-float64 verification"}
    doc = rules_document(rules, params)
    stats = {"format": STATS_FORMAT, **res.stats, "builtin_rules": len(builtins),
             "after_each_final_pruning_step": {"generated_and_builtin": len(res.rules) + len(builtins), **final_steps},
             "final_rules": len(rules), "final_generated_rules": len(generated),
             "builtin_families": dict(sorted(Counter(r.name for r in rules if r.origin != "generated").items()))}
    stats["seconds"] = {**res.stats["seconds"], "builtin": round(t_builtin, 2), "final_prune": round(t_final, 2),
                        "total": round(time.perf_counter() - t0, 2)}
    with atomic_path(args.out) as tmp_rules, atomic_path(stats_path) as tmp_stats:  # both appear, or neither
        tmp_rules.write_text(json.dumps(doc, indent=1) + "\n")
        tmp_stats.write_text(json.dumps(stats, indent=1) + "\n")
    steps = dict(res.stats["after_each_pruning_step"])
    special = steps.pop("specialisation")
    print(f"generate_rules: {stats['graphs_enumerated']} graphs enumerated, {stats['candidates']} candidates -> "
          f"{list(steps.values())[-1]} after pruning ({', '.join(f'{k} {v}' for k, v in steps.items())}) -> "
          f"{stats['verified']} verified -> {special} after specialisation ({stats['rank_general']} rank-general); "
          f"+ {len(builtins)} builtin -> "
          f"{', '.join(f'{k} {v}' for k, v in final_steps.items())} = {len(rules)} rules in "
          f"{stats['seconds']['total']:.1f} s -> {args.out}", flush=True)
    return 0
