"""bench/ as a tree: the benchmark and ``gendocs.py`` meet without a circle.

``gendocs.py`` regenerates every block of the documents, the benchmark's among them, and the benchmark writes its
own blocks at the end of a run: both go through ``bench/blocks.py``, which imports neither. The cycle finder is the
product's (tests/docs/test_architecture.py), function-level imports counted.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.docs.test_architecture import find_imports, import_cycles, module_name

ROOT = Path(__file__).resolve().parents[2]


def _bench_and_gendocs() -> dict[str, str]:
    """dotted name -> path of gendocs.py and every module of bench/ (its run outputs aside)."""
    paths = ["gendocs.py", *(p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "bench").rglob("*.py"))
                             if not p.relative_to(ROOT / "bench").parts[0].startswith("out"))]
    return {module_name(path): path for path in paths}


def test_gendocs_and_the_benchmark_import_each_other_around_no_circle():
    modules = _bench_and_gendocs()
    assert "gendocs" in modules and "bench.tables" in modules and "bench.blocks" in modules
    imports = {path: find_imports((ROOT / path).read_text(encoding="utf-8"), path, modules)
               for path in modules.values()}
    cycles = import_cycles(imports, modules)
    assert not cycles, "import cycles between gendocs.py and bench/ (what both need goes below both, as " \
        "bench/blocks.py):\n" + "\n".join("  " + "; ".join(cycle) for cycle in cycles)


# ---- what the repository keeps of the runs (bench/docs/running.md, "What the repository keeps") -------------------

PLATFORMS = ("out", "out-tpu", "out-gpu")  # the CPU's, the TPU's, the GPU's
# where a run is quoted: the documents, the benchmark's code and scripts, the product (the tests are not a quote)
QUOTING = ("*.md", "gendocs.py", "docs/**/*.md", "bench/*.md", "bench/docs/*.md", "bench/*.py", "bench/*.sh",
           "forkless/**/*.py", "deploy/**/*.md", "examples/**/*.py")


def _latest(readme: Path) -> str | None:
    """The folder named on the line "The latest run:" of a platform's README.md (None: the platform's latest run
    is the files at its top, as the CPU's)."""
    for line in readme.read_text(encoding="utf-8").splitlines():
        if line.lstrip("- ").startswith("The latest run:"):
            linked = line.partition("](")[2].partition(")")[0]
            return linked.split("/")[0] if linked else None
    return None


def kept_problems(root: Path) -> list[str]:
    """What breaks the rules of what the repository keeps of the benchmark's runs, one line each (none: all kept
    as the rules say)."""
    from bench.archive import ARCHIVE, KEPT_AS_FILES  # the rule's own constants

    quoting = "\n".join(p.read_text(encoding="utf-8") for pattern in QUOTING for p in sorted(root.glob(pattern))
                        if p.is_file() and not p.relative_to(root).as_posix().startswith("bench/out"))
    problems = []
    for platform in PLATFORMS:
        top = root / "bench" / platform
        if not (top / "README.md").is_file():
            problems.append(f"bench/{platform}/README.md: missing (what the platform's runs are, its latest named)")
            continue
        latest = _latest(top / "README.md")
        for folder in sorted(p for p in top.iterdir() if p.is_dir()):
            where = f"bench/{platform}/{folder.name}"
            quoted = re.search(rf"(?<![\w-]){re.escape(platform)}/{re.escape(folder.name)}(?![\w-])", quoting)
            if folder.name != latest and not quoted:
                problems.append(f"{where}: neither the latest run nor quoted by a document: it leaves the tree "
                                f"(git keeps it)")
            loose = [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*"))
                     if p.is_file() and p.name != ARCHIVE and p.suffix not in KEPT_AS_FILES]
            if loose:
                problems.append(f"{where}: loose {', '.join(loose)}: into its {ARCHIVE} "
                                f"(python -m bench.archive {where})")
    return problems


def test_bench_keeps_the_latest_run_per_platform_and_the_quoted_ones_their_raw_files_archived():
    assert kept_problems(ROOT) == []


def test_the_keeping_rules_name_an_unquoted_run_and_a_loose_log(tmp_path):
    for platform in PLATFORMS:
        (tmp_path / "bench" / platform).mkdir(parents=True)
        (tmp_path / "bench" / platform / "README.md").write_text("# runs\n\nThe latest run: [new](new/results.md).\n")
    for run in ("new", "quoted", "forgotten"):
        (tmp_path / "bench" / "out-tpu" / run).mkdir()
        (tmp_path / "bench" / "out-tpu" / run / "results.md").write_text("| a |\n")
    (tmp_path / "bench" / "out-tpu" / "quoted" / "run.log").write_text("a log\n")
    (tmp_path / "bench" / "docs").mkdir()
    (tmp_path / "bench" / "docs" / "page.md").write_text("[the run](../out-tpu/quoted/results.md)\n")
    assert kept_problems(tmp_path) == [
        "bench/out-tpu/forgotten: neither the latest run nor quoted by a document: it leaves the tree (git keeps it)",
        "bench/out-tpu/quoted: loose run.log: into its raw.tar.xz (python -m bench.archive bench/out-tpu/quoted)"]


def test_an_archived_run_keeps_its_tables_and_the_same_files_make_the_same_archive(tmp_path):
    from bench.archive import archive, archived

    for attempt in ("first", "second"):
        run = tmp_path / attempt
        (run / "sub").mkdir(parents=True)
        (run / "results.md").write_text("| a |\n")
        (run / "results.json").write_text('{"a": 1}\n')
        (run / "sub" / "run.log").write_text("a log\n")
        assert archive(run) == ["results.json", "sub/run.log"]
        assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == ["raw.tar.xz", "results.md"]
        assert archived(run) == ["results.json", "sub/run.log"]
        assert archive(run) == []  # nothing left to archive: nothing changes
    assert (tmp_path / "first" / "raw.tar.xz").read_bytes() == (tmp_path / "second" / "raw.tar.xz").read_bytes()
