"""Arguments and loading shared by the pipeline stages (each stage module stays a short, readable script)."""

from __future__ import annotations

import argparse

from rlflow.config import load_config
from rlflow.problem import Problem
from rlflow.problem import load_problem as _load_problem


def load_problem(args: argparse.Namespace) -> Problem:
    """Validate the config (``--config``/``--set``), then :func:`rlflow.problem.load_problem` on the stage's
    ``--onnx``, ``--rules`` and ``--costs``."""
    config = load_config(args.config, args.overrides)
    return _load_problem(config, args.onnx, args.rules, getattr(args, "costs", None))



