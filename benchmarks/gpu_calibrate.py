"""Measure what a calibrated GPU target learns from: whole-model runs of the zoo, the held-out exports and searched
graphs on the GPU, taken apart per node (:mod:`rlflow.cost.gpu_profile`), written as one calibration file.

Two steps, since the lent GPU machine has no network and paper-size weights do not travel:

  python benchmarks/gpu_calibrate.py --pack cal_pack        # here: export, search, write weightless copies
  python benchmarks/gpu_calibrate.py --from cal_pack --out calibration/h200.json    # on the GPU box

``--pack`` writes, per zoo model at paper size, ``original.onnx`` and the graphs two searches on the simulated H100
find (``eqsat``, ``greedy``; :func:`rlflow.api.optimize` without the never-slower check), and per held-out
transformers export (tests/hf_exports.py: BERT, ViT, GPT-2 at two sizes) the export itself, and per zoo
transformer (bert, vit, gpt2) a folder ``<model>-o23``: the export at opset 23 (``original.onnx``) and the graph
greedy finds with the fused-kernel rules there (``fused.onnx``, every attention block one ``Attention``), so that
a fit learns the fused op's cost; all weightless (benchmarks/sim_vs_real.py's packing: large float tensors
emptied, refilled with seeded values on reading).

``--from`` compares each searched graph with its original end to end under the measurement protocol
(``--sessions``, ``--budget``: the verdicts a calibrated target's estimates must agree with), then profiles every
graph on the device (``profile_graph``: end-to-end runs, per-node host and kernel times) in ``--rounds`` rounds
of shuffled order, each graph's figures the medians over its rounds. Last line: ``<n> graphs profiled in <s> s;
<k> comparisons``. ``--fit`` makes the calibration file from such profiles (here; several pooled) and prints how well it
predicts.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks"), str(ROOT / "tests")]

ZOO = ("bert", "vit", "gpt2", "taso-bert", "resnet18", "resnet50", "resnext50", "squeezenet", "inceptionv3")
SEARCHES = ("eqsat", "greedy")
#: the zoo models with attention, packed again at this opset with their attention fused (folder <model>-o23)
FUSED_MODELS, FUSED_OPSET = ("bert", "vit", "gpt2"), 23


def pack_fused(src: Path, dest: Path) -> tuple[int, float]:
    """``dest``/original.onnx: the export ``src`` at opset 23 (attention masks in canonical form); ``dest``/fused.onnx:
    greedy's graph for the simulated H100 with the shipped rules plus the fused-kernel family. Both weightless.
    Both are first checked to compute the export's outputs (onnxruntime, :func:`check_equal`: RLFlowError if
    not, and nothing is written). Returns the fused graph's Attention count and its largest relative difference
    from the export."""
    import onnx

    from rlflow.config import load_config
    from rlflow.cost import make_cost_model
    from rlflow.graph import load_onnx, to_onnx
    from rlflow.graph.exec.check import check_equal
    from rlflow.graph.fold import at_opset
    from rlflow.rewrite.builtin import verified_builtin_rules
    from rlflow.rewrite.rule import load_rules
    from rlflow.search.output import run_method
    from sim_vs_real import _strip

    exported = load_onnx(str(src))
    graph = at_opset(exported, FUSED_OPSET)
    fused = [r for r in verified_builtin_rules(fused_kernels=True) if r.name.startswith("attention-")]
    cost = make_cost_model(load_config([ROOT / "config.yaml"]), "cpu", kind="sim-h100")
    found = run_method("greedy", graph, load_rules() + fused, cost).graph
    check_equal(exported, graph, what=str(src))
    diff = check_equal(exported, found, what=str(src))
    dest.mkdir(parents=True, exist_ok=True)
    onnx.save(_strip(to_onnx(graph)), str(dest / "original.onnx"))
    onnx.save(_strip(to_onnx(found)), str(dest / "fused.onnx"))
    return sum(n.op == "Attention" for n in found.nodes), diff


def make_pack(out: Path, models: list[str], heldout: bool, exported: Path | None, fused: bool = True) -> None:
    import onnx

    from rlflow.api import optimize
    from sim_vs_real import _strip

    for model in models:
        (out / model).mkdir(parents=True, exist_ok=True)
        src = exported / f"{model}.onnx" if exported else None
        if src is None or not src.is_file():
            from rlflow.cli import main as cli

            src = out / f"{model}.full.onnx"
            cli(["export-model", "--config", str(ROOT / "config.yaml"), "--model", model, "--out", str(src)])
        onnx.save(_strip(onnx.load(str(src))), str(out / model / "original.onnx"))
        for method in SEARCHES:
            t0 = time.perf_counter()
            found = optimize(str(src), method=method, target="sim-h100", speed_check=False,
                             config=str(ROOT / "config.yaml"))
            onnx.save(_strip(found), str(out / model / f"{method}.onnx"))
            print(f"packed {model}/{method} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if fused and model in FUSED_MODELS:
            n, diff = pack_fused(src, out / f"{model}-o{FUSED_OPSET}")
            print(f"packed {model}-o{FUSED_OPSET}: original and fused ({n} Attention ops; outputs as the "
                  f"export's within {diff:.1e}, onnxruntime)", flush=True)
        if src.parent == out:
            src.unlink()
    if heldout:
        from hf_exports import FAMILIES, SIZES, export

        for family in FAMILIES:
            for size in SIZES[family]:
                d = out / f"hf-{family}-{size}"
                d.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory() as tmp:
                    export(family, size, Path(tmp) / "m.onnx")
                    onnx.save(_strip(onnx.load(str(Path(tmp) / "m.onnx"))), str(d / "original.onnx"))
                print(f"packed hf-{family}-{size}", flush=True)


def measure(pack: Path, out: Path, sessions: int, budget: float, runs: int, only: list[str] | None,
            limit: float | None = None, rounds: int = 3) -> int:
    from rlflow.config import load_config
    from rlflow.cost import make_cost_model
    from rlflow.cost.gpu_profile import PROFILE_FORMAT, combine, profile_graph
    from rlflow.cost.model import describe_hardware
    from rlflow.evaluation import protocol as proto
    from rlflow.graph import load_onnx
    from rlflow.graph.exec import get_runner, make_inputs
    from rlflow.graph.fold import fold_constants
    from sim_vs_real import unpack

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sim = make_cost_model(load_config([ROOT / "config.yaml"]), "cpu", kind="sim-h100")
    protocol = proto.Protocol(sessions=sessions, budget_s=budget, seed=0) if sessions > 0 else None
    doc = {"format": PROFILE_FORMAT, "device": device, "hardware": describe_hardware(device),
           "measured": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "protocol": protocol.describe() if protocol else "none (--sessions 0: no comparisons)",
           "graphs": {}, "comparisons": {}}
    print(f"device {device}: {doc['hardware']}; torch {torch.__version__}; {doc['protocol']}", flush=True)
    t_all = time.perf_counter()
    folders = sorted(d for d in pack.iterdir() if (d / "original.onnx").is_file())
    if only:
        folders = [d for d in folders if d.name in only]
    with tempfile.TemporaryDirectory(prefix="gpu-cal-") as tmp:
        graphs: dict[str, dict] = {}  # folder -> stem -> graph
        for d in folders:
            graphs[d.name] = {f.stem: fold_constants(load_onnx(unpack(f, Path(tmp), 0)))
                              for f in sorted(d.glob("*.onnx"), key=lambda f: (f.stem != "original", f.stem))}
        print(f"loaded {sum(map(len, graphs.values()))} graphs in {time.perf_counter() - t_all:.0f} s", flush=True)
        for folder, gs in graphs.items():  # the verdicts the estimates must agree with: the protocol, interleaved
            searched = [n for n in gs if n != "original"]
            if searched and protocol:
                timed = [("original", gs["original"])] + [(n, gs[n]) for n in searched]
                timed.append((proto.AA, proto.aa_copy(gs["original"])))
                cmp = proto.compare(timed, make_inputs(gs["original"], 0), protocol,
                                    lambda g: get_runner(g, "torch", device))
                for n, _ in timed[1:]:
                    e = cmp[n]
                    doc["comparisons"][f"{folder}/{n}"] = {"ratio": e.ratio, "ci": [e.ci_low, e.ci_high],
                                                           "verdict": e.verdict, "latency_ms": e.latency_ms}
                    print(f"  {folder}/{n} vs original, torch end to end: {e.ratio:.3f} [{e.ci_low:.3f}, "
                          f"{e.ci_high:.3f}] {e.verdict}", flush=True)
        # the profiles in rounds over every graph, each round in a shuffled order: the host's speed drifts between
        # runs seconds apart (1.7x in one recorded profile), and each graph's figures are medians over the rounds
        names = [(f, n) for f, gs in graphs.items() for n in gs]
        recs: dict[str, list] = {}
        rng = random.Random(0)
        for r in range(rounds):
            if r and limit is not None and time.perf_counter() - t_all > limit:
                print(f"time limit ({limit:.0f} s): {r} of {rounds} rounds", flush=True)
                break
            rng.shuffle(names)
            t0 = time.perf_counter()
            for folder, n in names:
                recs.setdefault(f"{folder}/{n}", []).append(profile_graph(graphs[folder][n], device, runs=runs,
                                                                          profiled=1, warmup=3))
            print(f"round {r + 1}: {len(names)} graphs profiled in {time.perf_counter() - t0:.0f} s", flush=True)
        for folder, n in sorted(names):
            name = f"{folder}/{n}"
            rec = doc["graphs"][name] = combine(recs[name])
            rec["sim_h100_ms"] = sim.graph_metrics(graphs[folder][n]).runtime_ms
            host = sum(x["host_us"] for x in rec["nodes"]) / 1e3
            dev = sum(x["device_us"] for x in rec["nodes"]) / 1e3
            print(f"{name}: {len(rec['nodes'])} nodes, e2e {statistics.median(rec['e2e_ms']):.3f} ms (rounds "
                  + ", ".join(f"{statistics.median(x['e2e_ms']):.3f}" for x in recs[name])
                  + f"), host {host:.3f} ms, kernels {dev:.3f} ms, GPU busy "
                  f"{statistics.median(rec['gpu_busy_ms'] or [0]):.3f} of span "
                  f"{statistics.median(rec['gpu_span_ms'] or [0]):.3f} ms", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc))
    print(f"{len(doc['graphs'])} graphs profiled in {time.perf_counter() - t_all:.0f} s; "
          f"{len(doc['comparisons'])} comparisons")
    return 0


def fit_and_check(profile_paths: list[Path], out: Path | None, gpu: str, holdout: list[str],
                  pack: Path = ROOT / ".gpu/cal_pack") -> int:
    """Fit a calibration file from one or more recorded profiles (pooled) and print, per profile, how well it
    predicts: per graph the end-to-end time beside the estimate (graphs whose name starts with a ``holdout`` prefix
    from a fit without them), and per searched graph the protocol's verdict beside the calibrated, the spec-sheet
    sim-h100 and the kernels-only ratios (the kernels' time summed: what timing each op alone on the GPU, the
    ``cuda`` target, sees). ``pack``: the --pack folder whose graphs the profiles measured (they are estimated)."""
    import gzip

    from rlflow.config import load_config
    from rlflow.cost import make_cost_model
    from rlflow.cost.gpu_calibrated import CalibratedGpuCost, fit
    from rlflow.graph import load_onnx
    from rlflow.graph.fold import fold_constants
    from sim_vs_real import unpack

    profiles = []
    for path in profile_paths:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
            profiles.append(json.load(f))
    full = fit(profiles)
    held = fit(profiles, exclude=holdout) if holdout else full
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(full, indent=0) + "\n")
        print(f"wrote {out}: {len(full['signatures'])} op signatures from {len(full['graphs'])} graphs in "
              f"{len(profiles)} profile(s) ({full['hardware']}, measured {full.get('measured')})")
    if not pack.is_dir():
        raise SystemExit(f"gpu_calibrate: no {pack}: run --pack {pack} first (the graphs are estimated)")
    sim = make_cost_model(load_config([ROOT / "config.yaml"]), "cpu", kind="sim-h100")
    models = {"full": CalibratedGpuCost(gpu, full), "held": CalibratedGpuCost(gpu, held)}
    graphs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted({n for p in profiles for n in p["graphs"]}):
            folder, stem = name.split("/")
            if (pack / folder / f"{stem}.onnx").is_file():
                graphs[name] = fold_constants(load_onnx(unpack(pack / folder / f"{stem}.onnx", Path(tmp), 0)))
    for path, profile in zip(profile_paths, profiles):
        print(f"\nprofile {path.name} (measured {profile.get('measured')}); the fit pools {len(profiles)}")
        _check_profile(profile, graphs, models, sim, holdout, gpu)
    return 0


def _check_profile(profile: dict, graphs: dict, models: dict, sim, holdout: list[str], gpu: str) -> None:
    """The per-graph and per-comparison lines of :func:`fit_and_check` for one profile."""
    est, errs = {}, {"zoo": [], "held out": [], f"opset-{FUSED_OPSET}": []}
    print(f"{'graph':26} {'nodes':>5} {'e2e ms':>8} {'estimate':>8} {'error':>7}  (estimate: calibrated {gpu.upper()})")
    for name, rec in profile["graphs"].items():
        if name not in graphs:
            print(f"{name:26} not in the pack: not estimated")
            continue
        g, stem = graphs[name], name.split("/")[1]
        if [n.op for n in g.nodes] != [n["op"] for n in rec["nodes"]]:  # e.g. measured before an op joined the IR
            print(f"{name:26} the graph measured is not the one in the pack now (its ops differ): not estimated")
            continue
        out_of_fit = any(name.startswith(h) for h in holdout)
        cal = models["held" if out_of_fit else "full"]
        est[name] = (cal.graph_metrics(g).runtime_ms, sim.graph_metrics(g).runtime_ms,
                     sum(n["device_us"] for n in rec["nodes"]) / 1e3)
        e2e = statistics.median(rec["e2e_ms"])
        err = (est[name][0] - e2e) / e2e
        if stem == "original":
            group = ("held out" if out_of_fit else f"opset-{FUSED_OPSET}"
                     if name.split("/")[0].endswith(f"-o{FUSED_OPSET}") else "zoo")
            errs[group].append(abs(err))
        print(f"{name:26} {len(g.nodes):>5} {e2e:>8.3f} {est[name][0]:>8.3f} {100 * err:>6.1f}%"
              + ("  (held out)" if out_of_fit else ""))
    for k, v in errs.items():
        if v:
            print(f"mean |estimate - e2e| / e2e over the {len(v)} {k} originals: {100 * statistics.mean(v):.1f}%")
    print(f"\n{'searched graph':22} {'protocol ratio [95% CI]':>26} {'verdict':<26} {'calibrated':>10} "
          f"{'sim-h100':>8} {'kernels':>8}")
    agree = {"calibrated": 0, "sim-h100": 0, "kernels": 0}
    dist = {"calibrated": [], "sim-h100": [], "kernels": []}
    sig = 0
    for name, c in profile.get("comparisons", {}).items():
        o = name.split("/")[0] + "/original"
        if name.endswith("original-aa") or name not in est or o not in est:
            continue
        ratios = dict(zip(agree, (est[name][i] / est[o][i] for i in range(3))))
        for k, r in ratios.items():
            dist[k].append(abs(r - c["ratio"]))
        if c["verdict"] in ("faster", "slower"):
            sig += 1
            for k, r in ratios.items():
                agree[k] += (r < 1) == (c["verdict"] == "faster")
        print(f"{name:22} {c['ratio']:>8.3f} [{c['ci'][0]:.3f}, {c['ci'][1]:.3f}]   {c['verdict']:<26} "
              + " ".join(f"{ratios[k]:>{w}.3f}" for k, w in zip(agree, (10, 8, 8))))
    if dist["calibrated"]:
        print(f"sign of the {sig} significant changes: " + ", ".join(f"{k} {v} of {sig}" for k, v in agree.items()))
        print("mean |ratio - protocol ratio| over all searched graphs: "
              + ", ".join(f"{k} {statistics.mean(v):.3f}" for k, v in dist.items()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pack", type=Path, metavar="DIR", help="write the weightless graphs to DIR and stop")
    p.add_argument("--models", nargs="+", default=list(ZOO), help="zoo models to pack (default: all nine)")
    p.add_argument("--exported", type=Path, help="a folder of already exported <model>.onnx files (paper size)")
    p.add_argument("--no-heldout", action="store_true", help="pack no held-out transformers exports")
    p.add_argument("--no-fused", action="store_true",
                   help="pack no opset-23 folders (<model>-o23: the export and its attention-fused graph)")
    p.add_argument("--from", dest="packed", type=Path, metavar="DIR",
                   help="profile the graphs of a --pack folder; with --fit, the pack the profiles measured "
                        "(default .gpu/cal_pack)")
    p.add_argument("--only", nargs="+", help="profile only these folders of the pack")
    p.add_argument("--fit", type=Path, nargs="+", metavar="PROFILE",
                   help="fit a calibration file (--out) from recorded profiles (several of one GPU model are "
                        "pooled) and print how well it predicts each")
    p.add_argument("--gpu", default="h200", help="the calibrated GPU's name for --fit (default: h200)")
    p.add_argument("--holdout", nargs="*", default=["hf-"],
                   help="with --fit: graphs (name prefixes) estimated from a fit without them (default: hf-)")
    p.add_argument("--out", type=Path, default=Path("calibration.json"))
    p.add_argument("--runs", type=int, default=20, help="end-to-end and host-timed runs per graph (default: 20)")
    p.add_argument("--limit", type=float, help="seconds after which no further round of profiles is started")
    p.add_argument("--rounds", type=int, default=3, help="rounds of profiles over every graph (default: 3)")
    p.add_argument("--sessions", type=int, default=4, help="protocol sessions per comparison (0: none; default 4)")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timing per comparison (default: 1)")
    a = p.parse_args()
    if a.pack:
        make_pack(a.pack, a.models, not a.no_heldout, a.exported, not a.no_fused)
        return 0
    if a.fit:
        return fit_and_check(a.fit, a.out if a.out != Path("calibration.json") else None, a.gpu, a.holdout,
                             a.packed or ROOT / ".gpu/cal_pack")
    if not a.packed:
        p.error("give --pack DIR (here) or --from DIR (on the GPU box)")
    return measure(a.packed, a.out, a.sessions, a.budget, a.runs, a.only, a.limit, a.rounds)


if __name__ == "__main__":
    sys.exit(main())
