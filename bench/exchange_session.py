"""The exchange-session benchmark (issue 29): the same user's program in each design, against
the toy exchange (bench/exchange.py), round by round, medians per design.

    python -m bench.exchange_session [--duration 20] [--rounds 3] [--designs thread,spawn,forkless,portal]
        [--out bench/out/exchange_session.json] [--day [--outage 3] [--kill-at 10] [--closing 8]]

``--day`` makes each run a trading day (issue 65): the exchange's tokens expire (``--token-ttl``, 8 s
by default then), the exchange process is killed with SIGKILL ``--kill-at`` seconds into the main loop
and started again on the same port ``--outage`` seconds later, and the run ends with Ctrl-C (SIGINT)
after ``--duration`` seconds, the program placing ``--closing`` orders right then (``--orders-at-stop``).
Per design, besides: how long after the exchange was back the session was up again (the program's
connection events), orders given up, orders left with no word (neither filled, rejected nor
reported), the closing orders' fills, and Ctrl-C to the process's exit. The designs are the two ways
forkless offers (``forkless``: the client as a ``Source``; ``portal``: the unchanged worker on an
``IOPortal``, examples/portal_exchange.py); the baseline designs have no such day.

Each run is a fresh exchange process (``--quiet-every``/``--quiet-for``: a quiet market, so
orders placed while no trades arrive are measured too) and one design's program with the same
command line (``--force-order-every 0.2``); the designs take turns within each round, so the
machine's noise falls on all of them alike. A design whose program does not exist yet is
skipped with a note. Per design, medians over the rounds of: the order round trip p50/p99 (all,
and quiet-market only), trade -> main loop p50/p99, CPU seconds per second of the program's
process tree, and the tree's resident memory (RSS, sampled by this harness every ``SAMPLE_S``:
its peak over the whole run, start-up included, and its median over the main loop's run, from
the program's ``main loop started`` on), each also as a ratio to the thread design's (RSS also
as a difference in MB); the exchange's 4001 closes and violations are summed, so a design that
misbehaves shows. Each run also keeps the CPU seconds of each thread of the program's own
process over the main loop's run as sampled (``threads_cpu_s``, by thread id and name, from
``/proc``; within ``SAMPLE_S`` of its ends): where a design's CPU goes. RSS steady is sampled
over the same span. Prints a Markdown table and writes
JSON (every run's figures, the medians, the ratios); each process's output goes to
``OUT_DIR/exchange_logs/``.

Rules:
- Every run is a fresh exchange process and one design's program with the same command line; the
  designs take turns within each round.
- A design whose program is missing is skipped with a note, never counted as zero.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "bench" / "out" / "exchange_session.json"
FORCE_ORDER_EVERY_S = 0.2
START_TIMEOUT_S = 30.0
RUN_SLACK_S = 120.0  # start-up (JAX import, compile) and stop, on a loaded machine
SAMPLE_S = 0.25  # how often the program's process tree is sampled (RSS, per-thread CPU)
STARTED = "main loop started"  # what each design's program prints (stderr) once its main loop runs
MB = 1e6


@dataclass(frozen=True)
class Design:
    """One design's program: ``script`` must exist (relative to the repo root); it is run as
    ``python *argv --url ... --duration ... --stats ... --prices ... --force-order-every ...``
    (cwd the repo root, ``PYTHONPATH`` the repo root), and must exit 0 having written to
    ``--stats`` a JSON object with the keys of FIGURES (but ``cpu_per_s``) and COUNTS, and
    ``cpu_s`` and ``wall_s`` over its main loop's run (bench/exchange_client.py's ``run_main``
    writes exactly these)."""

    name: str
    script: str
    argv: tuple[str, ...]


DESIGNS = (
    Design("thread", "bench/exchange_thread.py", ("-m", "bench.exchange_thread")),
    Design("spawn", "bench/exchange_spawn.py", ("-m", "bench.exchange_spawn")),
    Design("forkless", "examples/exchange_session.py", ("examples/exchange_session.py",)),
    Design("portal", "examples/portal_exchange.py", ("examples/portal_exchange.py",)),
)
DAY_DESIGNS = ("forkless", "portal")  # the programs that live through a trading day (--day)
BASELINE = "thread"
# the trading day's figures (--day), each from one run: (figure in the table, key), medians over the rounds
DAY_FIGURES = (
    ("back after restart s", "reconnect_after_restart_s"),
    ("given up", "orders_given_up"),
    ("no word", "orders_without_word"),
    ("closing fills", "closing_fills"),
    ("Ctrl-C to exit s", "ctrl_c_to_exit_s"),
    ("CPU s", "cpu_s"),
)
# (figure in the table, key in the design's --stats JSON); cpu_per_s is computed
FIGURES = (
    ("order RTT p50 ms", "order_rtt_ms_p50"),
    ("order RTT p99 ms", "order_rtt_ms_p99"),
    ("quiet RTT p50 ms", "order_rtt_quiet_ms_p50"),
    ("quiet RTT p99 ms", "order_rtt_quiet_ms_p99"),
    ("trade→loop p50 ms", "trade_ms_p50"),
    ("trade→loop p99 ms", "trade_ms_p99"),
    ("CPU s/s", "cpu_per_s"),
    ("RSS peak MB", "rss_mb_peak"),
    ("RSS steady MB", "rss_mb_steady"),
)
DIFFERENCES = ("rss_mb_peak", "rss_mb_steady")  # also shown as a difference to the baseline's
COUNTS = ("orders", "fills", "unfilled", "trades", "logins")


def select_designs(wanted: list[str], known: tuple[Design, ...] = DESIGNS,
                   root: Path = REPO_ROOT) -> tuple[list[Design], dict[str, str]]:
    """The ``wanted`` designs (in ``known``'s order) whose program exists under ``root``, and a
    note for each one skipped; ValueError names a design that is not known."""
    unknown = sorted(set(wanted) - {d.name for d in known})
    if unknown:
        raise ValueError(f"unknown designs {unknown}; known: {[d.name for d in known]}")
    chosen = [d for d in known if d.name in wanted]
    skipped = {d.name: f"{d.script} does not exist yet" for d in chosen if not (root / d.script).exists()}
    return [d for d in chosen if d.name not in skipped], skipped


def start_exchange(args: list[str], log: Path) -> tuple[subprocess.Popen[str], str]:
    """``python -m bench.exchange ARGS`` in its own process; returns it and its URL, once it listens."""
    with log.open("w", encoding="utf-8") as stderr:  # the child has its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "bench.exchange", "--port", "0", *args], cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        line = proc.stdout.readline() if ready else ""
        if line.startswith("listening on "):
            return proc, line.split()[-1]
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"bench.exchange did not say 'listening on' within {START_TIMEOUT_S:.0f}s (see {log})")


def _threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of ``pid``, as ``"tid name"``: ``/proc``."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        out[f"{tid} {name}"] = (int(rest[11]) + int(rest[12])) / tick  # utime, stime (fields 14, 15)
    return out


@dataclass
class TreeSampler:
    """The program's process tree, sampled while it runs: RSS (bytes, summed over the tree) and
    its own threads' CPU (see the module docstring); ``started`` once its main loop runs."""

    pid: int
    peak: int = 0
    steady: list[int] = field(default_factory=list)
    threads_at_start: dict[str, float] | None = None
    threads_last: dict[str, float] = field(default_factory=dict)
    started_at: float | None = None

    def sample(self, started: bool, loop_s: float) -> None:
        """One sample; ``loop_s``: how long the main loop runs (its threads' CPU is taken up to then)."""
        try:
            me = psutil.Process(self.pid)
            procs = [me, *me.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        rss = 0
        for proc in procs:
            try:
                rss += proc.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        self.peak = max(self.peak, rss)
        if not started:
            return
        now = time.monotonic()
        if self.started_at is None:
            self.started_at = now
            self.threads_at_start = _threads_cpu(self.pid)
        if now - self.started_at <= loop_s:
            self.steady.append(rss)
            self.threads_last.update(_threads_cpu(self.pid))  # a thread that has ended keeps its last figure

    def figures(self) -> dict[str, Any]:
        start = self.threads_at_start or {}
        return {"rss_mb_peak": self.peak / MB if self.peak else None,
                "rss_mb_steady": statistics.median(self.steady) / MB if self.steady else None,
                "rss_samples": len(self.steady),
                "threads_cpu_s": {k: round(v - start.get(k, 0.0), 3) for k, v in self.threads_last.items()
                                  if v - start.get(k, 0.0) > 0} if start else None}


def _wait_sampling(proc: subprocess.Popen[Any], log: Path, loop_s: float,
                   timeout_s: float) -> tuple[int | None, TreeSampler]:
    """Wait for ``proc`` (up to ``timeout_s``), sampling its tree every ``SAMPLE_S`` (its main
    loop runs ``loop_s`` once it has said so in ``log``)."""
    sampler = TreeSampler(proc.pid)
    deadline = time.monotonic() + timeout_s
    started = False
    while proc.poll() is None and time.monotonic() < deadline:
        started = started or STARTED in log.read_text(encoding="utf-8", errors="replace")
        sampler.sample(started, loop_s)
        try:
            return proc.wait(SAMPLE_S), sampler
        except subprocess.TimeoutExpired:
            pass
    return proc.poll(), sampler


def stop(proc: subprocess.Popen[Any], timeout_s: float) -> int | None:
    """SIGTERM ``proc`` unless it has ended, wait; kill it past ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def run_once(design: Design, a: argparse.Namespace, logs: Path, tag: str) -> dict[str, Any]:
    """One design against a fresh exchange: its stats, the exchange's counters, exit statuses."""
    summary = logs / f"{tag}.exchange.json"
    exchange_args = ["--rate", str(a.rate), "--quiet-every", str(a.quiet_every), "--quiet-for", str(a.quiet_for),
                     "--token-ttl", str(a.token_ttl), "--summary", str(summary)]
    exchange, url = start_exchange(exchange_args, logs / f"{tag}.exchange.log")
    stats_path, prices_path = logs / f"{tag}.stats.json", logs / f"{tag}.prices.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable, *design.argv, "--url", url, "--duration", str(a.duration), "--stats", str(stats_path),
           "--prices", str(prices_path), "--force-order-every", str(FORCE_ORDER_EVERY_S)]
    try:
        with (logs / f"{tag}.log").open("w", encoding="utf-8") as log:
            client = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            rc, sampler = _wait_sampling(client, logs / f"{tag}.log", a.duration, a.duration + RUN_SLACK_S)
            if rc is None:
                rc = stop(client, 10.0)
    finally:
        exchange_rc = stop(exchange, 10.0)
    run: dict[str, Any] = {"design": design.name, "rc": rc, "exchange_rc": exchange_rc, "log": str(logs / f"{tag}.log")}
    run["exchange"] = json.loads(summary.read_text()) if summary.exists() else None
    if stats_path.exists():
        stats = json.loads(stats_path.read_text())
        stats["cpu_per_s"] = stats["cpu_s"] / stats["wall_s"] if stats.get("wall_s") else None
        run["stats"] = stats | sampler.figures()
    else:
        run["stats"] = None
    return run


def _sample_until(proc: subprocess.Popen[Any], sampler: TreeSampler, until: float, loop_s: float) -> None:
    """Sample ``proc``'s tree every ``SAMPLE_S`` until ``until`` (monotonic) or its end."""
    while time.monotonic() < until and proc.poll() is None:
        sampler.sample(True, loop_s)
        time.sleep(min(SAMPLE_S, max(0.0, until - time.monotonic())))


def run_day(design: Design, a: argparse.Namespace, logs: Path, tag: str) -> dict[str, Any]:
    """One design through a trading day (see the module docstring): its stats, the day's figures, exit statuses."""
    exchange_args = ["--rate", str(a.rate), "--token-ttl", str(a.token_ttl)]
    exchange, url = start_exchange(exchange_args, logs / f"{tag}.exchange.log")
    port = url.rsplit(":", 1)[1]
    stats_path = logs / f"{tag}.stats.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.setdefault("JAX_PLATFORMS", "cpu")
    cmd = [sys.executable, *design.argv, "--url", url, "--stats", str(stats_path), "--force-order-every",
           str(FORCE_ORDER_EVERY_S), "--orders-at-stop", str(a.closing)]  # no --duration: until Ctrl-C
    day: dict[str, Any] = {"design": design.name, "rc": None, "log": str(logs / f"{tag}.log")}
    restarted = None
    log_path = logs / f"{tag}.log"
    try:
        with log_path.open("w", encoding="utf-8") as log:
            client = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            sampler = TreeSampler(client.pid)
            deadline = time.monotonic() + RUN_SLACK_S
            while STARTED not in log_path.read_text(encoding="utf-8", errors="replace"):
                if client.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{design.name} did not start (see {log_path})")
                sampler.sample(False, a.duration)
                time.sleep(SAMPLE_S / 5)
            t0 = time.monotonic()
            _sample_until(client, sampler, t0 + a.kill_at, a.duration)
            exchange.kill()  # SIGKILL: no close frame, the port stops listening
            exchange.wait()
            _sample_until(client, sampler, time.monotonic() + a.outage, a.duration)
            restarted, _ = start_exchange([*exchange_args, "--port", port], logs / f"{tag}.exchange-2.log")
            day["restarted_at_s"] = back = time.time()
            _sample_until(client, sampler, t0 + a.duration, a.duration)
            client.send_signal(signal.SIGINT)  # Ctrl-C, with the closing orders placed right then
            asked = time.monotonic()
            try:
                day["rc"] = client.wait(RUN_SLACK_S)
                day["ctrl_c_to_exit_s"] = time.monotonic() - asked
            except subprocess.TimeoutExpired:
                stop(client, 1.0)
    finally:
        if restarted is not None:
            stop(restarted, 10.0)
        if exchange.poll() is None:
            stop(exchange, 10.0)
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else None
    if stats is not None:
        ups = [at for at in stats.get("ups_at_s", []) if at > back]
        day["reconnect_after_restart_s"] = ups[0] - back if ups else None
        day["orders_without_word"] = stats["unfilled"]
        day.update({key: stats.get(key) for key in ("orders_given_up", "closing_fills", "cpu_s", "orders", "fills",
                                                     "orders_lost_with_session", "logins")})
        stats |= sampler.figures()
    day["stats"] = stats
    return day


def summarise_day(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure of DAY_FIGURES: the median, the least and the most over a design's days."""
    out: dict[str, Any] = {"runs": len(runs), "runs_ok": sum(r["rc"] == 0 and r["stats"] is not None for r in runs)}
    for _, key in DAY_FIGURES:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None
    return out


def day_markdown(medians: dict[str, dict[str, Any]], closing: int) -> str:
    head = ["design", *(label for label, _ in DAY_FIGURES)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in medians.items():
        cells = []
        for _, key in DAY_FIGURES:
            v = m[key]
            cells.append("–" if v is None else f"{v['median']:.3g} ({v['min']:.3g}–{v['max']:.3g})")
        lines.append("| " + " | ".join([name, *cells]) + " |")
    return "\n".join(lines) + f"\n\n(median over the days, least–most in brackets; closing fills of {closing})"


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of FIGURES over a design's runs that wrote stats; COUNTS and the exchange's
    4001 closes and violations summed."""
    done = [r["stats"] for r in runs if r["stats"]]
    out: dict[str, Any] = {"runs": len(runs), "runs_ok": sum(r["rc"] == 0 and r["stats"] is not None for r in runs)}
    for _, key in FIGURES:
        values = [s[key] for s in done if s.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    for key in COUNTS:
        out[key] = sum(s.get(key, 0) for s in done)
    exchanges = [r["exchange"] for r in runs if r["exchange"]]
    out["closes_4001"] = sum(e["closes"].get("4001", 0) for e in exchanges)
    out["violations"] = sum(sum(e["violations"].values()) for e in exchanges)
    return out


def ratios(medians: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each design's medians divided by the baseline's (None where either is missing)."""
    base = medians.get(BASELINE)
    if base is None:
        return {}
    return {name: {key: (m[key] / base[key] if m[key] is not None and base[key] else None) for _, key in FIGURES}
            for name, m in medians.items()}


def differences(medians: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each design's medians of ``DIFFERENCES`` less the baseline's (None where either is missing)."""
    base = medians.get(BASELINE)
    if base is None:
        return {}
    return {name: {key: (m[key] - base[key] if m[key] is not None and base[key] is not None else None)
                   for key in DIFFERENCES} for name, m in medians.items()}


def markdown(medians: dict[str, dict[str, Any]], vs: dict[str, dict[str, float | None]],
             skipped: dict[str, str]) -> str:
    def cell(name: str, key: str) -> str:
        v = medians[name][key]
        if v is None:
            return "–"
        r = vs.get(name, {}).get(key)
        if r is None or name == BASELINE:
            return f"{v:.3g}"
        if key in DIFFERENCES:
            return f"{v:.1f} (×{r:.2f}, {v - medians[BASELINE][key]:+.1f})"
        return f"{v:.3g} (×{r:.2f})"

    head = ["design", *(label for label, _ in FIGURES), "orders/fills", "4001s", "violations"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in medians.items():
        lines.append("| " + " | ".join([name, *(cell(name, key) for _, key in FIGURES), f"{m['orders']}/{m['fills']}",
                                        str(m["closes_4001"]), str(m["violations"])]) + " |")
    notes = [f"\n{name}: skipped, {why}" for name, why in skipped.items()]
    return "\n".join(lines) + "".join(notes) + (f"\n\n(×: ratio to {BASELINE}, +/−: the difference in MB; "
                                                 "medians over rounds)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.exchange_session", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=20.0, help="seconds of each program's main loop")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--designs", default=",".join(d.name for d in DESIGNS), help="comma-separated names")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--rate", type=float, default=500.0, help="the exchange's trades per second")
    p.add_argument("--quiet-every", type=float, default=5.0)
    p.add_argument("--quiet-for", type=float, default=1.5)
    p.add_argument("--token-ttl", type=float, default=None,
                   help="seconds a token lives (default: the run; with --day, 8)")
    p.add_argument("--day", action="store_true", help="each run a trading day (see the module docstring)")
    p.add_argument("--kill-at", type=float, default=None, help="--day: seconds into the main loop the exchange is "
                                                               "killed (default: half the duration)")
    p.add_argument("--outage", type=float, default=3.0, help="--day: seconds the exchange stays dead")
    p.add_argument("--closing", type=int, default=8, help="--day: orders placed at Ctrl-C")
    a = p.parse_args(argv)
    if a.token_ttl is None:
        a.token_ttl = 8.0 if a.day else 1e9
    if a.kill_at is None:
        a.kill_at = a.duration / 2
    if a.day and a.designs == p.get_default("designs"):
        a.designs = ",".join(DAY_DESIGNS)
    try:
        designs, skipped = select_designs(a.designs.split(","))
    except ValueError as exc:
        p.error(str(exc))
    if a.day:
        return main_day(a, designs, skipped)
    if not designs:
        print(f"nothing to run: {skipped}", file=sys.stderr)
        return 1
    logs = a.out.parent / "exchange_logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs = take_turns(designs, a.rounds, lambda d, r: run_once(d, a, logs, f"{d.name}-r{r}"),
                      lambda run: f"rc {run['rc']}, order RTT p50 {(run['stats'] or {}).get('order_rtt_ms_p50')} ms")
    medians = {name: summarise(rs) for name, rs in runs.items()}
    vs = ratios(medians)
    table = markdown(medians, vs, skipped)
    print(table)
    result = header(a, skipped) | {"medians": medians, "vs_" + BASELINE: vs,
                                   "minus_" + BASELINE: differences(medians), "runs": runs, "markdown": table}
    a.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0 if all(m["runs_ok"] == m["runs"] for m in medians.values()) else 1


def main_day(a: argparse.Namespace, designs: list[Design], skipped: dict[str, str]) -> int:
    """``--day``: each design through a trading day a round, the designs taking turns (see the module docstring)."""
    logs = a.out.parent / "exchange_logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs = take_turns(designs, a.rounds, lambda d, r: run_day(d, a, logs, f"day-{d.name}-r{r}"),
                      lambda day: f"rc {day['rc']}, back after {day.get('reconnect_after_restart_s')} s, given up "
                                  f"{day.get('orders_given_up')}, no word {day.get('orders_without_word')}, closing "
                                  f"fills {day.get('closing_fills')}, Ctrl-C to exit {day.get('ctrl_c_to_exit_s')} s")
    medians = {name: summarise_day(rs) for name, rs in runs.items()}
    table = day_markdown(medians, a.closing)
    print(table)
    result = header(a, skipped) | {"medians": medians, "runs": runs, "markdown": table}
    a.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0 if all(m["runs_ok"] == m["runs"] for m in medians.values()) else 1


def take_turns(designs: list[Design], rounds: int, run: Any, said: Any) -> dict[str, list[dict[str, Any]]]:
    """Each design run once a round (``run(design, round)``), the order rotated round by round, so the
    machine's noise falls on all of them alike; each run ``said`` on stderr as it ends."""
    runs: dict[str, list[dict[str, Any]]] = {d.name: [] for d in designs}
    for r in range(rounds):
        for d in designs[r % len(designs):] + designs[:r % len(designs)]:  # rotated, round by round
            done = run(d, r)
            runs[d.name].append(done)
            print(f"round {r} {d.name}: {said(done)}", file=sys.stderr, flush=True)
    return runs


def header(a: argparse.Namespace, skipped: dict[str, str]) -> dict[str, Any]:
    """When, on what, and with which plan a benchmark ran: the head of its JSON."""
    return {"when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                        "load_avg_1m_at_end": os.getloadavg()[0]},
            "plan": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
            | {"force_order_every_s": FORCE_ORDER_EVERY_S},
            "skipped": skipped}


if __name__ == "__main__":
    sys.exit(main())
