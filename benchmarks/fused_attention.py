"""How many attention blocks the fused-kernel rules fuse on the zoo's transformers, and whether the outputs stay
equal (issue N item 2).

For each model (zoo export at the given size, opset 18 as exported): its opset raised to 23 (what ``rlflow
optimize --opset 23`` does: :func:`rlflow.graph.fold.at_opset`, which writes GPT-2's multiplicative causal mask
as an additive one), greedy search with the shipped rule set plus :func:`rlflow.rewrite.builtin.
fused_kernel_rules` (verified) on the cost target, the result's constants folded; then the number of ``Attention``
ops before and after, the ops removed, and the largest relative output difference against the original on
onnxruntime (its own Attention kernel) and torch (SDPA), random inputs. With ``--opset 18`` the same search must
fuse nothing (the rules' ``min_opset``).

  python benchmarks/fused_attention.py --size tiny --target torch-eager
  python benchmarks/fused_attention.py --size paper --models bert vit gpt2 --target torch-eager

The last lines are ``fused_attention <model> <size>: ...``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import Counter


def run(model: str, size: str, target: str, opset: int, rules) -> str:
    from rlflow.config import load_config
    from rlflow.cost.targets import make_cost_model
    from rlflow.graph import load_onnx
    from rlflow.graph.fold import at_opset
    from rlflow.graph.exec import get_runner, max_rel_diff
    from rlflow.graph.exec.check import check_equal, make_inputs
    from rlflow.graph.zoo import TINY_SIZES, export_model
    from rlflow.search.common import finish
    from rlflow.search.greedy import greedy_search

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"{model}.onnx")
        export_model(model, path, TINY_SIZES[model] if size == "tiny" else None)
        graph = load_onnx(path)  # as the file says; the search starts from it at the opset asked for
    cost = make_cost_model(load_config(None, []), "cpu", kind=target)
    t0 = time.perf_counter()
    found = greedy_search(at_opset(graph, opset), rules, cost)
    out, _ = finish(found.graph, cost)
    seconds = time.perf_counter() - t0
    before, after = Counter(n.op for n in graph.nodes), Counter(n.op for n in out.nodes)
    ort = check_equal(graph, out, tol=1e-4)
    feeds = make_inputs(graph, 0)
    torch_diff = max_rel_diff(get_runner(graph, "torch")(feeds), get_runner(out, "torch")(feeds))
    fused = sum(s.rule_name == "attention-fuse" for s in found.trace)
    removed = {op: before[op] - after[op] for op in sorted(before | after) if before[op] != after[op]}
    return (f"fused_attention {model} {size}: opset {opset}, {before['Softmax']} attention blocks, "
            f"{after['Attention']} Attention ops after greedy on {target} ({fused} fuse steps, "
            f"{len(found.trace)} steps, {seconds:.0f} s), nodes {len(graph.nodes)} -> {len(out.nodes)} "
            f"(op count changes {removed}), max rel diff ort {ort:.2e} torch {torch_diff:.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["bert", "vit", "gpt2"])
    p.add_argument("--size", choices=("tiny", "paper"), default="tiny")
    p.add_argument("--target", default="torch-eager")
    p.add_argument("--opset", type=int, default=23)
    args = p.parse_args()
    from rlflow.rewrite.builtin import verified_builtin_rules
    from rlflow.rewrite.rule import load_rules

    fused = [r for r in verified_builtin_rules(fused_kernels=True) if r.name.startswith("attention-")]
    rules = load_rules() + fused
    print(f"{len(rules)} rules ({len(fused)} fused-kernel); load average {os.getloadavg()}")
    lines = [run(m, args.size, args.target, args.opset, rules) for m in args.models]
    print(f"load average {os.getloadavg()}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
