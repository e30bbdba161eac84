"""Sample efficiency of the dream controller against the model-free agent, at several rollout budgets (issue K:
the controller should reach >= 95% of the model-free agent's improvement with <= 25% of its real interactions;
RLFlow's paper: about 1M against 4M).

For each rollout budget (``--episodes``: random-agent episodes, one shard), the pipeline's own stage commands run
in a temporary folder, on the model and cost target of the config: collect_rollouts, merge_rollouts,
train_encoder, train_world_model, then train_controller (dream only) and train_model_free (real env), each with
the config's budgets. Both agents' encoders learn from the same rollouts, and real interactions are counted the
one way of every agent stage (rollouts + training + evaluation: ``real_interactions`` in their metrics). Each row
also sets the controller beside the model-free agent of the FIRST budget, or with ``--against pipeline`` beside the
pipeline's own model-free agent (its metrics.json), so that a smaller rollout budget for the controller can be read
against the model-free agent as the pipeline trains it.

  python benchmarks/sample_efficiency.py --model bert --episodes 100 20
  python benchmarks/sample_efficiency.py --model bert --seeds 0 1 2      # the default budget, three seeds
  python benchmarks/sample_efficiency.py --model vit --episodes 20 --against pipeline   # beside the pipeline's agent

The default pipeline collects one shard of 20 episodes (config.yaml ``rollouts``), so ``--episodes 20`` with the
config's seed reruns the pipeline's own learning chain. About 7 minutes per budget on paper-size bert on a 2-core
CPU. The last line is ``sample_efficiency <model>: ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rlflow.report.paper import CLAIM_MAX_INTERACTION_SHARE, CLAIM_MIN_GAIN_SHARE  # noqa: E402


def _run(args: list[str], log: Path) -> None:
    """One stage command (``rlflow ARGS``, this interpreter), its output appended to ``log``."""
    bars = [] if args[0] == "merge-rollouts" else ["--no-progress"]
    with open(log, "a") as f:
        r = subprocess.run([sys.executable, "-m", "rlflow.cli", *args, *bars], cwd=ROOT, stdout=f,
                           stderr=subprocess.STDOUT)
    if r.returncode:
        sys.exit(f"sample_efficiency: `rlflow {args[0]}` failed (exit {r.returncode}); see {log}")


def one_budget(model: str, episodes: int, config: list[str], d: Path, onnx: str | None = None,
               rules: str = "results/rules/rules.json") -> dict:
    """The learning chain in folder ``d`` on ``onnx`` (default: the pipeline's results/<model>/model.onnx) with
    the rule file ``rules``; each agent's real improvement (%) and real interactions."""
    (d / "rollouts").mkdir(parents=True)
    log = d / "log.txt"
    conf = [x for c in config for x in ("--config", c)] + ["--set", f"rollouts.episodes={episodes}",
                                                            "--set", "rollouts.shards=[0]"]
    quick = ["--set", "timing.budget_s=1", "--set", "timing.sessions=2"]  # the never-slower check: not measured here
    prob = ["--model", model, "--onnx", onnx or f"results/{model}/model.onnx", "--rules", rules]
    costs = ROOT / f"results/costs/auto/{model}.json"
    if onnx is None and costs.is_file():  # the pipeline's measured costs belong to the pipeline's export
        prob += ["--costs", str(costs)]
    _run(["collect-rollouts", *conf, *prob, "--shard", "0", "--out", str(d / "rollouts/shard-0.json"),
          "--graphs", str(d / "rollouts/shard-0.graphs.npz")], log)
    _run(["merge-rollouts", *conf, "--model", model, "--shards-dir", str(d / "rollouts"), "--out",
          str(d / "rollouts.json"), "--graphs", str(d / "rollouts.graphs.npz")], log)
    _run(["train-encoder", *conf, *prob, "--rollouts", str(d / "rollouts.json"), "--graphs",
          str(d / "rollouts.graphs.npz"), "--out", str(d / "encoder.pt"), "--latents", str(d / "latents.npz"),
          "--metrics", str(d / "encoder.json")], log)
    _run(["train-world-model", *conf, "--model", model, "--latents", str(d / "latents.npz"), "--out",
          str(d / "wm.pt"), "--metrics", str(d / "wm.json"), "--curve", str(d / "loss.csv")], log)
    out = {}
    for method, cmd, extra in (("rlflow", "train-controller", ["--latents", str(d / "latents.npz"), "--world-model",
                                                                str(d / "wm.pt")]),
                               ("model_free", "train-model-free", [])):
        _run([cmd, *conf, *prob, "--encoder", str(d / "encoder.pt"), *extra, "--out", str(d / f"{method}.pt"),
              "--metrics", str(d / f"{method}.json"), "--optimised", str(d / f"{method}.onnx"),
              "--trace", str(d / f"{method}-trace.json"), *quick], log)
        m = json.loads((d / f"{method}.json").read_text())
        out[method] = {"improvement_pct": m["real"]["improvement_pct"], "interactions": m["real_interactions"]}
    return out


def machine() -> str:
    """The CPU, torch's and numpy's versions and the vector kernels torch picked on it (AVX2, AVX512, ...)."""
    import numpy
    import torch

    from rlflow.cost.model import describe_hardware

    return (f"{describe_hardware('cpu')}, torch {torch.__version__} (CPU kernels "
            f"{torch.backends.cpu.get_cpu_capability()}), numpy {numpy.__version__}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert", help="a model the pipeline exported (results/<model>/model.onnx)")
    ap.add_argument("--episodes", type=int, nargs="+", default=[20],
                    help="rollout budgets: random episodes in one shard (default: 20, the pipeline's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="run every budget with each of these seeds (config key seed: other rollouts, weights and "
                         "samples) and print the spread; default: the config's seed only")
    ap.add_argument("--config", action="append", default=None, help="config files (default config.yaml)")
    ap.add_argument("--keep", type=Path, default=None, metavar="DIR",
                    help="write each budget's stage outputs (rollouts, encoder, world model, both agents' metrics, "
                         "traces and graphs) under DIR/episodes-<N> (DIR/seed-<S>/episodes-<N> with --seeds) and keep them "
                         "(default: a temporary folder)")
    ap.add_argument("--against", choices=("first", "pipeline"), default="first",
                    help="the model-free agent each row's controller is set beside: that of the first budget "
                         "(default), or the pipeline's own (results/<model>/model_free/metrics.json: the config's "
                         "rollout episodes, trained as `snakemake` trains it)")
    a = ap.parse_args()
    pipeline_mf = ROOT / f"results/{a.model}/model_free/metrics.json"
    if a.against == "pipeline" and not pipeline_mf.is_file():
        print(f"sample_efficiency: --against pipeline needs {pipeline_mf} (run `snakemake {pipeline_mf}` first)",
              file=sys.stderr)
        return 2
    if not (ROOT / f"results/{a.model}/model.onnx").is_file() or not (ROOT / "results/rules/rules.json").is_file():
        print(f"sample_efficiency: needs results/{a.model}/model.onnx and results/rules/rules.json (run the "
              "pipeline's export_model and generate_rules first)", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    seeds = a.seeds or [None]
    folder = lambda work, seed, ep: work / ("" if seed is None else f"seed-{seed}") / f"episodes-{ep}"  # noqa: E731
    if a.keep is not None and any(folder(a.keep, s, ep).exists() for s in seeds for ep in a.episodes):
        print(f"sample_efficiency: {a.keep} already holds a folder of these budgets; name another --keep folder",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = a.keep.resolve() if a.keep is not None else Path(tmp)
        for seed in seeds:
            config = list(a.config or ["config.yaml"])
            if seed is not None:
                (work / f"seed-{seed}").mkdir(parents=True, exist_ok=True)
                config.append(str(work / f"seed-{seed}/seed.yaml"))
                Path(config[-1]).write_text(f"seed: {seed}\n")
            for ep in a.episodes:
                print(f"rollout budget {ep} episodes" + ("" if seed is None else f", seed {seed}") + " ...",
                      file=sys.stderr, flush=True)
                rows.append((seed, ep, one_budget(a.model, ep, config, folder(work, seed, ep))))
    if a.against == "pipeline":
        m = json.loads(pipeline_mf.read_text())
        mf0, ref = {"improvement_pct": m["real"]["improvement_pct"], "interactions": m["real_interactions"]}, \
            "the pipeline's model-free agent"
    else:
        mf0, ref = rows[0][2]["model_free"], f"model-free of {rows[0][1]} episodes"
    print(f"machine: {machine()} (a seed's figures can differ on another kind of CPU, whose vector kernels round "
          "differently, or with other library versions)")
    print(f"reference: {ref}: {mf0['improvement_pct']:.2f}%, {mf0['interactions']['total']:,} interactions")
    print("| seed | rollout episodes | rollout steps | controller: improvement | controller: interactions | model-free: "
          "improvement | model-free: interactions | controller / model-free (same rollouts): improvement, "
          f"interactions | controller / {ref}: improvement, interactions |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    last = []
    ratio = lambda x, y: (x["improvement_pct"] / y["improvement_pct"],  # noqa: E731
                          x["interactions"]["total"] / y["interactions"]["total"])
    share = lambda x, y: "{:.2f}, {:.2f}".format(*ratio(x, y))  # noqa: E731
    for seed, ep, r in rows:
        c, m = r["rlflow"], r["model_free"]
        print(f"| {'config' if seed is None else seed} | {ep} | {c['interactions']['rollouts']:,} | {c['improvement_pct']:.2f}% | "
              f"{c['interactions']['total']:,} | {m['improvement_pct']:.2f}% | {m['interactions']['total']:,} | "
              f"{share(c, m)} | {share(c, mf0)} |")
        if seed is None:
            last.append(f"{ep}: {share(c, m)} ({share(c, mf0)} against {ref})")
    if a.seeds:  # the spread over seeds, each controller beside the model-free agent of its own rollouts
        for ep in a.episodes:
            rs = [ratio(r["rlflow"], r["model_free"]) for _, e, r in rows if e == ep]
            held = sum(g >= CLAIM_MIN_GAIN_SHARE and n <= CLAIM_MAX_INTERACTION_SHARE for g, n in rs)
            last.append(f"{ep}: improvement {min(g for g, _ in rs):.2f}-{max(g for g, _ in rs):.2f}, interactions "
                        f"{min(n for _, n in rs):.2f}-{max(n for _, n in rs):.2f} over seeds "
                        + " ".join(map(str, a.seeds)) + f"; the claim (>= {CLAIM_MIN_GAIN_SHARE:.2f} of the "
                        f"improvement with <= {CLAIM_MAX_INTERACTION_SHARE:.2f} of the interactions) holds on {held} "
                        f"of {len(rs)}")
    print(f"sample_efficiency {a.model}: controller/model-free improvement, interactions at rollout episodes "
          + "; ".join(last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
