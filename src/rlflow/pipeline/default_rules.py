"""The digest of what made the rule set shipped as package data (``rlflow optimize``'s default rules).

`make default-rules` runs the generate_rules stage on config.yaml, gzips its file into the package and records
:func:`inputs_digest` beside it (:data:`DIGEST`). The digest covers what DVC reruns that stage for -- its code
(the registry's import closure) and config.yaml's ``rules`` section -- and numpy's version. tests/test_rules_file.py
regenerates the rule set (two to three minutes) only when the recorded digest no longer matches:

  python -m rlflow.pipeline.default_rules --config config.yaml      # print it, and whether it is the recorded one
  python -m rlflow.pipeline.default_rules --config config.yaml --write
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from rlflow.config import load_config
from rlflow.pipeline.registry import REPO_ROOT as REPO, stage
from rlflow.rewrite.rule import DEFAULT_RULES

#: the recorded digest, beside the shipped rule set
DIGEST = DEFAULT_RULES.parent / "default_rules.inputs.sha256"


def inputs_digest(config: dict, root: Path = REPO) -> str:
    """sha256 over the generate_rules stage's code files (paths and contents, under ``root``), the config's
    ``rules`` section and numpy's version."""
    import numpy

    h = hashlib.sha256()
    for name in sorted(stage("generate_rules").code_files()):
        h.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    h.update(json.dumps(config["rules"], sort_keys=True).encode())
    h.update(numpy.__version__.encode())
    return h.hexdigest()


def recorded_digest() -> str | None:
    """The digest `make default-rules` recorded, None if there is none."""
    return DIGEST.read_text().split()[0] if DIGEST.is_file() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "config.yaml", help="the config the rules were made from")
    ap.add_argument("--write", action="store_true", help=f"record it in {DIGEST.relative_to(REPO)}")
    args = ap.parse_args(argv)
    digest = inputs_digest(load_config([args.config]))
    if args.write:
        DIGEST.write_text(digest + "\n")
        print(f"{digest} (recorded in {DIGEST.relative_to(REPO)})")
        return 0
    recorded = recorded_digest()
    state = ("none recorded" if recorded is None else "the recorded one" if recorded == digest else
             "the recorded one differs: `make default-rules` makes the rule set again and records it")
    print(f"{digest} ({state})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
