"""One `rlflow` command under two source trees: the wall time of the code before a change (A) against after (B).

Each run is a fresh `python -m rlflow.cli ARGS` whose `src/` is the tree's (PYTHONPATH: it comes before the
installed package), in a temporary folder of its own (an --out given as OUT is put there). The runs are timed in
interleaved, randomly ordered pairs, ``--sessions`` groups of ``--rounds`` pairs, and B / A is printed with its
95% interval (rlflow.evaluation.protocol.ratio_interval, as benchmarks/stage_startup.py does). Both trees must
write the same files: their outputs are compared byte for byte after the first pair (a speed-up that changes the
result is not one).

  git worktree add /tmp/before HEAD~1
  python benchmarks/source_trees.py --a /tmp/before --sessions 3 --rounds 2 -- \\
      generate-rules --config config.yaml --config tests/configs/tiny.yaml --out OUT/rules.json --no-progress

Config paths are read from this repository (the command runs with it as the working folder). CPU timings need a
quiet machine: the load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent)]

from stage_startup import interleaved  # noqa: E402


def run_seconds(tree: Path, args: list[str], out: Path) -> float:
    """Wall seconds of ``python -m rlflow.cli ARGS`` with ``tree``'s src first on the path and OUT as ``out``."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    argv = [sys.executable, "-m", "rlflow.cli", *(a.replace("OUT", str(out)) for a in args)]
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"source_trees: {tree}: the command failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return seconds


def same_files(a: Path, b: Path, ignore: set[str]) -> list[str]:
    """The files that differ between folders ``a`` and ``b`` (or are in one only), names in ``ignore`` aside."""
    cmp = filecmp.dircmp(a, b, ignore=sorted(ignore))
    differ = [*cmp.left_only, *cmp.right_only, *filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)[1]]
    return differ + [f for d in cmp.common_dirs for f in same_files(a / d, b / d, ignore)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s --a TREE [--b TREE] [options] -- RLFLOW-ARGS...")
    ap.add_argument("--a", type=Path, required=True, help="the reference source tree (a worktree of the old code)")
    ap.add_argument("--b", type=Path, default=ROOT, help="the other tree (default: this one)")
    ap.add_argument("--sessions", type=int, default=3, help="groups of pairs (>= 2)")
    ap.add_argument("--rounds", type=int, default=2, help="pairs per session (>= 1)")
    ap.add_argument("--seed", type=int, default=0, help="the pairs' order")
    ap.add_argument("--ignore", nargs="*", default=["stats.json"],
                    help="output files whose bytes may differ (they record seconds); default: stats.json")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the rlflow command's arguments, after --")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.sessions < 2 or args.rounds < 1 or not command:
        ap.error("need --sessions >= 2, --rounds >= 1 and an rlflow command after --")
    for tree in (args.a, args.b):
        if not (tree / "src" / "rlflow" / "cli.py").is_file():
            ap.error(f"{tree} is not a source tree of rlflow (no src/rlflow/cli.py)")
    with tempfile.TemporaryDirectory(prefix="source_trees-") as tmp:
        outs = {"A": Path(tmp) / "A", "B": Path(tmp) / "B"}
        trees = {"A": args.a, "B": args.b}
        for k in "AB":  # the first pair, untimed: both run and must agree
            run_seconds(trees[k], command, outs[k])
        differ = same_files(outs["A"], outs["B"], set(args.ignore))
        if differ:
            print(f"source_trees: the trees write different files: {', '.join(sorted(differ))}", file=sys.stderr)
            return 1
        print(f"load average at start: {os.getloadavg()[0]:.2f}; A = {args.a}; B = {args.b}; the outputs are the "
              f"same (byte for byte, {', '.join(args.ignore) or 'nothing'} aside)", flush=True)
        interleaved({k: (lambda k=k: run_seconds(trees[k], command, outs[k])) for k in "AB"}, args.sessions,
                    args.rounds, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
