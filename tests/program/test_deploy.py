"""The deployment kit (deploy/, docs/deployment.md) as it ships: the image's Dockerfile and install
steps, the systemd unit, the Kubernetes manifests, the alert rules and their runbook.

No container engine, cluster or Prometheus runs here, so each file is checked the way it can be:
the Dockerfile is parsed and its install script run in a fresh virtual environment on a copy of
the build context, and the program it installs is started from elsewhere and asked by the image's
own HEALTHCHECK command; the unit goes through ``systemd-analyze verify`` and the rules through
``promtool check rules`` and ``promtool test rules`` where those tools are installed (skipped,
saying so, where not); every manifest's and file's ``FORKLESS_*`` settings are read by ``Config``
as the program would read them; every metric an alert names exists.
"""

from __future__ import annotations

import configparser
import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import forkless
from forkless.controller.config import VARIABLES, Config
from forkless.controller.metrics import metrics_table_markdown
from tests import harness
from tests.harness import ROOT, UNIT_S

DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
UNIT = DEPLOY / "systemd" / "forkless.service"
MANIFESTS = ("websocket.yaml", "partitioned.yaml")
RULES = DEPLOY / "prometheus" / "alerts.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"
KNOWN = {var.env for var in VARIABLES}
VERSION = forkless.__version__  # the one place it is written (pyproject.toml reads it from there)
IMAGE = f"forkless:{VERSION}"  # the tag docs/deployment.md builds and the manifests run
WAIT_S = 120 * UNIT_S  # an install, or a start on a loaded machine


# ---- the image -------------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions, ``(KEYWORD, arguments)``, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text(encoding="utf-8").splitlines()
                                             if not line.lstrip().startswith("#")))
    return [(word.upper(), rest.strip()) for word, _, rest in
            (line.strip().partition(" ") for line in joined.splitlines() if line.strip())]


def _arguments(keyword: str) -> list[str]:
    return [rest for word, rest in dockerfile() if word == keyword]


def _env() -> dict[str, str]:
    """The final stage's ENV, as KEY=value pairs (``$PATH`` left as written)."""
    final = dockerfile()[max(i for i, (word, _) in enumerate(dockerfile()) if word == "FROM"):]
    pairs: dict[str, str] = {}
    for word, rest in final:
        if word == "ENV":
            pairs.update(item.split("=", 1) for item in shlex.split(rest))
    return pairs


def test_the_dockerfile_builds_in_two_stages_and_runs_as_a_user_with_the_cache_on_a_volume() -> None:
    stages = _arguments("FROM")
    assert len(stages) == 2 and stages[0].endswith(" AS build"), stages
    assert _arguments("RUN")[0] == "sh deploy/docker/install.sh /opt/forkless"  # the script tests run
    user = _arguments("USER")
    assert user == ["forkless"]  # not root: the last USER is who runs
    env = _env()
    cache = env["JAX_COMPILATION_CACHE_DIR"]
    volumes = json.loads(_arguments("VOLUME")[0])
    assert cache in volumes and "/var/lib/forkless/checkpoints" in volumes
    port = env["FORKLESS_METRICS_ADDR"].rsplit(":", 1)[1]
    assert _arguments("EXPOSE") == [port]
    assert json.loads(_arguments("ENTRYPOINT")[0]) == ["forkless"]
    assert _arguments("STOPSIGNAL") == ["SIGTERM"]
    healthcheck = _arguments("HEALTHCHECK")[0]
    assert "--start-period=" in healthcheck and " CMD " in f" {healthcheck}"
    Config.from_env({k: v for k, v in env.items() if k.startswith("FORKLESS_")})  # valid settings
    assert {k for k in env if k.startswith("FORKLESS_")} <= KNOWN


def _healthcheck_command(prefix: Path) -> list[str]:
    """The HEALTHCHECK's CMD with the image's paths mapped into ``prefix`` (the install's venv)."""
    command = json.loads(_arguments("HEALTHCHECK")[0].split(" CMD ", 1)[1])
    return [str(prefix / "bin" / "python") if part == "python" else part.replace("/opt/forkless", str(prefix))
            for part in command]


def _dockerignore(source: Path) -> Any:
    """``shutil.copytree``'s ignore for .dockerignore's patterns (the few forms it uses)."""
    patterns = [line.strip() for line in (source / ".dockerignore").read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.startswith("#")]

    def ignore(directory: str, names: list[str]) -> set[str]:
        relative = Path(directory).relative_to(source)
        return {name for name in names for pattern in patterns
                if fnmatch.fnmatch((relative / name).as_posix(), pattern)
                or (pattern.startswith("**/") and fnmatch.fnmatch(name, pattern[3:]))}

    return ignore


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/docker/install.sh run as the Dockerfile runs it, in a copy of the build context, into a fresh
    virtual environment; returns it. The dependencies are this test run's own (a .pth file makes them
    visible): pip finds them installed and downloads nothing but what building forkless needs."""
    work = tmp_path_factory.mktemp("image")
    context = work / "src"
    shutil.copytree(ROOT, context, ignore=_dockerignore(ROOT))
    prefix = work / "opt-forkless"
    subprocess.run([sys.executable, "-m", "venv", str(prefix)], check=True, timeout=WAIT_S)
    purelib = Path(subprocess.run([str(prefix / "bin" / "python"), "-c", "import sysconfig; "
                                   "print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True,
                                  text=True, timeout=WAIT_S).stdout.strip())
    (purelib / "test-run-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    run = _arguments("RUN")[0].replace("/opt/forkless", str(prefix))
    done = subprocess.run(shlex.split(run), cwd=context, capture_output=True, text=True, timeout=10 * WAIT_S,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert done.returncode == 0, f"{run}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    # the COPY of the health check into the final stage
    copied = [rest.split() for word, rest in dockerfile() if word == "COPY" and "healthcheck.py" in rest]
    assert copied == [["deploy/docker/healthcheck.py", "/opt/forkless/healthcheck.py"]]
    shutil.copy(context / copied[0][0], prefix / "healthcheck.py")
    return prefix


def test_the_installed_program_is_the_installed_package_not_the_checkout(installed: Path, tmp_path: Path) -> None:
    where = subprocess.run([str(installed / "bin" / "python"), "-c", "import forkless; print(forkless.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=WAIT_S, check=True).stdout
    assert where.startswith(str(installed)), where


def test_the_installed_program_answers_the_images_healthcheck_and_stops_in_order(installed: Path,
                                                                                  tmp_path: Path) -> None:
    port = _free_port()
    # the image's settings, on a free port; the session's compilation cache with its lock (harness.app_env), as
    # every app the suite starts: a cache written without the lock broke another process's read of it
    env = harness.app_env({**{k: v for k, v in _env().items() if k.startswith("FORKLESS_")},
                           "FORKLESS_METRICS_ADDR": f"127.0.0.1:{port}", "FORKLESS_STATUS_S": "0"})
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax-cache"))
    check = _healthcheck_command(installed)
    assert subprocess.run(check, env=env, capture_output=True, timeout=WAIT_S).returncode == 1  # nothing serves yet
    log = tmp_path / "stderr"
    with log.open("w") as stderr:
        proc = subprocess.Popen([str(installed / "bin" / "forkless")], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.monotonic() + WAIT_S
            while subprocess.run(check, env=env, capture_output=True, timeout=WAIT_S).returncode != 0:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    records = [json.loads(line) for line in log.read_text().splitlines()]  # the image's FORKLESS_LOG_FORMAT=json
    assert code == 0, records
    assert any(r["message"].startswith("books: in ") for r in records)


def test_docker_builds_the_image_where_a_container_engine_runs(tmp_path: Path) -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "info"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("no container engine here (`docker info` fails): the install steps are tested in a venv instead")
    done = subprocess.run([docker, "build", "-f", str(DOCKERFILE), "-t", f"{IMAGE}-test", str(ROOT)],
                          capture_output=True, text=True, timeout=30 * WAIT_S)
    assert done.returncode == 0, done.stderr[-3000:]


# ---- systemd ---------------------------------------------------------------------------------------


def _unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    unit.optionxform = str  # keys keep their case
    unit.read_string(UNIT.read_text(encoding="utf-8"))
    return unit


def _unit_environment() -> dict[str, str]:
    """Every Environment= line of the unit (configparser keeps the last of a repeated key: read them all)."""
    return dict(line.split("=", 2)[1:] for line in UNIT.read_text(encoding="utf-8").splitlines()
                if line.startswith("Environment="))


def test_the_unit_notifies_systemd_with_a_watchdog_and_stops_within_its_timeout() -> None:
    service = _unit()["Service"]
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert int(service["WatchdogSec"]) >= 10  # the pings come every half of it, from the main thread's loop
    env = _unit_environment()
    assert {k for k in env if k.startswith("FORKLESS_")} <= KNOWN and env["JAX_COMPILATION_CACHE_DIR"]
    config = Config.from_env({k: v for k, v in env.items() if k.startswith("FORKLESS_")})
    assert float(service["TimeoutStopSec"]) > config.shutdown_timeout_s + 0.5
    assert service["RestartPreventExitStatus"] == "2"  # a bad setting is not retried
    assert env["JAX_COMPILATION_CACHE_DIR"].startswith("/var/cache/forkless")
    assert service["CacheDirectory"] == "forkless"  # systemd makes /var/cache/forkless, the unit's user's
    settings = dict(line.split("=", 1) for line in (DEPLOY / "systemd" / "forkless.env").read_text().splitlines()
                    if line and not line.startswith("#"))
    assert set(settings) <= KNOWN
    Config.from_env({**{k: v for k, v in env.items() if k.startswith("FORKLESS_")}, **settings})


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (Debian's systemd package has it)")
    # its ExecStart must be an executable file: the install's path, made here
    program = tmp_path / "opt" / "forkless" / "bin" / "forkless"
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    unit = tmp_path / "forkless.service"
    unit.write_text(UNIT.read_text(encoding="utf-8").replace("/opt/forkless/bin/forkless", str(program)))
    done = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # a misspelt key or a bad value is only a warning (exit 0): no output at all is the pass
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), done.stderr


# ---- Kubernetes ------------------------------------------------------------------------------------


def _workload(name: str) -> dict[str, Any]:
    documents = list(yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text(encoding="utf-8")))
    return next(d for d in documents if d["kind"] in ("Deployment", "StatefulSet"))


@pytest.mark.parametrize("name", MANIFESTS)
def test_each_manifest_has_startup_liveness_and_readiness_probes_on_the_metrics_port(name: str) -> None:
    pod = _workload(name)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == IMAGE
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FORKLESS_METRICS_ADDR"] == f"0.0.0.0:{ports['metrics']}"
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {kind: (p["path"], p["port"]) for kind, p in probes.items()} == {
        "startupProbe": ("/startedz", "metrics"), "livenessProbe": ("/healthz", "metrics"),
        "readinessProbe": ("/readyz", "metrics")}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # a cold compile fits
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0


@pytest.mark.parametrize("name", MANIFESTS)
def test_each_manifest_keeps_the_compilation_cache_on_a_volume_and_stops_within_its_grace(name: str) -> None:
    workload = _workload(name)
    pod = workload["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    cache = env["JAX_COMPILATION_CACHE_DIR"]
    mounted = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"] for v in pod.get("volumes", [])} | {
        t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
    assert mounted.get(cache) in volumes, (cache, mounted, volumes)
    forkless = {k: v for k, v in env.items() if k.startswith("FORKLESS_") and v is not None}
    assert set(forkless) | {e["name"] for e in container["env"] if "valueFrom" in e} <= KNOWN | {
        "JAX_COMPILATION_CACHE_DIR"}
    config = Config.from_env({**forkless, **({"FORKLESS_INSTANCE": "0"} if "FORKLESS_INSTANCES" in forkless else {})})
    assert pod["terminationGracePeriodSeconds"] > config.shutdown_timeout_s + 0.5
    checkpoints = forkless.get("FORKLESS_CHECKPOINT_DIR")
    assert checkpoints is None or checkpoints in mounted  # on the volume, not in the container's layer


# ---- the alert rules and their runbook -------------------------------------------------------------


def _rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"] for rule in group["rules"]]


def _metric_names() -> set[str]:
    """Every series name /metrics can have: the table's families with a histogram's three suffixes."""
    names = set()
    for line in metrics_table_markdown().splitlines()[2:]:
        name, kind = (cell.strip().strip("`") for cell in line.split("|")[1:3])
        names |= {name + suffix for suffix in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    return names


def test_every_metric_an_alert_names_is_one_forkless_serves() -> None:
    known = _metric_names() | {"process_start_time_seconds"}  # prometheus_client's process collector
    for rule in _rules():
        named = set(re.findall(r"\b(?:forkless|process)_[a-z_]+\b", rule["expr"]))
        assert named and named <= known, (rule["alert"], named - known)


def test_the_rules_cover_what_an_operator_must_hear_of_each_with_a_severity_and_a_runbook_section() -> None:
    rules = {rule["alert"]: rule for rule in _rules()}
    for needed in ("ForklessNoMessages", "ForklessIOLoopLag", "ForklessDroppingMessages", "ForklessReconnectStorm",
                   "ForklessCheckpointTooOld", "ForklessLeaseLost", "ForklessPartitionsUnowned"):
        assert needed in rules, needed
    sections = re.findall(r"^## (\S+)$", RUNBOOK.read_text(encoding="utf-8"), re.M)
    assert sorted(sections) == sorted(rules)  # a section for every alert, and an alert for every section
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["runbook_url"] == f"docs/runbook.md#{name.lower()}", name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed here (Debian's prometheus package has it; .ci/run installs it)")
    return promtool


def test_promtool_checks_the_rules() -> None:
    done = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_runs_the_rules_unit_tests() -> None:
    tests = RULES.with_name("alerts_test.yml")
    done = subprocess.run([_promtool(), "test", "rules", str(tests)], capture_output=True, text=True, timeout=60,
                          cwd=tests.parent)
    assert done.returncode == 0, done.stdout + done.stderr
