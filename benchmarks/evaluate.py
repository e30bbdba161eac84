"""How long the evaluate stage takes on a model's pipeline artifacts, and what it measures.

Runs ``rlflow evaluate`` (in this process) on results/<model>/ -- the original ONNX and each method's optimised ONNX
and trace -- writing into a scratch folder, never into results/. A method whose artifacts do not exist yet is
stood in for by greedy's (say so in anything you quote: those rows then time greedy's graph again).

  python benchmarks/evaluate.py                       # bert, config.yaml (timing.budget_s 12 per backend, 4 backends)
  python benchmarks/evaluate.py --model resnet50 --set timing.budget_s=5 --set 'evaluate.backends=[ort,tf]'

Last lines: the table the stage prints (per backend: median latency in ms, ratio to the original with its 95%
interval and verdict, the A/A control included), then the seconds it took in all.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> int:
    from rlflow.cli import main as rlflow
    from rlflow.pipeline.registry import METHODS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bert")
    p.add_argument("--config", default=str(ROOT / "config.yaml"))
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=Path, help="scratch folder for the outputs (default: a temporary one)")
    a = p.parse_args()
    res = ROOT / "results" / a.model
    if not (res / "model.onnx").is_file():
        print(f"no {res / 'model.onnx'}: run `snakemake {res / 'model.onnx'}` (and the searches) first")
        return 2
    out = a.out or Path(tempfile.mkdtemp(prefix=f"evaluate-{a.model}-"))
    argv = ["evaluate", "--config", a.config, "--model", a.model, "--onnx", str(res / "model.onnx")]
    stand_ins = []
    for m, folder in METHODS.items():
        src = res / folder
        if not (src / "model.onnx").is_file() or not (src / "trace.json").is_file():
            src = res / "greedy"
            if not (src / "model.onnx").is_file():
                continue
            stand_ins.append(m)
        flag = "--" + m.replace("_", "-")
        argv += [flag, str(src / "model.onnx"), flag + "-trace", str(src / "trace.json")]
    argv += ["--out", str(out / "evaluation.csv"), "--metrics", str(out / "metrics.json"),
             "--headline", str(out / "summary" / f"{a.model}.json")]
    for s in a.sets:
        argv += ["--set", s]
    if stand_ins:
        print(f"stand-ins: {', '.join(stand_ins)} use greedy's graph and trace (their artifacts do not exist yet)")
    t0 = time.perf_counter()
    code = rlflow(argv)
    print(f"evaluate on {a.model}: exit status {code}, {time.perf_counter() - t0:.1f} s in all; outputs in {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
