"""Join a model's rollout shards into one file (pipeline stage ``merge_rollouts``).

Reads <shards-dir>/shard-<K>.json for every K in rollouts.shards (in that order), checks that they were
collected with the same model, rules, environment and cost model, and writes one rollouts file with the
episodes of all shards and summary statistics (format: rlflow/agents/rollouts.py). With --graphs, it also joins
the shards' graphs files (<shards-dir>/shard-<K>.graphs.npz, each checked against its shard's episodes) into one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlflow.config import get, load_config
from rlflow.errors import RLFlowError

HELP = "join a model's rollout shards into one file (pipeline stage merge_rollouts)"
SET_EXAMPLE = "rollouts.shards=[0,1,2]"
SAME = ("format", "model", "seed", "rules", "env", "cost", "metric_names", "stop_prob")


def _read(path: Path) -> dict:
    from rlflow.agents.rollouts import FORMAT

    if not path.is_file():
        raise RLFlowError(f"{path}: no such rollouts shard (collect it with `rlflow collect-rollouts`)")
    try:
        doc = json.loads(path.read_text())
    except ValueError:
        raise RLFlowError(f"{path}: not valid JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("episodes"), list):
        raise RLFlowError(f"{path}: not a rollouts file of format {FORMAT}")
    return doc


def run(args: argparse.Namespace) -> int:
    from rlflow.agents.rollouts import summarise

    config = load_config(args.config, args.overrides)
    shards = get(config, "rollouts.shards")
    docs = [_read(args.shards_dir / f"shard-{k}.json") for k in shards]
    first = docs[0]
    for k, d in zip(shards, docs):
        for key in SAME:
            if d.get(key) != first.get(key):
                raise RLFlowError(f"shard {k}: '{key}' differs from shard {shards[0]}'s; recollect the shards")
        if d.get("model") != args.model:
            raise RLFlowError(f"shard {k} is of model '{d.get('model')}', not '{args.model}'")
    episodes = [e for d in docs for e in d["episodes"]]
    seconds = sum(d["stats"].get("seconds", 0.0) for d in docs)
    merged = {key: first[key] for key in SAME}
    merged["shards"] = list(shards)
    merged["stats"] = {**summarise(episodes), "collect_seconds": seconds}
    merged["episodes"] = episodes
    from rlflow.atomic import write_text

    if args.graphs:
        from rlflow.agents.rollouts import check_graphs, join_graphs, read_graphs
        from rlflow.atomic import write_npz

        parts = []
        for k, d in zip(shards, docs):
            path = args.shards_dir / f"shard-{k}.graphs.npz"
            parts.append(read_graphs(path))
            check_graphs(parts[-1], d["episodes"], str(path))
        write_npz(args.graphs, join_graphs(parts, episodes))
    write_text(args.out, json.dumps(merged, separators=(",", ":")) + "\n")
    s = merged["stats"]
    print(f"merge_rollouts: wrote {args.out}: {len(shards)} shards, {s['episodes']} episodes, {s['steps']} steps; "
          f"best runtime {s['best_runtime_ms']:.3f} ms ({s['best_improvement_pct']:.2f}% below the original)")
    return 0
