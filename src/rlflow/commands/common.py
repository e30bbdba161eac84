"""Arguments shared by the commands that read a user's ONNX file."""

from __future__ import annotations

import argparse


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="IN.onnx", help="the ONNX model to read")
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=DxD...",
                   help="fix a dynamic input's shape, e.g. --input-shape input_ids=1x128 (repeatable; rlflow optimize "
                        "keeps the dimension dynamic in its output where the result holds at other sizes too)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
