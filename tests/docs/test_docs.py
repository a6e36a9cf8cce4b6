"""The documents' generated blocks are exactly what the code generates, their samples name real
things, and their links lead somewhere.

Every block between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` (listed in
``gendocs.BLOCKS``) must equal its generator's output, so a hand edit, or a change to a
variable, a metric or an exit status without regenerating, fails here. ``python gendocs.py``
rewrites them all. The README is the front door and stays small; the manual is the embedding
guide, EMBEDDING.md (an index of pages under docs/embedding/), DESIGN.md (its module map on
pages under docs/design/) and the operator's guide, OPERATING.md (an index of pages under
docs/): one topic a page. No test caps a page's size: a page holds one topic, whatever its length.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

import gendocs
from bench.blocks import read_block, replace_block
from bench.plan import RESULTS_BLOCK, SUMMARY_BLOCK
from bench.tables import (
    results_markdown,
    summary_markdown,
    write_results_block,
    write_summary_block,
)
from forkless.controller.config import VARIABLES
from forkless.controller.metrics import MAX_REASONS, _every_field_populated, make_registry, render
from forkless.controller.stats import status_line
from forkless.io_loop.counters import HistogramSnapshot
from forkless.io_loop.crossing import HOPS

ROOT = Path(__file__).resolve().parents[2]
FIX = f"run `{gendocs.REGENERATE}` to regenerate"
PAGES = tuple(sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))  # the operator's guide
EMBEDDING_PAGES = tuple(sorted(f"docs/embedding/{p.name}" for p in (ROOT / "docs" / "embedding").glob("*.md")))
DESIGN_PAGES = tuple(sorted(f"docs/design/{p.name}" for p in (ROOT / "docs" / "design").glob("*.md")))  # the module map
DOCUMENTS = ("README.md", "EMBEDDING.md", "OPERATING.md", "DESIGN.md", *PAGES, *EMBEDDING_PAGES, *DESIGN_PAGES)
# the benchmark's documents: a summary page and a page a topic (bench/docs/)
BENCH_PAGES = ("bench/README.md", *sorted(f"bench/docs/{p.name}" for p in (ROOT / "bench" / "docs").glob("*.md")))
# every document whose relative links must lead somewhere
# the runs' pages too: each platform's README.md and each kept run's tables (bench/docs/running.md)
RUN_PAGES = tuple(sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "bench").glob("out*/**/*.md")))
LINKED = (*DOCUMENTS, "CHANGELOG.md", "tests/README.md", *BENCH_PAGES, *RUN_PAGES)


def text(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def table_rows(block: str) -> list[list[str]]:
    """The body rows of a Markdown table, cells stripped (header and rule left out)."""
    rows = [line for line in block.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


@pytest.mark.parametrize("block", gendocs.BLOCKS, ids=lambda b: f"{b.path}: {b.name}")
def test_the_generated_block_is_exactly_what_its_generator_writes(block: gendocs.Block) -> None:
    assert read_block(text(block.path), block.name) == block.render(), f"{block.path}: {block.name}: {FIX}"


def test_the_bench_pages_results_are_the_rendering_of_results_json() -> None:
    results = json.loads(text("bench/out/results.json"))
    fix = f"run `python -m bench.run --report-only` (or `{gendocs.REGENERATE}`)"
    assert read_block(text("bench/docs/last-run.md"), RESULTS_BLOCK) == results_markdown(results), (
        f"bench/docs/last-run.md does not show bench/out/results.json: {fix}")
    assert read_block(text("bench/README.md"), SUMMARY_BLOCK) == summary_markdown(results), (
        f"bench/README.md does not show bench/out/results.json's main table: {fix}")
    assert results_markdown(results).startswith(summary_markdown(results))  # the summary is the block's start


@pytest.mark.parametrize(("path", "block", "write"), [
    ("bench/docs/last-run.md", RESULTS_BLOCK, write_results_block),
    ("bench/README.md", SUMMARY_BLOCK, write_summary_block)], ids=["last-run.md", "README.md"])
def test_the_bench_writes_its_results_blocks_over_a_hand_edit(tmp_path: Path, path: str, block: str,
                                                              write: Any) -> None:
    page = tmp_path / "page.md"
    results = json.loads(text("bench/out/results.json"))
    page.write_text(replace_block(text(path), block, "| forkless | 0.01 | faster |\n"), encoding="utf-8")
    assert write(results, page) is True
    assert page.read_text(encoding="utf-8") == text(path)
    assert write(results, page) is False


def test_the_bench_summary_links_every_bench_page() -> None:
    assert len(BENCH_PAGES) > 1, BENCH_PAGES  # the glob found bench/docs/
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", text("bench/README.md")))
    assert linked == {page.removeprefix("bench/") for page in BENCH_PAGES[1:]}, "bench/README.md links every page"


def test_gendocs_check_names_a_hand_edited_block_and_regenerate_restores_it(tmp_path: Path) -> None:
    for block in gendocs.BLOCKS:
        (tmp_path / block.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / block.path, tmp_path / block.path)
    metrics = tmp_path / "docs/metrics.md"
    edited = metrics.read_text().replace("| `forkless_ready` | gauge |", "| `forkless_ready` | counter |")
    metrics.write_text(edited)
    assert gendocs.stale_blocks(tmp_path) == ["docs/metrics.md: metrics"]
    assert gendocs.regenerate(tmp_path) == ["docs/metrics.md: metrics"]
    assert metrics.read_text() == text("docs/metrics.md")
    assert gendocs.stale_blocks(tmp_path) == []


def test_a_block_without_its_markers_is_an_error_not_an_empty_block() -> None:
    with pytest.raises(ValueError, match="metrics:start"):
        read_block("no markers here", "metrics")


def test_the_metrics_table_lists_exactly_the_forkless_metrics_that_metrics_exposes() -> None:
    exposition = render(make_registry(_every_field_populated, process=False)).decode()
    exposed = re.findall(r"^# TYPE (\S+) ", exposition, re.M)
    documented = [row[0].strip("`") for row in table_rows(read_block(text("docs/metrics.md"), "metrics"))]
    assert documented == exposed


def _documented_metrics() -> dict[str, str]:
    """name -> help of every row of docs/metrics.md's metrics table."""
    return {row[0].strip("`"): row[3].replace("\\|", "|")
            for row in table_rows(read_block(text("docs/metrics.md"), "metrics"))}


def test_every_metric_named_in_a_sample_scrape_is_in_the_metrics_table() -> None:
    documented = _documented_metrics()
    for path in DOCUMENTS:
        for line in text(path).splitlines():
            help_line = re.match(r"# (HELP|TYPE) (forkless_\w+) ?(.*)", line)
            sample = re.match(r"(forkless_\w+)[{ ]", line)
            if help_line:
                name = help_line.group(2)
                assert name in documented, f"{path}: {line!r}: no such metric"
                if help_line.group(1) == "HELP":
                    assert help_line.group(3) == documented[name], f"{path}: {line!r}: not the metric's help"
            elif sample:
                name = sample.group(1)
                base = re.sub(r"_(bucket|count|sum)$", "", name)
                assert name in documented or base in documented, f"{path}: {line!r}: no such metric"


def test_the_documented_limit_on_reasons_is_the_code_s() -> None:
    assert f"At most {MAX_REASONS} reasons are kept per counter" in text("docs/metrics.md")


def _shape(line: str) -> str:
    return re.sub(r"\d+(\.\d+)?", "N", line.replace("DISCONNECTED", "connected"))


def test_every_sample_status_line_has_the_fields_of_the_real_status_line() -> None:
    # the samples are of WebSocket feeds and the default detector (its one declared counter), no sinks
    now = dataclasses.replace(_every_field_populated(), sources=(), counters={"anomalies": 1}, sinks=())

    def empty(h: HistogramSnapshot) -> HistogramSnapshot:
        return HistogramSnapshot(h.bounds, (0,) * len(h.counts), 0.0, 0)

    before = dataclasses.replace(now, at=0.0, messages_in=0, messages_out=0, latency=empty(now.latency),
                                 write_latency=empty(now.write_latency), batch_size=empty(now.batch_size),
                                 loop_lag=empty(now.loop_lag))
    expected = _shape(status_line(now, before))
    samples = [line for path in DOCUMENTS for line in text(path).splitlines()
               if re.match(r"in \d+ msg \(", line)]
    assert samples
    for line in samples:
        assert _shape(line) == expected, line


def test_the_bench_readme_says_what_decides_every_target_the_benchmark_judges() -> None:
    readme = text("bench/README.md")
    why = readme[readme.index("## The targets"):readme.index("## The pages")]
    explained = set(re.findall(r"`([^`]*(?:<=|>=|<|==)[^`]*)`", why))
    judged = {t["target"] for t in json.loads(text("bench/out/results.json"))["targets"]}
    assert explained == judged


def test_exit_statuses_are_listed_once_in_the_readme_s_generated_table() -> None:
    for path in DOCUMENTS:
        assert "Exit status:" not in text(path), f"{path}: point to the README's Exit status table instead"
        assert path == "README.md" or "<!-- exit:start -->" not in text(path), path
    assert text("README.md").count("<!-- exit:start -->") == 1


def test_the_index_lists_every_page() -> None:
    index = text("OPERATING.md")
    missing = [page for page in PAGES if f"]({page})" not in index]
    assert not missing, f"OPERATING.md does not link {missing}: one line each in its list of pages"


def test_the_embedding_guide_is_an_index_of_pages_of_one_topic() -> None:
    assert len(EMBEDDING_PAGES) >= 5, EMBEDDING_PAGES
    index = text("EMBEDDING.md")
    for page in EMBEDDING_PAGES:
        assert f"]({page})" in index, f"EMBEDDING.md does not link {page}"


def test_the_design_links_its_module_map_pages() -> None:
    assert len(DESIGN_PAGES) >= 2, DESIGN_PAGES
    for page in DESIGN_PAGES:
        assert f"]({page})" in text("DESIGN.md"), f"DESIGN.md does not link {page}"


def _outside_code(markdown: str) -> str:
    """``markdown`` without its fenced code blocks and inline code spans."""
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", prose)


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub makes for the headings of ``markdown`` (lower case, punctuation
    dropped, spaces to hyphens; a repeated heading gets -1, -2, …)."""
    found: set[str] = set()
    for line in re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M).splitlines():
        heading = re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            n, unique = 0, slug
            while unique in found:
                n += 1
                unique = f"{slug}-{n}"
            found.add(unique)
    return found


def test_anchors_follow_github_s_rule() -> None:
    assert anchors("# A\n## `python app.py --check`\n## The data's way (here)\n## A\n```\n# not\n```\n") == {
        "a", "python-apppy---check", "the-datas-way-here", "a-1"}


@pytest.mark.parametrize("path", LINKED)
def test_every_relative_link_points_at_a_file_that_exists_and_a_heading_it_has(path: str) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _outside_code(text(path))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: …
            continue
        file, _, anchor = target.partition("#")
        linked = (ROOT / path).parent / file if file else ROOT / path
        if not linked.is_file():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text(encoding="utf-8")):
            broken.append(f"{target}: no such heading in {file or path}")
    assert not broken, f"{path}: " + "; ".join(broken)


def test_every_forkless_variable_named_in_the_documents_exists() -> None:
    known = {var.env for var in VARIABLES}
    for path in DOCUMENTS:
        named = set(re.findall(r"\bFORKLESS_[A-Z][A-Z0-9_]*[A-Z0-9]\b", text(path)))
        assert named <= known, f"{path} names variables that do not exist: {sorted(named - known)}"


def test_the_module_map_lists_every_module_of_controller_and_io_loop_and_no_other() -> None:
    for package in ("controller", "io_loop"):
        page = f"docs/design/{package}.md"
        assert f"]({page})" in text("DESIGN.md"), f"DESIGN.md does not link its module map {page}"
        # the package's page and its continuations (docs/design/io_loop-rooms.md)
        listed = [m for extra in sorted((ROOT / "docs" / "design").glob(f"{package}*.md"))
                  for m in re.findall(r"^\| `([\w/]+\.py)` \|", extra.read_text(encoding="utf-8"), re.M)]
        present = sorted(p.relative_to(ROOT / package).as_posix() for p in (ROOT / package).rglob("*.py"))
        missing, stale = sorted(set(present) - set(listed)), sorted(set(listed) - set(present))
        assert not missing, f"{page} lacks {missing}: add one line for each"
        assert not stale, f"{page} lists modules that no longer exist: {stale}"


def test_design_md_walks_the_hops_of_the_latency_budget_in_order() -> None:
    design = text("DESIGN.md")
    section = design[design.index("## The data's way from socket to reply"):]
    section = section[:section.index("\n## ", 1)]
    assert tuple(re.findall(r"^\| `(\w+)` \|", section, re.M)) == HOPS
