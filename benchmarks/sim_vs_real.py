"""Does a real GPU agree with the simulated H100? The pipeline's optimised graphs timed on the machine's device.

On a CPU-only box the pipeline optimises for ``sim-h100``, an analytic H100 (``cost.target: auto``). This benchmark
takes each model's original graph and each method's optimised graph -- the graph its trace reaches
(``results/<model>/{taso,greedy,model_free,controller}/trace.json``), before the never-slower check, which on a CPU
box writes the original wherever onnxruntime here is not faster -- and prints, per graph:

* ``search sim``: the sim-h100 ratio to the original that the method's search saw (on the IR: fused ops fused);
* ``sim-h100``: the same after the ONNX export that a user gets (a Conv+ReLU fusion exports as Conv, Relu again);
* ``--target`` (default ``cuda`` on a GPU, per-op CUDA events as TASO times ops; ``ort-cpu`` otherwise): the same;
* end to end on ``--backends`` (default ``torch``: the IR run op by op with torch on the device, and ``ort``,
  whose CUDA provider is used where the installed onnxruntime has one) under the measurement protocol
  (:mod:`rlflow.evaluation.protocol`: fresh sessions, interleaved randomised rounds, the latency ratio with its 95%
  interval and verdict). The reference is ``original-ir``: the original written through the IR's ONNX export, as
  every method's graph is (the export alone can change the latency); ``original`` is timed too, and the A/A control
  (a second such copy) must come out "same" for the comparison to be trusted.

Paper-size weights (bert: 436 MB) are too large to carry to a lent GPU machine, so ``--pack DIR`` writes weightless
copies: every float tensor of more than 64 values is emptied (structure, shapes and small constants kept); reading
a pack fills them with seeded N(0, 0.02) values. Kernel times do not depend on the values, but the outputs of the
original and an optimised graph then differ: output equality is the evaluate stage's check (CPU), not this one's.

  python benchmarks/sim_vs_real.py --pack gpu_pack                        # here: weightless copies of the results
  python benchmarks/sim_vs_real.py --pack gpu_pack --models bert vit --scale-folding   # + the hand-ordered folds
  python benchmarks/sim_vs_real.py --from gpu_pack --out /tmp/svr.json    # on the GPU box
  python benchmarks/sim_vs_real.py --models squeezenet --budget 4         # anywhere, from results/

Last line per model: ``<model>: sim-h100 says <k> of <n> graphs faster; <backend> end to end: <f> faster, <s> slower,
<d> no detectable difference (A/A: <verdict>)``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # scale_folding's sequence (--scale-folding)

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from rlflow.pipeline.registry import METHODS  # noqa: E402

#: method -> folder under results/<model>/ (the registry's METHODS less eqsat, whose graph has no rewrite steps)
FOLDERS = {m: folder for m, folder in METHODS.items() if m != "eqsat"}
#: float tensors of at most this many values travel with the pack (scalars, biases of tiny layers, shape data)
KEEP_VALUES = 64
STRIPPED = "rlflow:stripped"
#: the end-to-end reference: the original through the IR's ONNX export (what every method's graph goes through)
EXPORTED = "original-ir"


def _graphs_of(results: Path, model: str) -> list[tuple[str, Path]]:
    """The original and each method's trace.json (the optimised graph is rebuilt from it: see :func:`replay`)."""
    found = [("original", results / model / "model.onnx")]
    found += [(m, results / model / f / "trace.json") for m, f in FOLDERS.items()]
    return [(n, p) for n, p in found if p.is_file()]


def replay(original, trace: dict, rules: dict):
    """The graph ``trace``'s rewrites reach from ``original`` -- the method's graph before the never-slower check
    (on a CPU box that check keeps the original wherever onnxruntime here is not faster: results/<m>/<method>/model.onnx
    is then the original), constants folded. Each step is found by its rule and matched node names."""
    from rlflow.errors import RLFlowError
    from rlflow.rewrite.matcher import apply, find_matches
    from rlflow.graph.fold import fold_constants

    g = original
    for i, step in enumerate(trace["steps"]):
        m = [m for m in find_matches(g, rules[step["rule_id"]]) if list(m.nodes) == step["nodes"]]
        if not m:
            raise RLFlowError(f"step {i} ({step['rule_name']} at {step['nodes']}): no such match to replay")
        g = apply(g, m[0])
    g = fold_constants(g)  # weight-only nodes folded, as every method writes its graph
    if len(g.nodes) != trace["final"]["nodes"]:
        raise RLFlowError(f"replay reached {len(g.nodes)} nodes, the trace says {trace['final']['nodes']}")
    return g


def _strip(m: onnx.ModelProto) -> onnx.ModelProto:
    for t in m.graph.initializer:
        if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) and int(np.prod(t.dims)) > KEEP_VALUES:
            t.ClearField("raw_data")
            t.ClearField("float_data")
            t.doc_string = STRIPPED
    return m


def _scale_folded(original, rules_path: Path):
    """``scalefold``: the hand-ordered scale moves of ``benchmarks/scale_folding.py``, then greedy, on sim-h100 (the
    rule set's reach on a transformer; no method's result): (graph, its entry in costs.json)."""
    from rlflow.config import load_config
    from rlflow.cost import make_cost_model
    from rlflow.rewrite.rule import load_rules
    from scale_folding import fold_scales

    sim = make_cost_model(load_config([ROOT / "config.yaml"]), "cpu", kind="sim-h100")
    g, metrics, moved, trace = fold_scales(original, load_rules(rules_path), sim, log=None)
    return g, {"initial_ms": sim.graph_metrics(original).runtime_ms, "final_ms": metrics.runtime_ms,
               "cost_model": "sim-h100", "steps": moved + len(trace), "scale_moves": moved}


def pack(results: Path, models: list[str], out: Path, scalefold: bool = False) -> None:
    """Weightless copies into ``out/<model>/``: ``original.onnx`` and, per method, the graph its trace reaches
    (saved through the IR's ONNX export, as `rlflow optimize` writes it), with ``costs.json``: the sim-h100
    estimate the search saw (the trace's ``final``, on the IR: fused ops still fused). With ``scalefold``, also
    :func:`_scale_folded`'s graph where the model has scales to fold."""
    from rlflow.graph import load_onnx
    from rlflow.rewrite.rule import load_rules

    for model in models:
        found = _graphs_of(results, model)
        if not found or found[0][0] != "original":
            print(f"{model}: no {results / model / 'model.onnx'}, skipped")
            continue
        (out / model).mkdir(parents=True, exist_ok=True)
        original = load_onnx(found[0][1])
        onnx.save(_strip(onnx.load(str(found[0][1]))), str(out / model / "original.onnx"))
        searched = {}
        for name, path in found[1:]:
            trace = json.loads(path.read_text())
            rules = {r.id: r for r in load_rules(ROOT / trace["rules"])}
            g = replay(original, trace, rules)
            _write_stripped(g, out / model / f"{name}.onnx")
            searched[name] = {"initial_ms": trace["initial"]["runtime_ms"], "final_ms": trace["final"]["runtime_ms"],
                              "cost_model": trace.get("cost_model"), "steps": len(trace["steps"])}
            print(f"packed {model}/{name}: {len(trace['steps'])} rewrites replayed, {len(g.nodes)} nodes", flush=True)
        if scalefold:
            g, searched["scalefold"] = _scale_folded(original, results / "rules" / "rules.json")
            if searched["scalefold"]["scale_moves"]:  # a model with no scale to fold (a CNN): greedy's graph, left out
                _write_stripped(g, out / model / "scalefold.onnx")
                print(f"packed {model}/scalefold: {searched['scalefold']['steps']} rewrites, {len(g.nodes)} nodes")
            else:
                del searched["scalefold"]
        (out / model / "costs.json").write_text(json.dumps(searched, indent=1))


def _write_stripped(g, path: Path) -> None:
    """``g`` through the IR's ONNX export, its large float tensors emptied (:func:`_strip`), at ``path``."""
    from rlflow.graph.onnx_io import save_onnx

    with tempfile.TemporaryDirectory() as tmp:
        save_onnx(g, Path(tmp) / "g.onnx", check=False)
        onnx.save(_strip(onnx.load(str(Path(tmp) / "g.onnx"))), str(path))


def unpack(path: Path, tmp: Path, seed: int) -> Path:
    """A packed graph with its emptied tensors filled (seeded by the tensor's name), written under ``tmp``."""
    m = onnx.load(str(path))
    for t in m.graph.initializer:
        if t.doc_string == STRIPPED:
            rng = np.random.default_rng([seed, *t.name.encode()])
            dtype = np.float16 if t.data_type == onnx.TensorProto.FLOAT16 else np.float32
            t.raw_data = (rng.standard_normal(tuple(t.dims)) * 0.02).astype(dtype).tobytes()
            t.doc_string = ""
    out = tmp / f"{path.parent.name}-{path.stem}.onnx"
    onnx.save(m, str(out))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["bert", "vit", "resnet18", "resnet50", "squeezenet",
                                                   "inceptionv3", "resnext50"])
    p.add_argument("--results", type=Path, default=ROOT / "results", help="where the graphs are (default: results/)")
    p.add_argument("--pack", type=Path, metavar="DIR", help="write weightless copies to DIR and stop")
    p.add_argument("--from", dest="packed", type=Path, metavar="DIR",
                   help="read graphs from a --pack folder (default: pack results/ into a temporary one first)")
    p.add_argument("--scale-folding", action="store_true",
                   help="also time 'scalefold': benchmarks/scale_folding.py's hand-ordered scale moves, then greedy "
                        "(what the rule set reaches on bert and vit; no method's graph)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--target", help="the measured cost target beside sim-h100 (default: cuda on a GPU, else ort-cpu)")
    p.add_argument("--backends", nargs="+", default=["torch", "ort"])
    p.add_argument("--budget", type=float, default=10.0, help="seconds of timing per comparison (default: 10)")
    p.add_argument("--sessions", type=int, default=6, help="fresh sessions per graph (default: 6)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    a = p.parse_args()

    if a.pack:
        pack(a.results, a.models, a.pack, a.scale_folding)
        return 0

    from rlflow.config import load_config, resolve_device
    from rlflow.cost import make_cost_model
    from rlflow.cost.model import describe_hardware
    from rlflow.evaluation import protocol as proto
    from rlflow.evaluation.runs import runner_device
    from rlflow.graph import load_onnx
    from rlflow.graph.exec import get_runner, make_inputs

    config = load_config([ROOT / "config.yaml"], [f"device={a.device}"])
    device = resolve_device(config)
    target = a.target or ("cuda" if device == "cuda" else "ort-cpu")
    sim = make_cost_model(config, "cpu", kind="sim-h100")
    real = make_cost_model(config, device, kind=target)
    protocol = proto.Protocol(sessions=a.sessions, budget_s=a.budget, seed=a.seed)
    print(f"device {device}: {describe_hardware(device)}; cost target {target}; backends {', '.join(a.backends)}; "
          f"{protocol.describe()}", flush=True)
    report: dict = {"device": device, "hardware": describe_hardware(device), "target": target,
                    "protocol": protocol.describe(), "models": {}}
    with tempfile.TemporaryDirectory(prefix="sim-vs-real-") as tmp:
        packed = a.packed
        if packed is None:
            packed = Path(tmp) / "pack"
            pack(a.results, a.models, packed, a.scale_folding)
        for model in a.models:
            files = sorted((packed / model).glob("*.onnx"), key=lambda f: (f.stem != "original", f.stem))
            if not files or files[0].stem != "original":
                print(f"{model}: no original graph in {packed / model}, skipped")
                continue
            searched = json.loads((packed / model / "costs.json").read_text())
            paths = [(f.stem, unpack(f, Path(tmp), a.seed)) for f in files]
            t0 = time.perf_counter()
            graphs = [(n, load_onnx(path)) for n, path in paths]
            if hasattr(real, "measure"):
                real.measure([g for _, g in graphs])
            rows = {n: {"sim_ms": sim.graph_metrics(g).runtime_ms, f"{target}_ms": real.graph_metrics(g).runtime_ms}
                    for n, g in graphs}
            feeds = make_inputs(graphs[0][1], a.seed)
            # the reference is the original written through the IR's ONNX export, as every method's graph is (the
            # export alone can change the latency a little); a second such copy is the A/A control
            exported = proto.aa_copy(graphs[0][1])
            timed = [(EXPORTED, exported), *graphs, (proto.AA, proto.aa_copy(graphs[0][1]))]
            for backend in a.backends:
                cmp = proto.compare(timed, feeds, protocol, lambda g, b=backend: get_runner(g, b, device))
                ran_on = runner_device(get_runner(exported, backend, device))[0]
                for n, _ in timed:
                    e = cmp[n]
                    rows.setdefault(n, {})[backend] = {"ran_on": ran_on, "latency_ms": e.latency_ms,
                                                        "ratio": e.ratio, "ci": [e.ci_low, e.ci_high],
                                                        "verdict": e.verdict}
            rows = {EXPORTED: rows.pop(EXPORTED), **rows}
            base = rows["original"]
            for n, r in rows.items():
                if n in searched:
                    r["search_sim_ratio"] = searched[n]["final_ms"] / searched[n]["initial_ms"]
            short = {proto.FASTER: "faster", proto.SLOWER: "slower", proto.SAME: "same", proto.REFERENCE: ""}
            print(f"\n{model} ({time.perf_counter() - t0:.0f} s); ratios: the graph's estimate / the original's, and "
                  f"the graph's latency / {EXPORTED}'s (< 1: faster)")
            head = f"{'graph':<12} {'search sim':>10} {'sim-h100':>8} {target:>8}"
            for b in a.backends:
                head += f" | {b + ' ms (' + base[b]['ran_on'] + ')':>15} {'ratio [95% CI]':>21} {'verdict':<7}"
            print(head)
            for n, r in rows.items():
                line = f"{n:<12} " + (f"{r.get('search_sim_ratio', 1.0):>10.3f} " if "sim_ms" in r else " " * 11)
                line += (f"{r['sim_ms'] / base['sim_ms']:>8.3f} {r[f'{target}_ms'] / base[f'{target}_ms']:>8.3f}"
                         if "sim_ms" in r else " " * 17)
                for b in a.backends:
                    e = r[b]
                    ci = f"{e['latency_ms']:.3f} ms" if e["verdict"] == proto.REFERENCE else \
                        f"{e['ratio']:.3f} [{e['ci'][0]:.3f}, {e['ci'][1]:.3f}]"
                    line += f" | {e['latency_ms']:>15.3f} {ci:>21} {short[e['verdict']]:<7}"
                print(line)
            print(f"(search sim: the sim-h100 ratio the method's search saw, fused ops fused; sim-h100 and {target}: "
                  f"the same graphs after the ONNX export that a user gets)")
            methods = [n for n in rows if n not in ("original", EXPORTED, proto.AA)]
            sim_faster = sum(rows[n]["sim_ms"] < base["sim_ms"] for n in methods)
            for b in a.backends:
                v = [rows[n][b]["verdict"] for n in methods]
                print(f"{model}: sim-h100 says {sim_faster} of {len(methods)} graphs faster; {b} end to end: "
                      f"{v.count(proto.FASTER)} faster, {v.count(proto.SLOWER)} slower, {v.count(proto.SAME)} no "
                      f"detectable difference (A/A: {rows[proto.AA][b]['verdict']})", flush=True)
            report["models"][model] = rows
            graphs = None
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
