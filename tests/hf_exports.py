"""Hugging Face transformers exports with random weights (config objects, nothing downloaded): the held-out
models the ``ort-cpu`` target is checked on (tests/test_ort_cpu_heldout.py, benchmarks/heldout_exports.py).

Each export is the model a user gets from ``torch.onnx.export`` of ``BertModel``, ``ViTModel`` or ``GPT2Model``
(batch 1; torch's default exporter at opset 18: at opset 17 its version conversion leaves GPT-2 with a Split that
opset 17 does not have), at one of two sizes: ``small`` (what a test can afford: 2 layers, hidden 128) and
``medium`` (BERT: 4 layers, hidden 256; ViT: 4 layers, hidden 192; GPT-2: 4 layers, hidden 256).

    from hf_exports import export
    export("bert", "medium", "/tmp/bert.onnx")
"""

from __future__ import annotations

import warnings
from pathlib import Path

#: the exported families
FAMILIES = ("bert", "vit", "gpt2")
#: per family and size: the config's figures, and the input's length (tokens) or image side (pixels)
SIZES = {
    "bert": {"small": dict(layers=2, hidden=128, heads=2, seq=64),
             "medium": dict(layers=4, hidden=256, heads=4, seq=128)},
    "vit": {"small": dict(layers=2, hidden=128, heads=2, image=112),
            "medium": dict(layers=4, hidden=192, heads=3, image=224)},
    "gpt2": {"small": dict(layers=2, hidden=128, heads=2, seq=64),
             "medium": dict(layers=4, hidden=256, heads=4, seq=128)},
}


def build(family: str, size: str):
    """(module in eval mode with random weights, example inputs, input names) of one family at one size."""
    import torch
    import transformers as tf

    s = SIZES[family][size]
    torch.manual_seed(0)
    common = dict(num_hidden_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
                  intermediate_size=4 * s["hidden"])
    if family == "bert":
        model = tf.BertModel(tf.BertConfig(vocab_size=1000, **common))
        return model.eval(), (torch.randint(0, 1000, (1, s["seq"])),), ["input_ids"]
    if family == "vit":
        model = tf.ViTModel(tf.ViTConfig(image_size=s["image"], patch_size=16, **common))
        return model.eval(), (torch.randn(1, 3, s["image"], s["image"]),), ["pixel_values"]
    if family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=1000, n_positions=max(256, s["seq"]), n_embd=s["hidden"],
                            n_layer=s["layers"], n_head=s["heads"], use_cache=False)
        return tf.GPT2Model(cfg).eval(), (torch.randint(0, 1000, (1, s["seq"])),), ["input_ids"]
    raise ValueError(f"unknown family '{family}' (choose from {', '.join(FAMILIES)})")


def export(family: str, size: str, path, dynamo: bool = True, opset: int = 18) -> Path:
    """Export one family at one size to ``path`` with torch's default exporter (torch.export's; the old
    TorchScript exporter with ``dynamo=False``: it fails on GPT-2's causal mask); returns the path."""
    import torch

    model, inputs, names = build(family, size)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        kw = {"external_data": False, "verbose": False} if dynamo else {}
        torch.onnx.export(model, inputs, str(path), dynamo=dynamo, opset_version=opset, input_names=names,
                          output_names=["last_hidden_state"], **kw)
    return Path(path)
