"""Atomic file writes (a stage's output either appears complete or not at all), and reading such a file back
with a one-line error."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` only if the block succeeds."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; outputs get the usual permissions
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, final)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_npz(path: str | os.PathLike, arrays: dict) -> None:
    """Write ``arrays`` as a compressed ``.npz`` file, atomically."""
    import io

    import numpy as np

    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    with atomic_path(path) as tmp:
        tmp.write_bytes(buf.getvalue())


def read_npz(path: str | os.PathLike, missing: str, unreadable: str) -> dict:
    """All arrays of an ``.npz`` file (no pickles); a missing file is the one-line RLFlowError
    ``"<path>: <missing>"``, an unreadable one ``"<path>: <unreadable> (<error class>)"``."""
    import numpy as np

    from rlflow.errors import RLFlowError

    path = Path(path)
    if not path.is_file():
        raise RLFlowError(f"{path}: {missing}")
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except Exception as e:  # a damaged zip, a truncated array, not an npz file at all
        raise RLFlowError(f"{path}: {unreadable} ({e.__class__.__name__})") from None
