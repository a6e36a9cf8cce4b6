"""bench/ as a tree: the benchmark and ``gendocs.py`` meet without a circle.

``gendocs.py`` regenerates every block of the documents, the benchmark's among them, and the benchmark writes its
own blocks at the end of a run: both go through ``bench/blocks.py``, which imports neither. The cycle finder is the
product's (tests/docs/test_architecture.py), function-level imports counted.
"""

from __future__ import annotations

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
