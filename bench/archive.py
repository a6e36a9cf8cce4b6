"""A run's folder as the repository keeps it: its tables and plot as they are, everything else in one archive.

    python -m bench.archive DIR [DIR ...]

Rules (bench/docs/running.md, "What the repository keeps"):
- What a reader opens stays a file of its own: Markdown (the tables, the folder's README) and images (a plot).
- Everything else a run wrote (every run's numbers as JSON, the logs, a program's printed output) goes into
  ``DIR/raw.tar.xz``, one archive a run, and leaves the folder; an archive already there keeps its members and
  takes the new ones (a member of the same name is replaced).
- The same files make the same bytes (names sorted, times, owners and modes fixed), so archiving again changes
  nothing. Read one with ``tar -xJf DIR/raw.tar.xz -C SOMEWHERE``.
"""

from __future__ import annotations

import argparse
import io
import lzma
import sys
import tarfile
from pathlib import Path

ARCHIVE = "raw.tar.xz"
KEPT_AS_FILES = (".md", ".png")  # what a reader opens in the tree; everything else is archived


def archived(folder: Path) -> list[str]:
    """The names (relative to ``folder``) of the members of its ``raw.tar.xz``; none when there is none."""
    path = folder / ARCHIVE
    if not path.is_file():
        return []
    with tarfile.open(path, "r:xz") as tar:
        return sorted(tar.getnames())


def raw_files(folder: Path) -> list[Path]:
    """The files of ``folder`` (its subfolders too) that belong in its archive."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != ARCHIVE
                  and p.suffix not in KEPT_AS_FILES)


def archive(folder: Path) -> list[str]:
    """Move ``folder``'s raw files into its ``raw.tar.xz``; returns the names moved (none: nothing changed)."""
    moving = raw_files(folder)
    if not moving:
        return []
    members: dict[str, bytes] = {}
    if (folder / ARCHIVE).is_file():
        with tarfile.open(folder / ARCHIVE, "r:xz") as tar:
            for member in tar.getmembers():
                extracted = tar.extractfile(member)
                if extracted is not None:
                    members[member.name] = extracted.read()
    for path in moving:
        members[path.relative_to(folder).as_posix()] = path.read_bytes()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(members[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(members[name]))
    (folder / ARCHIVE).write_bytes(lzma.compress(buffer.getvalue(), preset=9 | lzma.PRESET_EXTREME))
    for path in moving:
        path.unlink()
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not any(sub.iterdir()):
            sub.rmdir()
    return [path.relative_to(folder).as_posix() for path in moving]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.archive", description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", type=Path, help="a run's folder (bench/out-tpu/DATE, say)")
    a = p.parse_args(argv)
    for folder in a.folders:
        if not folder.is_dir():
            p.error(f"{folder} is no folder")
        moved = archive(folder)
        print(f"{folder / ARCHIVE}: {', '.join(moved)}" if moved else f"{folder}: nothing to archive")
    return 0


if __name__ == "__main__":
    sys.exit(main())
