"""CHANGELOG.md keeps the record the deprecation policy promises (docs/embedding/versions.md): Keep a Changelog's
shape (an "Unreleased" section, then each release newest first, its changes under the format's own headings), the
newest release is ``forkless.__version__``, and every renamed name (``RENAMED``) is listed under "Deprecated" in
the release that renamed it and under "Removed" in the one that removed it, once that release is out."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import forkless
from forkless.io_loop.renamed import RENAMED, Renamed, is_removed, release

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")  # Keep a Changelog's, in its order


def sections(text: str) -> dict[str, dict[str, str]]:
    """``{"0.2.0": {"Deprecated": text, ...}, "Unreleased": {...}}``, in the order written; ValueError for a
    heading the format does not have."""
    found: dict[str, dict[str, str]] = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        name = "Unreleased" if heading == "Unreleased" else heading.split(" - ")[0]
        if name != "Unreleased" and not re.fullmatch(r"\d+\.\d+\.\d+ - \d{4}-\d{2}-\d{2}", heading):
            raise ValueError(f"## {heading}: a release is '## X.Y.Z - YYYY-MM-DD'")
        kinds = {}
        for sub in re.split(r"^### ", body, flags=re.M)[1:]:
            kind, _, said = sub.partition("\n")
            if kind not in KINDS:
                raise ValueError(f"## {heading}: ### {kind} is none of Keep a Changelog's {', '.join(KINDS)}")
            kinds[kind] = said
        found[name] = kinds
    return found


def misses(text: str, entries: list[Renamed]) -> list[str]:
    """Each renamed name the changelog ``text`` does not list where the policy says, one line each."""
    written = sections(text)
    missing = []
    for entry in entries:
        # a rename of the release being made is listed under "Unreleased" until that release is out
        deprecated_in = entry.deprecated_in if release(entry.deprecated_in) <= release(forkless.__version__) \
            else "Unreleased"
        wanted = [(deprecated_in, "Deprecated")] + ([(entry.removed_in, "Removed")] if is_removed(entry) else [])
        for version, kind in wanted:
            if f"`{entry.old}`" not in written.get(version, {}).get(kind, ""):
                missing.append(f"## {version} ### {kind} does not list `{entry.old}`")
    return missing


CHANGELOG = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")


def test_the_changelog_has_unreleased_on_top_then_each_release_newest_first():
    names = list(sections(CHANGELOG))
    assert names[0] == "Unreleased" and len(names) >= 3
    assert names[1:] == sorted(names[1:], key=release, reverse=True)


def test_the_newest_release_is_the_version_forkless_says_it_is():
    assert list(sections(CHANGELOG))[1] == forkless.__version__


def test_every_renamed_name_is_listed_as_deprecated_then_removed():
    assert misses(CHANGELOG, list(RENAMED.values())) == []


def test_a_rename_of_the_release_being_made_is_listed_under_unreleased():
    coming = Renamed("Controller(colour=x)", "Controller(color=x)", "9.1.0", "9.2.0")
    text = "# Changelog\n\n## Unreleased\n\n### Deprecated\n\n- `Controller(colour=x)`\n"
    assert misses(text, [coming]) == []
    assert misses(text.replace("colour", "color"), [coming]) == [
        "## Unreleased ### Deprecated does not list `Controller(colour=x)`"]


def test_the_changelog_check_names_an_unlisted_name_and_a_heading_the_format_lacks():
    entry = Renamed("Controller(colour=x)", "Controller(color=x)", "0.1.0", "0.2.0")
    text = "# Changelog\n\n## Unreleased\n\n## 0.2.0 - 2026-12-06\n\n### Removed\n\n## 0.1.0 - 2026-12-06\n\n" \
           "### Deprecated\n\n- `Controller(colour=x)`\n"
    assert misses(text, [entry]) == ["## 0.2.0 ### Removed does not list `Controller(colour=x)`"]
    with pytest.raises(ValueError, match="### Improved is none of Keep a Changelog's"):
        sections(text.replace("### Removed", "### Improved"))
