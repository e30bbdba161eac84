"""Small HTML building blocks (plain f-strings, every text escaped) and the page shell with its inline CSS.

The page loads nothing: no external CSS, scripts, fonts or images (figures are ``data:`` URIs), so a report
opens offline and can be mailed as one file.
"""

from __future__ import annotations

import html
from typing import Any, Iterable

DASH = "\u2014"


class Raw(str):
    """Text that is already HTML (not escaped again by :func:`table` and friends)."""


def esc(x: Any) -> str:
    return x if isinstance(x, Raw) else html.escape(str(x), quote=True)


# -- number formats -----------------------------------------------------------------------------------------
def num(v: float | None, digits: int = 3) -> str:
    """A float with ``digits`` decimals; a dash for a missing value."""
    return DASH if v is None else f"{v:.{digits}f}"


def pct(v: float | None, digits: int = 1) -> str:
    """An improvement in percent, signed (``+12.3%``); a dash for a missing value."""
    return DASH if v is None else f"{v:+.{digits}f}%"


def count(v: float | None) -> str:
    return DASH if v is None else f"{int(round(v)):,}"


def auto(v: Any) -> str:
    """A value of a JSON document: ints with separators, floats with 4 significant digits (or 2 decimals when
    larger), None as a dash, lists joined."""
    if v is None:
        return DASH
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:
            return DASH
        if v == int(v) and abs(v) < 1e15:
            return f"{int(v):,}"
        return f"{v:.2f}" if abs(v) >= 100 else f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(auto(x) for x in v)
    return str(v)


# -- blocks ---------------------------------------------------------------------------------------------------
def table(header: Iterable[Any], rows: Iterable[Iterable[Any]], caption: str | None = None, cls: str = "") -> str:
    """A table; cells are escaped unless :class:`Raw`. Numeric-looking cells are right-aligned by the CSS."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    cap = f"<caption>{esc(caption)}</caption>" if caption else ""
    return f'<table class="{esc(cls)}">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def figure(uri: str | None, alt: str, caption: str) -> str:
    """An embedded image with its caption; a note instead when there was nothing to draw."""
    if uri is None:
        return missing(f"No figure: {caption} has no data to draw.")
    if not uri.startswith("data:"):
        raise ValueError("figures must be embedded data: URIs")
    return (f'<figure><img src="{esc(uri)}" alt="{esc(alt)}"><figcaption>{esc(caption)}</figcaption>'
            f"</figure>")


def p(text: Any, cls: str = "") -> str:
    return f'<p class="{esc(cls)}">{esc(text)}</p>' if cls else f"<p>{esc(text)}</p>"


def missing(text: str) -> str:
    """An honest "not run / not available" note."""
    return p(text, "missing")


def paper(text: Any) -> str:
    """A note citing a paper's numbers."""
    return f'<p class="paper">{esc(text)}</p>'


def ul(items: Iterable[Any]) -> str:
    return "<ul>" + "".join(f"<li>{esc(i)}</li>" for i in items) + "</ul>"


def details(summary: str, body: str) -> str:
    return f"<details><summary>{esc(summary)}</summary>{body}</details>"


def pre(text: str) -> str:
    return f"<pre>{esc(text)}</pre>"


def section(sid: str, title: str, body: str) -> str:
    return f'<section id="{esc(sid)}"><h2>{esc(title)}</h2>{body}</section>'


CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 0 auto;
       max-width: 1100px; padding: 1em 2em 4em; color: #222; line-height: 1.45; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 2em; }
h3 { margin-bottom: 0.3em; }
table { border-collapse: collapse; margin: 0.6em 0 1em; font-size: 0.92em; }
caption { text-align: left; font-weight: 600; padding-bottom: 0.3em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; vertical-align: top; }
th:first-child, td:first-child { text-align: left; }
thead th { background: #f3f3f3; }
table.left2 td:nth-child(-n+2), table.left2 th:nth-child(-n+2),
table.left4 td:nth-child(-n+4), table.left4 th:nth-child(-n+4) { text-align: left; }
table.kv td:last-child, table.kv th { text-align: left; } table.kv td:last-child { font-family: ui-monospace, monospace; }
tr.main td { font-weight: 600; }
h3 { margin: 1.2em 0 0.3em; font-size: 1.05em; }
figure { margin: 0.8em 0 1.2em; } figure img { max-width: 100%; height: auto; }
figcaption { font-size: 0.9em; color: #444; }
p.missing { background: #fff4e0; border-left: 4px solid #f0a020; padding: 0.4em 0.8em; }
p.paper { background: #eef4fb; border-left: 4px solid #4a7fc0; padding: 0.4em 0.8em; font-size: 0.92em; }
pre { background: #f7f7f7; border: 1px solid #ddd; padding: 0.6em; overflow-x: auto; font-size: 0.85em; }
nav ol { columns: 2; font-size: 0.92em; } .meta { color: #555; }
details { margin: 0.5em 0; } summary { cursor: pointer; }
"""


def page(title: str, header: str, nav: list[tuple[str, str]], body: str) -> str:
    """The whole document: title, a header block (HTML), a table of contents (id, title) and the sections."""
    toc = "".join(f'<li><a href="#{esc(i)}">{esc(t)}</a></li>' for i, t in nav)
    toc_html = f"<nav><h2>Contents</h2><ol>{toc}</ol></nav>" if nav else ""
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<title>{esc(title)}</title>\n'
            f"<style>{CSS}</style>\n</head>\n<body>\n<h1>{esc(title)}</h1>\n{header}\n{toc_html}\n{body}\n"
            f"</body>\n</html>\n")
