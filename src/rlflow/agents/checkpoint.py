"""Checkpoints of the training stages: resume after being killed, and the final file with its config.

A training loop saves its state every so often to ``<final>.partial`` (atomically: temp file + rename), tagged
with a fingerprint of everything that determines the run (config values, input file digests). On a rerun the
partial file is resumed only if its fingerprint matches; otherwise it is ignored and training starts over. The
final checkpoint is written atomically and the partial file removed::

    ckpt = Checkpointer(out, fingerprint(config_values, input_paths))
    state = ckpt.load()            # None, or the last saved dict
    ... ckpt.save({"epoch": e, "model": net.state_dict(), ...}) ...
    ckpt.finish({"model": net.state_dict(), "config": config_values, ...})

Checkpoints are torch state dicts with the config they were trained with (``torch.load(weights_only=True)``
loads them: only tensors and plain Python values inside).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from rlflow.errors import RLFlowError


def file_digest(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def fingerprint(values: Mapping[str, Any], inputs: Iterable[str | Path] = ()) -> str:
    """A digest of config values (JSON) and the contents of input files."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(values, sort_keys=True, default=str).encode())
    for p in inputs:
        h.update(file_digest(p).encode())
    return h.hexdigest()


def _atomic_torch_save(obj: Any, path: Path) -> None:
    import torch

    from rlflow.atomic import atomic_path

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


class Checkpointer:
    def __init__(self, final: str | Path, fp: str):
        self.final = Path(final)
        self.partial = self.final.with_name(self.final.name + ".partial")
        self.fp = fp

    def load(self) -> dict | None:
        """The last saved state of a run with the same fingerprint, or None."""
        if not self.partial.is_file():
            return None
        import torch

        try:
            state = torch.load(self.partial, map_location="cpu", weights_only=True)
        except Exception:  # a damaged partial file: start over
            return None
        if not isinstance(state, dict) or state.get("fingerprint") != self.fp:
            return None
        return state

    def save(self, state: dict) -> None:
        _atomic_torch_save({**state, "fingerprint": self.fp}, self.partial)

    def finish(self, payload: dict) -> None:
        _atomic_torch_save(payload, self.final)
        if self.partial.exists():
            os.unlink(self.partial)


def load_checkpoint(path: str | Path) -> dict:
    """A final checkpoint; a missing or unreadable file is a one-line error."""
    import torch

    p = Path(path)
    if not p.is_file():
        raise RLFlowError(f"{p}: no such checkpoint")
    try:
        data = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RLFlowError(f"{p}: not a readable checkpoint ({e.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise RLFlowError(f"{p}: not an rlflow checkpoint")
    return data
