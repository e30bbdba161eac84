"""Reading the project's JSON documents: each names its format in a ``format`` field."""

from __future__ import annotations

import json
from pathlib import Path

from rlflow.errors import RLFlowError


def read_document(path: str | Path, fmt: str, what: str) -> dict:
    """The JSON object at ``path`` whose ``format`` is ``fmt``; otherwise a one-line RLFlowError naming the file and
    saying it is not ``what`` (``a cost cache``) and why."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise RLFlowError(f"{p}: not {what} ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise RLFlowError(f"{p}: not {what} (format is not {fmt})")
    return doc
