"""The HLO suite: many modules from the zoo and its variants, split into training and held-out sets by family.

The pass-ordering paper trains on a suite of GPT-2 training graphs and tests on 300+ graphs of other families.
Here each family (a zoo model) gets one module per size variant (overrides of its ``zoo.<family>`` sizes: depth,
width, sequence or image size, batch) and per form: ``inference`` (the forward pass, as export_hlo lowers it) and
``training`` (forward and backward: ``jax.grad`` of a scalar loss, the mean square of every float output, with
respect to every weight, the weights passed as parameters). A family is in exactly one split, so a held-out
module never shares a family with a training one.

The manifest (``rlflow.xla-suite/1``) names the families of each split, the module counts per split and family,
and each module: name, family, split, form, sizes, op count and its file, relative to the manifest's folder.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlflow.errors import RLFlowError

FORMS = ("inference", "training")
SPLITS = ("train", "heldout")
MANIFEST_FORMAT = "rlflow.xla-suite/1"


@dataclass(frozen=True)
class SuiteModule:
    """One module of the suite, before it is exported."""

    family: str
    split: str
    form: str
    overrides: tuple[tuple[str, object], ...]

    @property
    def name(self) -> str:
        sizes = "-".join(f"{k}{v}" for k, v in self.overrides) or "base"
        return f"{self.family}-{sizes}-{self.form}"


def plan(suite: dict) -> list[SuiteModule]:
    """The modules ``suite`` (config ``xla.suite``) asks for, in split, family, variant, form order. A family in
    both splits, an unknown family or form: a one-line error. Variants of a family in neither split are left
    out (a config merged over another can name fewer families)."""
    from rlflow.graph import zoo

    families = {s: list(suite.get(f"{s}_families") or []) for s in SPLITS}
    both = set(families["train"]) & set(families["heldout"])
    if both:
        raise RLFlowError(f"xla.suite: family {sorted(both)[0]!r} is in both train_families and heldout_families")
    if not families["train"] or not families["heldout"]:
        raise RLFlowError("xla.suite: train_families and heldout_families must each name at least one family")
    for name in families["train"] + families["heldout"]:
        if name not in zoo.MODEL_NAMES:
            raise RLFlowError(f"xla.suite: unknown zoo family {name!r} (known: {', '.join(zoo.MODEL_NAMES)})")
    forms = list(suite.get("forms") or FORMS)
    for form in forms:
        if form not in FORMS:
            raise RLFlowError(f"xla.suite: unknown form {form!r} (known: {', '.join(FORMS)})")
    variants = dict(suite.get("variants") or {})  # variants of a family in neither split are not exported
    out = []
    for split in SPLITS:
        for family in families[split]:
            for v in variants.get(family) or [{}]:
                for form in forms:
                    out.append(SuiteModule(family, split, form, tuple(sorted(dict(v).items()))))
    names = [m.name for m in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise RLFlowError(f"xla.suite.variants: module {dup} twice (the same family variant listed twice)")
    return out


def training_function(fn, n_inputs: int, n_params: int, J):
    """``jax.grad`` of the mean square of ``fn``'s float outputs with respect to its weight arguments (the last
    ``n_params`` arguments): the forward and backward pass, as a training step computes them."""
    import jax

    def loss(*args):
        outs = [o for o in fn(*args) if J.jnp.issubdtype(o.dtype, J.jnp.floating)]
        if not outs:
            raise RLFlowError("training form: the model has no float output to differentiate")
        return sum(J.jnp.mean(J.jnp.square(o.astype(J.jnp.float32))) for o in outs)

    return jax.grad(loss, argnums=tuple(range(n_inputs, n_inputs + n_params)))


def module_text(graph, form: str) -> str:
    """The unoptimised HLO module of ``graph`` in ``form`` (weights as parameters)."""
    from rlflow.graph.exec import jax_exec

    if form == "inference":
        return jax_exec.hlo_text(graph, "parameters")
    reason = jax_exec.unsupported_reason(graph)
    if reason:
        raise RLFlowError(reason)
    jax, J = jax_exec._jax()
    params = jax_exec.weight_parameters(graph)
    if not params:
        raise RLFlowError(f"training form of {graph.name or 'graph'}: no weight to differentiate")
    fn = jax_exec.graph_function(graph, J, params)
    grad = training_function(fn, len(graph.inputs), len(params), J)
    specs = jax_exec._specs(jax, graph, (*graph.inputs, *params))
    try:
        return jax.jit(grad).lower(*specs).compiler_ir("hlo").as_hlo_text()
    except (TypeError, ValueError) as exc:  # JAX cannot differentiate (or transpose) an op at these shapes
        raise RLFlowError(f"training form of {graph.name or 'graph'}: jax.grad failed: "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")


def export_suite(suite: dict, zoo_sizes: dict, folder: Path, seed: int = 0, log=print) -> dict:
    """Export every module of ``suite`` under ``folder/<split>/<name>.hlo``; returns the manifest (module paths
    relative to ``folder``'s parent, where the manifest goes). ``zoo_sizes``: config ``zoo`` (each family's
    sizes, the variants override them)."""
    import time

    from rlflow.atomic import write_text
    from rlflow.graph import zoo
    from rlflow.graph.onnx_io import load_onnx
    from rlflow.xla.hlo import histogram, parse

    modules = plan(suite)
    folder = Path(folder)
    graphs: dict[tuple, object] = {}  # (family, overrides) -> the imported graph (both forms share it)
    entries = []
    with tempfile.TemporaryDirectory(prefix="rlflow-suite-") as tmp:
        for m in modules:
            t0 = time.perf_counter()
            key = (m.family, m.overrides)
            if key not in graphs:
                sizes = {**dict(zoo_sizes.get(m.family) or {}), **dict(m.overrides)}
                onnx_path = Path(tmp) / f"{m.family}.onnx"
                zoo.export_model(m.family, onnx_path, sizes, seed=seed)
                graphs.clear()  # one graph at a time: the variants of a family follow each other
                graphs[key] = (load_onnx(onnx_path), zoo.resolve_sizes(m.family, sizes))
            graph, sizes = graphs[key]
            try:
                text = module_text(graph, m.form)
            except RLFlowError as exc:
                raise RLFlowError(f"xla.suite: {m.name}: {exc}")
            path = folder / m.split / f"{m.name}.hlo"
            write_text(path, text)
            ops = sum(histogram(parse(text, m.name)).values())
            entries.append({"name": m.name, "family": m.family, "split": m.split, "form": m.form,
                            "sizes": sizes, "ops": ops, "path": str(path.relative_to(folder.parent))})
            log(f"{m.split} {m.name}: {ops} HLO ops, {len(text) / 1e6:.2f} MB, {time.perf_counter() - t0:.1f} s")
    return manifest(suite, entries)


def manifest(suite: dict, entries: list[dict]) -> dict:
    counts = {s: {f: sum(1 for e in entries if e["split"] == s and e["family"] == f)
                  for f in suite[f"{s}_families"]} for s in SPLITS}
    return {"format": MANIFEST_FORMAT, "families": {s: list(suite[f"{s}_families"]) for s in SPLITS},
            "forms": list(suite.get("forms") or FORMS), "counts": counts,
            "totals": {s: sum(counts[s].values()) for s in SPLITS}, "modules": entries}


def load_manifest(path: str | Path) -> dict:
    """The suite manifest at ``path``, checked: its format and every module file present (one-line errors)."""
    import json

    path = Path(path)
    if not path.is_file():
        raise RLFlowError(f"{path}: no HLO suite manifest (stage export_hlo_suite)")
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise RLFlowError(f"{path}: not JSON ({exc})")
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise RLFlowError(f"{path}: not an HLO suite manifest (format {MANIFEST_FORMAT})")
    for e in doc["modules"]:
        if not (path.parent / e["path"]).is_file():
            raise RLFlowError(f"{path}: module file {e['path']} is missing (rerun stage export_hlo_suite)")
    return doc


def split_paths(manifest_path: str | Path, split: str) -> list[Path]:
    """The module files of one split of the suite at ``manifest_path``."""
    if split not in SPLITS:
        raise RLFlowError(f"unknown suite split {split!r} (known: {', '.join(SPLITS)})")
    doc = load_manifest(manifest_path)
    return [Path(manifest_path).parent / e["path"] for e in doc["modules"] if e["split"] == split]
