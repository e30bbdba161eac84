"""What a pipeline stage pays before it works: the wall time of a fresh interpreter importing a set of modules.

Every stage is its own process (Snakemake and DVC run one command per job), so its imports are paid once per job:
about 25 jobs for one model in `make run`. Two import sets are timed against each other in interleaved, randomly
ordered pairs, ``--sessions`` groups of ``--rounds`` pairs, and the ratio B / A is printed with its 95% interval
(rlflow.evaluation.protocol.ratio_interval: paired by round, Student's t over the sessions).

The default compares what an agent stage imports for its graph network now (``rlflow.nn.encoder``, plain torch)
with the same plus PyTorch Geometric, which the encoder used before (PyG stays installed as a test requirement):

  python benchmarks/stage_startup.py
  python benchmarks/stage_startup.py --a torch --b "torch pandas" --sessions 3 --rounds 5

CPU timings need a quiet machine: the load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src")]

from rlflow.evaluation.protocol import ratio_interval, verdict  # noqa: E402


def import_seconds(modules: list[str]) -> float:
    """Wall seconds of ``python -c "import M1, M2, ..."`` in a fresh interpreter (this one's)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import " + ", ".join(modules)], check=True)
    return time.perf_counter() - t0


def interleaved(run: dict[str, Callable[[], float]], sessions: int, rounds: int, seed: int) -> None:
    """Time ``run["A"]`` and ``run["B"]`` (each returns the seconds it took) in ``sessions`` groups of ``rounds``
    pairs, each pair in a random order; print each session's medians, then B / A with its 95% interval and
    verdict, and the load average at the end."""
    rng = random.Random(seed)
    times: dict[str, list[list[float]]] = {"A": [], "B": []}
    for s in range(sessions):
        for k in times:
            times[k].append([])
        for _ in range(rounds):
            order = ["A", "B"]
            rng.shuffle(order)
            for k in order:
                times[k][-1].append(run[k]())
        print(f"session {s + 1}: A {sorted(times['A'][-1])[len(times['A'][-1]) // 2]:.2f} s, "
              f"B {sorted(times['B'][-1])[len(times['B'][-1]) // 2]:.2f} s (medians)", flush=True)
    ratio, lo, hi, _ = ratio_interval(times["A"], times["B"])
    flat = {k: sorted(t for s in v for t in s) for k, v in times.items()}
    print(f"A: median {flat['A'][len(flat['A']) // 2]:.2f} s; B: median {flat['B'][len(flat['B']) // 2]:.2f} s")
    print(f"B / A = {ratio:.2f} [{lo:.2f}, {hi:.2f}] (95%, {sessions} sessions x {rounds} pairs): "
          f"{verdict(lo, hi)} (B against A)")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", default="rlflow.nn.encoder", help="modules of set A, space-separated (the reference)")
    ap.add_argument("--b", default="torch_geometric rlflow.nn.encoder", help="modules of set B, space-separated")
    ap.add_argument("--sessions", type=int, default=3, help="groups of pairs (>= 2)")
    ap.add_argument("--rounds", type=int, default=4, help="pairs per session (>= 1)")
    ap.add_argument("--seed", type=int, default=0, help="the pairs' order")
    args = ap.parse_args(argv)
    if args.sessions < 2 or args.rounds < 1:
        ap.error("need --sessions >= 2 and --rounds >= 1")
    sets = {"A": args.a.split(), "B": args.b.split()}
    for name, mods in sets.items():  # a module that does not import is one line, not a traceback
        r = subprocess.run([sys.executable, "-c", "import " + ", ".join(mods)], capture_output=True, text=True)
        if r.returncode:
            print(f"stage_startup: set {name} ({' '.join(mods)}) does not import: "
                  f"{(r.stderr.strip().splitlines() or ['?'])[-1]}", file=sys.stderr)
            return 2
    print(f"load average at start: {os.getloadavg()[0]:.2f}; A = {' '.join(sets['A'])}; B = {' '.join(sets['B'])}",
          flush=True)
    interleaved({k: (lambda mods=mods: import_seconds(mods)) for k, mods in sets.items()}, args.sessions,
                args.rounds, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
