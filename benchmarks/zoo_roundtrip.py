"""Zoo round trip and backend latency: for each zoo model, export it from torch (dynamo exporter), import it into
the IR, export it back, and run it on every backend.

Prints, per model: ONNX node count of the torch export, IR node count, import and export seconds (IR), whether the
round trip keeps onnxruntime's outputs (max relative difference), and the median latency on ort / torch / tf /
tf-xla with each backend's max relative output difference from onnxruntime on the original file.

Each backend runs in its own process (``rlflow run --json --compare``): TensorFlow's and torch's thread pools
slow each other down when they share one.

  python benchmarks/zoo_roundtrip.py                 # every model, default (paper) sizes: ~15 min on 2 cores
  python benchmarks/zoo_roundtrip.py --tiny          # tiny sizes, a quick check
  python benchmarks/zoo_roundtrip.py --models bert resnet18 --repeats 20
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from rlflow.graph import load_onnx, save_onnx, zoo  # noqa: E402
from rlflow.graph.exec import BACKENDS, make_inputs, max_rel_diff  # noqa: E402


def run_backend(path: Path, backend: str, repeats: int, warmup: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, "-m", "rlflow.cli", "run", str(path), "--backend", backend, "--repeats", str(repeats),
           "--warmup", str(warmup), "--device", "cpu", "--json", "--compare"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1], "wall_s": time.perf_counter() - t0}
    out = json.loads(proc.stdout)
    out["wall_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(zoo.MODEL_NAMES), choices=zoo.MODEL_NAMES)
    ap.add_argument("--tiny", action="store_true", help="tiny sizes instead of the paper's")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    args = ap.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            src, out = Path(tmp) / f"{name}.onnx", Path(tmp) / f"{name}.rt.onnx"
            t0 = time.perf_counter()
            zoo.export_model(name, src, zoo.TINY_SIZES[name] if args.tiny else None)
            t_torch = time.perf_counter() - t0
            t0 = time.perf_counter()
            g = load_onnx(src)
            t_import = time.perf_counter() - t0
            t0 = time.perf_counter()
            save_onnx(g, out)
            t_export = time.perf_counter() - t0
            onnx.checker.check_model(str(out), full_check=True)
            feeds = make_inputs(g)
            rt_diff = max_rel_diff(ort.InferenceSession(str(src)).run(None, feeds),
                                   ort.InferenceSession(str(out)).run(None, feeds))
            row = {"model": name, "onnx_nodes": len(onnx.load(str(src), load_external_data=False).graph.node),
                   "ir_nodes": len(g.nodes), "opaque": len(g.opaque_nodes()), "torch_export_s": t_torch,
                   "import_s": t_import, "export_s": t_export, "roundtrip_diff": rt_diff, "backends": {}}
            del g
            for b in args.backends:
                row["backends"][b] = run_backend(src, b, args.repeats, args.warmup)
            rows.append(row)
            print(json.dumps(row), flush=True)
            src.unlink()
            out.unlink()

    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, "
          f"sizes: {'tiny' if args.tiny else 'default (paper)'}, repeats {args.repeats}, warm-up {args.warmup}")
    head = f"{'model':<12}{'nodes':>7}{'IR':>6}{'import s':>10}{'export s':>10}{'rt diff':>9}"
    head += "".join(f"{b + ' ms':>12}" for b in args.backends) + f"{'max diff':>10}"
    print(head)
    for r in rows:
        line = (f"{r['model']:<12}{r['onnx_nodes']:>7}{r['ir_nodes']:>6}{r['import_s']:>10.2f}{r['export_s']:>10.2f}"
                f"{r['roundtrip_diff']:>9.1e}")
        diffs = []
        for b in args.backends:
            res = r["backends"][b]
            if "error" in res:
                line += f"{'error':>12}"
            else:
                line += f"{res['median_ms']:>12.2f}"
                diffs.append(res["max_rel_diff_vs_ort_original"])
        line += f"{max(diffs) if diffs else float('nan'):>10.1e}"
        print(line)
    for r in rows:
        for b, res in r["backends"].items():
            if "error" in res:
                print(f"{r['model']} on {b}: {res['error']}")
    worst = max((res.get("max_rel_diff_vs_ort_original", float("inf")) for r in rows for res in r["backends"].values()),
                default=float("nan"))
    print(f"all_backends_agree={worst <= 1e-4} max_rel_diff={worst:.2e}")
    bert = [r for r in rows if r["model"] == "bert"]
    if bert:
        print(f"bert_import_plus_export_s={bert[0]['import_s'] + bert[0]['export_s']:.2f}")


if __name__ == "__main__":
    main()
