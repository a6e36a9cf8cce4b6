"""The generated blocks of the documents: found, read and replaced between their markers.

A block sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``; the text around it is hand-written and
stays as it is. ``gendocs.py`` (every block) and the benchmark (its own blocks, at the end of a run) both write
through this module, which imports neither, so the two meet without a circle.
"""

from __future__ import annotations

from pathlib import Path


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"


def read_block(text: str, name: str) -> str:
    """What stands between the block's markers (ValueError if they are missing or repeated)."""
    start, end = _markers(name)
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ValueError(f"expected one '{start.strip()}' followed by one '{end}'")
    return text.split(start)[1].split(end)[0]


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with ``body`` between the block's markers (the markers stay)."""
    start, end = _markers(name)
    old = read_block(text, name)
    return text.replace(start + old + end, start + body + end)


def write_block(path: Path, name: str, body: str) -> bool:
    """Put ``body`` between the markers ``name`` of the file ``path``; True if the file changed."""
    text = path.read_text(encoding="utf-8")
    new = replace_block(text, name, body)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text
