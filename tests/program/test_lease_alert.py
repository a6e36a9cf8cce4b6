"""The ForklessLeaseLost alert (deploy/prometheus/alerts.yml) against the series a real run exposes
(issue 65, defect 5): a partitioned instance against a real nats-server, scraped as Prometheus would,
loses its lease (paused past it, as a stalled process does) and exits 3. What its ``/metrics`` showed,
scrape by scrape, is then fed to ``promtool test rules``: the alert must fire on it.

Before: its rule was on ``forkless_dropped_total{reason="lease lost"}``, which was not exposed at 0 (a
first sample has no increase), counted just before the exit (no scrape saw it), and 0 when the instance
held nothing (seen here: "0 received messages dropped"): the alert could not fire on a real run. Now the
rule is on ``forkless_lease_losses_total``, 0 from the start, and the instance serves its last books until
a scrape has read them.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.controller.partitions.test_partitioned import OPEN, P, _create_partitioned_streams, _env, _feed
from tests.harness import UNIT_S, wait_until
from tests.io_loop.connectors.jetstream.test_jetstream import Publisher

pytestmark = pytest.mark.timeout(300 * UNIT_S)

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
LEASE_S = 2.0
SERIES = re.compile(r"^forkless_lease_losses_total (\S+)$", re.M)
DROPPED = re.compile(r'^forkless_dropped_total\{reason="lease lost"\} (\S+)$', re.M)


class Scraper:
    """Scrapes ``url``/metrics every ``every_s`` from a thread of its own, as Prometheus would: each
    scrape's value of ``forkless_lease_losses_total`` (None: the series was absent) and of
    ``forkless_dropped_total{reason="lease lost"}``."""

    def __init__(self, url: str, every_s: float = 0.1) -> None:
        self.url, self.every_s = url, every_s
        self.values: list[float | None] = []
        self.dropped: list[float | None] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="scraper", daemon=True)

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                with urllib.request.urlopen(f"{self.url}/metrics", timeout=2) as answer:
                    text = answer.read().decode()
                found, dropped = SERIES.search(text), DROPPED.search(text)
                self.values.append(float(found.group(1)) if found else None)
                self.dropped.append(float(dropped.group(1)) if dropped else None)
            except OSError:  # not served yet, stopped (SIGSTOP: it times out), or gone
                pass
            self.done.wait(self.every_s)


def _alert_fires_on(values: list[float | None], tmp: Path) -> subprocess.CompletedProcess[str]:
    """``promtool test rules`` with the scraped ``values`` as the input series (15 s apart, as a scrape
    interval), expecting ForklessLeaseLost to fire at the last one."""
    rule = next(r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
                if r.get("alert") == "ForklessLeaseLost")
    annotations = {k: v.replace("{{ $labels.instance }}", "p1") for k, v in rule["annotations"].items()}
    test = {"rule_files": [str(RULES)], "evaluation_interval": "15s", "tests": [{
        "interval": "15s",
        "input_series": [{"series": 'forkless_lease_losses_total{job="forkless",instance="p1"}',
                          "values": " ".join("_" if v is None else f"{v:g}" for v in values)}],
        "alert_rule_test": [{"eval_time": f"{15 * (len(values) - 1)}s", "alertname": "ForklessLeaseLost",
                             "exp_alerts": [{"exp_labels": {"severity": "critical", "job": "forkless",
                                                            "instance": "p1"},
                                             "exp_annotations": annotations}]}]}]}
    path = tmp / "scraped_test.yml"
    path.write_text(yaml.safe_dump(test), encoding="utf-8")
    return subprocess.run([shutil.which("promtool") or "promtool", "test", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)


def test_the_lease_lost_alert_fires_on_the_series_a_partitioned_instance_exposes_when_it_loses_its_lease(
        app: Any, nats_server: Any, free_port: int, tmp_path: Path) -> None:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed here (Debian's prometheus package has it; .ci/run installs it)")
    url = nats_server.url
    _create_partitioned_streams(url)
    env = _env(url, tmp_path, feed=_feed(url, partitions=f"0-{P - 1}"), lease_s=LEASE_S,
               FORKLESS_METRICS_ADDR=f"127.0.0.1:{free_port}")
    scraper = Scraper(f"http://127.0.0.1:{free_port}")
    with Publisher(url, streams=24, rate_hz=300.0):
        instance = app(env=env)
        instance.wait_for_line(OPEN, stream="stderr", timeout_s=120 * UNIT_S)
        scraper.thread.start()
        wait_until(lambda: len(scraper.values) >= 5, timeout_s=30 * UNIT_S, what="five scrapes")
        instance.signal(signal.SIGSTOP)  # stalled past its lease: it cannot renew, and the lease runs out
        time.sleep(LEASE_S * 2)
        instance.signal(signal.SIGCONT)  # it finds its lease lost, drops what it held, and exits 3
        done = instance.finish(120 * UNIT_S)
    scraper.done.set()
    scraper.thread.join(10)
    assert done.returncode == 3, done.stderr[-3000:]
    held = re.search(r"the lease of a partition is lost: (\d+) received messages dropped", done.stderr)
    assert held, done.stderr[-3000:]
    values = scraper.values
    assert values[0] == 0.0, values[:5]  # exposed at 0 from the start: the first loss is an increase
    assert values[-1] == 1.0, values[-5:]  # scraped before the exit, whatever it held
    assert scraper.dropped[0] == 0.0 and scraper.dropped[-1] == float(held.group(1)), scraper.dropped[-5:]
    checked = _alert_fires_on(values, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
