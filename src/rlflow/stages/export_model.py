"""Export one zoo model to ONNX, or import one of your own (pipeline stage ``export_model``).

Reads these config keys: seed, export.opset, export.exporter and zoo.<MODEL>: a zoo model's sizes, or your own
model's ONNX file (``zoo.<MODEL>.onnx``, under models/) and the shapes of its inputs of dynamic size
(``zoo.<MODEL>.input_shapes``). An own model is read, checked (ops, shapes, weights: a one-line error names what
rlflow cannot take) and written with every shape fixed, at its own opset (export.* do not apply to it).
Writes one ONNX file, atomically (it appears complete or not at all).

Config: --config may be given several times; later files are deep-merged over earlier ones (mappings merge
key by key, lists and scalars replace), then every --set KEY=VALUE applies (VALUE is YAML or JSON). Without
--config the schema defaults (the paper sizes) apply. The merged config is validated before anything runs.

Examples:
  rlflow export-model resnet18 --out resnet18.onnx             (schema defaults: the paper sizes)
  rlflow export-model --config config.yaml --config tests/configs/tiny.yaml --model vit --out /tmp/vit.onnx
  rlflow export-model --config config.yaml --set zoo.bert.layers=2 --set export.exporter=torchscript \\
      --model bert --out /tmp/bert.onnx
  rlflow export-model --config config.yaml --set 'zoo.mine={onnx: models/mine.onnx}' --model mine --out m.onnx
"""

from __future__ import annotations

import argparse
import time

from rlflow.config import get, load_config
from rlflow.errors import RLFlowError
from rlflow.pipeline.registry import REPO_ROOT, model_names, own_models

HELP = "export a zoo model to ONNX at its configured sizes (pipeline stage export_model)"
SET_EXAMPLE = "zoo.bert.layers=2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", metavar="NAME",
                        help="zoo model (" + ", ".join(model_names()) + ") or an own model of the config's zoo "
                             "section; or give --model NAME")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    own = own_models(config)
    names = [*model_names(), *own]
    if args.name and args.model and args.name != args.model:
        raise RLFlowError(f"two different models given: '{args.name}' and --model '{args.model}'")
    args.model = args.model or args.name
    if not args.model:
        raise RLFlowError("which model? give NAME or --model NAME (" + ", ".join(names) + ")")
    if args.model not in names:
        raise RLFlowError(f"unknown model '{args.model}' (choose from: {', '.join(names)}; or name your own ONNX "
                          f"file as zoo.{args.model}.onnx)")
    if args.out.exists() and args.out.is_dir():
        raise RLFlowError(f"{args.out}: --out is a folder, expected an .onnx file path")
    if args.model in own:
        return _import_own(args.model, own[args.model], args.out)
    sizes = dict(get(config, f"zoo.{args.model}"))
    opset = get(config, "export.opset")
    exporter = get(config, "export.exporter")
    seed = get(config, "seed")

    from rlflow.graph import zoo  # imports torch: only after the config and arguments are known to be good

    print(f"export_model: {args.model} sizes={sizes} opset={opset} exporter={exporter} seed={seed}", flush=True)
    t0 = time.perf_counter()
    try:
        zoo.export_model(args.model, args.out, sizes, opset=opset, exporter=exporter, seed=seed)
    except ValueError as e:  # sizes the model cannot be built with (e.g. heads not dividing hidden)
        raise RLFlowError(f"zoo.{args.model}: cannot export with these sizes: {e}") from None
    mb = args.out.stat().st_size / 1e6
    print(f"export_model: wrote {args.out} ({mb:.1f} MB) in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def _import_own(name: str, entry: dict, out) -> int:
    """Read the user's ONNX file (relative paths from the repository root, where the pipeline runs), fix its
    dynamic input shapes, and write it as the pipeline's model.onnx."""
    from pathlib import Path

    from rlflow.graph.onnx_io import load_onnx, save_onnx

    path = Path(entry["onnx"])
    if not path.is_absolute() and not path.exists():
        path = REPO_ROOT / path
    if not path.is_file():
        raise RLFlowError(f"zoo.{name}.onnx: {entry['onnx']}: no such file")
    t0 = time.perf_counter()
    graph = load_onnx(path, input_shapes=entry.get("input_shapes"))
    print(f"export_model: {name}: own model {entry['onnx']}: {len(graph.nodes)} nodes, opset {graph.opset}, inputs "
          + ", ".join(f"{v} {list(graph.types[v].shape)}" for v in graph.inputs), flush=True)
    save_onnx(graph, out)
    print(f"export_model: wrote {out} ({out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s",
          flush=True)
    return 0
