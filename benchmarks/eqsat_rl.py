"""eqsat-rl against eqsat, random schedules and the tree search: extracted cost and optimisation time per zoo model.

Every method saturates under the same budget (the config's eqsat section, or --node-limit / --ilp-limit /
--ilp-nodes; --clock-free turns both clocks off) and extracts with the same ILP (rlflow.search.eqsat_rl). Per model:
  eqsat     eqsat's fixed backoff schedule (eqsat_search)
  random    a uniformly random family action per iteration, --random-seeds seeds (mean cost and time; best cost)
  tree      UCT over the first --depth iterations' actions, --simulations leaves scored by the cheap proxy; its
            time includes the search
  learned   the linear softmax policy trained by REINFORCE on --train models (training wall time printed); the
            other models are held out. With --per-model: each training model's own best constant schedule (of
            --actions; --openers adds each action once, then eqsat's schedule; --stop-after K ends the cheapest
            ones after K iterations), one policy imitating them all (it
            sees the input graph's op mix); clock-free, a training model's eqsat and learned rows are then its
            training runs (the same graphs a rerun gives), not rerun
The learned agent's and the tree search's results are checked equal to the input
(rlflow.graph.exec.check.check_equal). With --time-pairs K, eqsat and eqsat-rl run K more times each, interleaved
(eqsat first in even pairs), and eqsat-rl's
optimisation time over eqsat's is printed with its 95% interval (rlflow.evaluation.protocol.ratio_interval),
each pair one session of the protocol. The pairs' times are kept in --json; --pool then reads several such files,
one per benchmark process, and prints the interval over those processes (each process one session, its pairs
the rounds): the several-session figure, where session-to-session effects are inside the interval.
The table comes last; costs are the cost target's estimate (ms).

  python benchmarks/eqsat_rl.py                                   # tiny zoo, sim-h100, node limit 5,000
  python benchmarks/eqsat_rl.py --models bert vit --time-pairs 4
  python benchmarks/eqsat_rl.py --sizes paper --node-limit 50000  # paper sizes (slow: minutes per model)
  python benchmarks/eqsat_rl.py --save-policy policy.json         # keep the agent for rlflow optimize --agent
  python benchmarks/eqsat_rl.py --load-policy policy.json --models resnet50  # score a kept agent, no training
  python benchmarks/eqsat_rl.py --target ort-cpu --costs-dir costs  # a measured target: one cost cache per model
  python benchmarks/eqsat_rl.py --pool run1.json run2.json run3.json  # time ratios over processes, no search
  python benchmarks/eqsat_rl.py --clock-free --ilp-nodes 1000     # no clocks: the same graphs on any machine/load
  python benchmarks/eqsat_rl.py --per-model --actions all no:reorder only:multi --late-candidates 1

A measured target (ort-cpu, torch-eager, cuda) scores each model with its own cost cache, DIR/<model>.json: made
first by `rlflow measure-costs` (the pipeline's measure_costs stage, the config's cost section) where missing,
then reused.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rlflow.cli import main as rlflow_main  # noqa: E402
from rlflow.config import load_config  # noqa: E402
from rlflow.cost import make_cost_model  # noqa: E402
from rlflow.cost.targets import MEASURED  # noqa: E402
from rlflow.errors import RLFlowError  # noqa: E402
from rlflow.evaluation.protocol import ratio_interval  # noqa: E402
from rlflow.graph import load_onnx, zoo  # noqa: E402
from rlflow.graph.exec.check import check_equal  # noqa: E402
from rlflow.rewrite import load_rules  # noqa: E402
from rlflow.rewrite.rule import DEFAULT_RULES  # noqa: E402
from rlflow.search.eqsat import eqsat_search  # noqa: E402
from rlflow.search.eqsat_rl import (EqsatBudget, LinearPolicy, TrainConfig, eqsat_rl_search,  # noqa: E402
                                    random_schedule_search, train_policy, tree_search)

TRAIN = ("bert", "inceptionv3", "squeezenet", "taso-bert")


def model_cost(cfg: dict, args: argparse.Namespace, name: str, onnx: Path):
    """The cost model ``name`` is scored with: the analytic target, or the measured target with the model's own
    cost cache (made by `rlflow measure-costs` if --costs-dir has none)."""
    if args.target not in MEASURED:
        return make_cost_model(cfg, "cpu", kind=args.target)
    cache = args.costs_dir / f"{name}.json"
    if not cache.is_file():
        args.costs_dir.mkdir(parents=True, exist_ok=True)
        print(f"measuring {args.target} costs of {name} -> {cache}", flush=True)
        code = rlflow_main(["measure-costs", "--model", name, "--onnx", str(onnx), "--rules", str(args.rules),
                            "--out", str(cache), "--set", f"cost.target={args.target}", "--no-progress"])
        if code != 0:
            raise SystemExit(f"rlflow measure-costs failed for {name} (exit {code})")
    return make_cost_model(cfg, "cpu", cache, kind=args.target)


def budget_line(budget: EqsatBudget) -> str:
    """The budget in words (a 0 limit is none)."""
    clock = lambda s: f"{s} s" if s else "no clock"  # noqa: E731
    nodes = f"{budget.ilp_node_limit} nodes" if budget.ilp_node_limit else "no node limit"
    return (f"{budget.node_limit} e-nodes, {budget.iter_limit} iterations, saturation {clock(budget.time_limit_s)}; "
            f"ILP {clock(budget.ilp_time_limit_s)}, {nodes}" + (" (clock-free)" if budget.clock_free else ""))


def pool(files: list[Path]) -> None:
    """Print eqsat-rl's optimisation time over eqsat's per model, pooled over ``files`` (benchmark --json outputs
    with --time-pairs >= 1, one per process): each file is one session, its interleaved pairs the rounds."""
    sessions: dict[str, list[dict]] = {}
    for f in files:
        try:
            rows = json.loads(f.read_text())["rows"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"--pool: {f} is not an eqsat_rl benchmark --json file ({e})") from None
        for r in rows:
            if r.get("time_pairs"):
                sessions.setdefault(r["model"], []).append(r["time_pairs"])
    if not sessions:
        raise SystemExit("--pool: none of the files holds timed pairs (run the benchmark with --time-pairs and --json)")
    print(f"learned/eqsat optimisation time over {len(files)} processes (sessions; their pairs are the rounds):")
    print(f"{'model':<12}{'sessions':>9}{'pairs':>7}  ratio [95% interval]")
    for model, ss in sessions.items():
        pairs = sum(len(s["eqsat"]) for s in ss)
        if len(ss) < 2:
            print(f"{model:<12}{len(ss):>9}{pairs:>7}  (one session only: no interval)")
            continue
        ratio, lo, hi, _ = ratio_interval([s["eqsat"] for s in ss], [s["learned"] for s in ss])
        print(f"{model:<12}{len(ss):>9}{pairs:>7}  {ratio:.2f} [{lo:.2f}, {hi:.2f}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(zoo.MODEL_NAMES), choices=zoo.MODEL_NAMES)
    ap.add_argument("--train", nargs="+", default=list(TRAIN), choices=zoo.MODEL_NAMES,
                    help=f"the learned agent's training models (default: {' '.join(TRAIN)})")
    ap.add_argument("--sizes", choices=("tiny", "paper"), default="tiny")
    ap.add_argument("--target", default="sim-h100",
                    help="the cost target: analytic (sim-h100, sim-a100, analytic) or measured (ort-cpu, ...: "
                         "needs --costs-dir)")
    ap.add_argument("--costs-dir", type=Path, help="a measured target's cost caches, <model>.json (made where missing)")
    ap.add_argument("--rules", type=Path, default=DEFAULT_RULES, help="default: the shipped rule set")
    ap.add_argument("--node-limit", type=int, default=5000, help="e-nodes (default 5,000: tiny.yaml's cap)")
    ap.add_argument("--ilp-limit", type=float, default=None, help="ILP seconds (default: the config's; 0: none)")
    ap.add_argument("--ilp-nodes", type=int, default=None, metavar="N",
                    help="the ILP's branch-and-bound nodes per solve (default: the config's; 0: none)")
    ap.add_argument("--clock-free", action="store_true",
                    help="no saturation or ILP time limit (needs --ilp-nodes N > 0): every method's graphs are a "
                         "pure function of the inputs; training rewards weigh time unless --time-weight 0")
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--late-candidates", type=int, default=TrainConfig.late_candidates,
                    help="the best constant schedules also scored stopping at their fixpoint (default %(default)s)")
    ap.add_argument("--all-bias", type=float, default=TrainConfig.all_bias,
                    help="the starting policy's logit of its action (the best constant schedule, else `all`): "
                         "sampling explores around it")
    ap.add_argument("--proxy-ilp", type=float, default=TrainConfig.proxy_ilp_s,
                    help="the ILP's seconds in the training rewards (default %(default)s: the cheap proxy; the "
                         "budget's ILP limit scores schedules as they will be used)")
    ap.add_argument("--time-weight", type=float, default=TrainConfig.time_weight,
                    help="the training reward's weight on optimisation time (default %(default)s: a schedule in half "
                         "of eqsat's time earns what 0.5%% of the input's cost does)")
    ap.add_argument("--per-model", action="store_true",
                    help="train on each model's own best constant schedule, then one policy imitating them all")
    ap.add_argument("--actions", nargs="+", default=[], metavar="ACTION",
                    help="the constant schedules scored in training (default: every action)")
    ap.add_argument("--openers", action="store_true",
                    help="with --per-model, also score each action once, then eqsat's schedule (A once, then all)")
    ap.add_argument("--stop-after", nargs="+", type=int, default=[], metavar="K",
                    help="with --per-model, also score eqsat's schedule and the --stop-candidates cheapest others "
                         "ended after K iterations, for each K")
    ap.add_argument("--stop-candidates", type=int, default=TrainConfig.stop_candidates,
                    help="with --stop-after: the schedules besides eqsat's that are ended early (default %(default)s)")
    ap.add_argument("--skip", nargs="+", default=[], choices=("tree", "random"), help="methods not to run")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--simulations", type=int, default=16)
    ap.add_argument("--random-seeds", type=int, default=3)
    ap.add_argument("--time-pairs", type=int, default=0, metavar="K")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-policy", type=Path)
    ap.add_argument("--load-policy", type=Path, help="score this saved policy instead of training one (--train: "
                    "the models it was trained on, for the held-out marks)")
    ap.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    ap.add_argument("--pool", type=Path, nargs="+", metavar="JSON",
                    help="run nothing: pool the timed pairs of these --json files, one session per file")
    args = ap.parse_args()
    if args.pool:
        return pool(args.pool)
    if args.target in MEASURED and args.costs_dir is None:
        raise SystemExit(f"--target {args.target}: a measured target needs --costs-dir (one cost cache per model, "
                         "made there by rlflow measure-costs where missing)")
    cfg = load_config(None, [f"cost.target={args.target}"])
    e = cfg["eqsat"]
    ilp_nodes = e["ilp_node_limit"] if args.ilp_nodes is None else args.ilp_nodes
    if args.clock_free and (ilp_nodes <= 0 or args.ilp_limit):
        raise SystemExit("--clock-free: needs --ilp-nodes N > 0 (the ILP's only bound) and no --ilp-limit")
    try:
        budget = EqsatBudget(node_limit=args.node_limit, iter_limit=e["iter_limit"],
                             time_limit_s=0 if args.clock_free else e["time_limit_s"],
                             ilp_time_limit_s=0 if args.clock_free else
                             e["ilp_time_limit_s"] if args.ilp_limit is None else args.ilp_limit,
                             multi_iterations=e["multi_iterations"], ilp_node_limit=ilp_nodes)
    except RLFlowError as err:
        raise SystemExit(str(err)) from None
    print(f"budget: {budget_line(budget)}", flush=True)
    rules = load_rules(args.rules)
    loaded = None
    if args.load_policy:
        try:
            loaded = LinearPolicy.load(args.load_policy)
        except RLFlowError as e:
            raise SystemExit(str(e)) from None
        args.train = loaded.info.get("trained_on", args.train)
    graphs, costs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in dict.fromkeys([*([] if loaded else args.train), *args.models]):
            path = Path(tmp) / f"{name}.onnx"
            zoo.export_model(name, path, zoo.TINY_SIZES[name] if args.sizes == "tiny" else None)
            graphs[name] = load_onnx(path)
            costs[name] = model_cost(cfg, args, name, path)
    if loaded is not None:
        policy, history = loaded, []
    else:
        policy, history = train_policy({m: graphs[m] for m in args.train}, rules, costs, budget,
                                       TrainConfig(epochs=args.epochs, lr=args.lr, all_bias=args.all_bias,
                                                   seed=args.seed, proxy_ilp_s=args.proxy_ilp,
                                                   time_weight=args.time_weight,
                                                   late_candidates=args.late_candidates,
                                                   per_model=args.per_model, actions=tuple(args.actions),
                                                   openers=args.openers, stop_after=tuple(args.stop_after),
                                                   stop_candidates=args.stop_candidates),
                                       log=lambda m: print(m, flush=True))
    train_s = policy.info.get("train_seconds", float("nan"))
    if args.save_policy:
        policy.save(args.save_policy)
    rows = []
    # clock-free, a per-model policy's run on a training model it imitates exactly is its training run
    kept = policy.info.get("_results", {}) if budget.clock_free else {}
    exact = {m for m, v in policy.info.get("per_model", {}).items() if v["exact"]}
    for name in args.models:
        g, cost = graphs[name], costs[name]
        if name in kept and name in exact and None not in kept[name]:
            ref, learned = kept[name]
        else:
            ref = eqsat_search(g, rules, cost, **budget.search_kwargs())
            learned = eqsat_rl_search(g, rules, cost, policy, budget)
        tree = None if "tree" in args.skip else tree_search(g, rules, cost, budget, depth=args.depth,
                                                            simulations=args.simulations, seed=args.seed)
        rand = [] if "random" in args.skip else [random_schedule_search(g, rules, cost, budget, seed=args.seed + k)
                                                 for k in range(args.random_seeds)]
        nan = float("nan")
        row = {"model": name, "held_out": name not in args.train, "from_training": name in kept and name in exact,
               "initial_ms": ref.initial.runtime_ms,
               "eqsat_ms": ref.final.runtime_ms, "eqsat_s": ref.seconds, "eqsat_stop": ref.stop_reason,
               "eqsat_ilp_optimal": ref.stats.get("ilp_optimal"),
               "eqsat_ilp_node_limit_reached": ref.stats.get("ilp_node_limit_reached"),
               "learned_ms": learned.final.runtime_ms, "learned_s": learned.seconds,
               "learned_schedule": learned.stats["schedule"], "learned_ilp_optimal": learned.stats.get("ilp_optimal"),
               "learned_ilp_node_limit_reached": learned.stats.get("ilp_node_limit_reached"),
               "learned_max_rel_diff": check_equal(g, learned.graph),
               "tree_ms": tree.final.runtime_ms if tree else nan, "tree_s": tree.seconds if tree else nan,
               "tree_schedule": tree.stats["schedule"] if tree else None,
               "tree_max_rel_diff": check_equal(g, tree.graph) if tree else nan,
               "random_ms": statistics.mean(r.final.runtime_ms for r in rand) if rand else nan,
               "random_best_ms": min(r.final.runtime_ms for r in rand) if rand else nan,
               "random_s": statistics.mean(r.seconds for r in rand) if rand else nan}
        if args.time_pairs >= 1:
            ts = {"eqsat": [], "learned": []}
            runs = [("eqsat", lambda: eqsat_search(g, rules, cost, **budget.search_kwargs()).seconds),
                    ("learned", lambda: eqsat_rl_search(g, rules, cost, policy, budget).seconds)]
            for k in range(args.time_pairs):
                for which, run in runs if k % 2 == 0 else runs[::-1]:
                    ts[which].append(run())
            row["time_pairs"] = ts
            if args.time_pairs >= 2:
                ratio, lo, hi, _ = ratio_interval([[t] for t in ts["eqsat"]], [[t] for t in ts["learned"]])
                row["time_ratio"] = [ratio, lo, hi]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        info = {k: v for k, v in policy.info.items() if not k.startswith("_")}
        args.json.write_text(json.dumps({"rows": rows, "history": history, "policy": info,
                                         "budget": {**asdict(budget), "clock_free": budget.clock_free}},
                                        indent=1) + "\n")
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()}-core CPU, python {platform.python_version()} (shared: "
          f"timings under load); {len(rules)} rules; sizes {args.sizes}; target {args.target}; budget: "
          f"{budget_line(budget)}; tree depth {args.depth}, {args.simulations} simulations; "
          f"{args.random_seeds} random seeds")
    if loaded is not None:
        print(f"learned agent: loaded from {args.load_policy} (trained on {', '.join(args.train)}; its training "
              f"settings: {policy.info.get('train', 'not recorded')})")
    else:
        reward_ilp = "the budget's own (clock-free)" if budget.clock_free else f"{args.proxy_ilp} s"
        how = (f"per model, imitated; actions {' '.join(args.actions) or 'all'}"
               f"{', each also as an opener' if args.openers else ''}"
               f"{'; ended after ' + ' '.join(map(str, args.stop_after)) + ' iterations' if args.stop_after else ''}"
               if args.per_model else
               f"{args.epochs} epochs, lr {args.lr}, all-bias {args.all_bias}")
        print(f"learned agent: trained on {', '.join(args.train)} ({how}, reward ILP {reward_ilp}, time weight "
              f"{args.time_weight}, late candidates {args.late_candidates}) in {train_s:.1f} s; "
              f"best greedy proxy reward {policy.info['best_greedy_reward']:+.4f}")
    for m, v in policy.info.get("per_model", {}).items():
        print(f"  {m}: imitates {v['imitated']} (reward {v['reward']:+.4f}"
              f"{'' if v['exact'] else '; the policy does not reproduce it exactly: its own run scored'})")
    constant = policy.info.get("constant_rewards", {})
    if constant:
        print("constant schedules' mean rewards: " + ", ".join(
            f"{a} {r:+.4f}" for a, r in sorted(constant.items(), key=lambda t: -t[1])))
    print(f"{'model':<12}{'input':>8}{'eqsat':>9}{'random':>9}{'rnd best':>9}{'tree':>9}{'learned':>9}"
          f"{'eqsat s':>9}{'random s':>9}{'tree s':>9}{'learned s':>10}  learned/eqsat time")
    for r in rows:
        ratio = "" if "time_ratio" not in r else "{:.2f} [{:.2f}, {:.2f}]".format(*r["time_ratio"])
        print(f"{r['model'] + ('*' if r['held_out'] else ''):<12}{r['initial_ms']:>8.4f}{r['eqsat_ms']:>9.4f}"
              f"{r['random_ms']:>9.4f}{r['random_best_ms']:>9.4f}{r['tree_ms']:>9.4f}{r['learned_ms']:>9.4f}"
              f"{r['eqsat_s']:>9.1f}{r['random_s']:>9.1f}{r['tree_s']:>9.1f}{r['learned_s']:>10.1f}  {ratio}")
    print("(* held out: not a training model of the learned agent; costs in ms on the target, times in s)")
    if any(r["from_training"] for r in rows):
        print("(eqsat and learned rows of " + ", ".join(r["model"] for r in rows if r["from_training"]) +
              ": their clock-free training runs, which the policy replays exactly)")


if __name__ == "__main__":
    main()
