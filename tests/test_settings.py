"""Every setting is validated before anything starts: hostile values for every variable end
in exit status 2 with one line naming the variable (never a traceback, never a start), in
the program and in ``--check`` alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from forkless.controller.commands.cli import main
from forkless.controller.config import Config
from forkless.controller.errors import ConfigError
from forkless.controller.settings.variables import VARIABLES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent

HOSTILE = ["nan", "-inf", "1e400", "-1", "0", "abc", "a\x01b", "💥", "   ", "9" * 40, "[]", "{}", "@/no/such/file",
           "ws://127.0.0.1:99999/feed", "ws://127.0.0.1:abc/feed", "wss://u:p@127.0.0.1:0/feed", "host:port",
           "[::1]:70000", '{"a": 1}', "1" * 5000,
           # bracketed hosts: IPv6 literals, well-formed or not
           "ws://[::1]:8080/x", "ws://[::1/x", "ws://::1]/x", "ws://[zz]/x", "ws://[]/x", "ws://[::1]x/",
           "wss://[fe80::1%eth0]/x", "[::1", "[zz]:80", "::1]:80", "[::1]x:80"]
CASES = [(var.env, value) for var in VARIABLES for value in HOSTILE]


@pytest.mark.parametrize(("name", "value"), CASES)
def test_a_hostile_value_is_accepted_or_refused_naming_the_variable_never_crashing(name, value, monkeypatch, capsys):
    for key in [k for k in os.environ if k.startswith("FORKLESS_")]:
        monkeypatch.delenv(key)
    try:
        Config.from_env({name: value})
    except ConfigError as exc:
        assert name in str(exc)  # the variable itself, or a cross-check that names it (MIN_S > MAX_S)
    else:
        return  # a value this variable accepts: nothing more to check here
    monkeypatch.setenv(name, value)
    for args in ([], ["--check"]):
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("forkless: configuration error: FORKLESS_") and name in err[0], err


@pytest.mark.parametrize("url", ["ws://127.0.0.1:99999/feed", "ws://127.0.0.1:abc/feed", "ws://127.0.0.1:0/feed"])
def test_a_feed_url_with_a_bad_port_is_a_configuration_error(url):
    with pytest.raises(ConfigError, match=r"FORKLESS_WS_URL='ws://127\.0\.0\.1:\w+/feed' is invalid: expected a "
                                          r"ws:// or wss:// URL \(port 1-65535\)"):
        Config(ws_url=url)


def test_an_error_about_the_url_never_shows_its_credentials_or_query():
    with pytest.raises(ConfigError) as err:
        Config(ws_url="wss://user:s3cret@127.0.0.1:99999/feed?token=t0ken")
    assert "s3cret" not in str(err.value) and "t0ken" not in str(err.value) and "user" not in str(err.value)


def test_a_ca_file_that_is_not_pem_is_refused_at_validation(tmp_path):
    path = tmp_path / "ca.pem"
    path.write_text("this is not a certificate\n")
    with pytest.raises(ConfigError, match=r"FORKLESS_CA_FILE=.*expected the path of an existing PEM file"):
        Config(ws_url="wss://127.0.0.1:9/feed", ca_file=str(path))


def test_a_real_pem_ca_file_is_accepted(tmp_path):
    from tests.servers import self_signed_certificate

    cert, _ = self_signed_certificate(tmp_path)
    assert Config(ca_file=str(cert)).ca_file == str(cert)


@pytest.mark.parametrize(("changes", "names"), [
    ({"ws_url": "ws://u:p@127.0.0.1:9/feed", "auth_token": "t"}, "credentials in FORKLESS_WS_URL"),
    ({"auth_token": "t", "headers": (("Authorization", "Basic x"),)}, "FORKLESS_AUTH_TOKEN and an Authorization"),
    ({"ws_url": "ws://u:p@127.0.0.1:9/feed", "headers": (("authorization", "x"),)}, "an Authorization header"),
])
def test_two_sources_of_credentials_are_refused(changes, names):
    with pytest.raises(ConfigError, match=f"one source of credentials, not .*{names}") as err:
        Config(**changes)
    assert "<hidden>" in str(err.value)


def test_the_app_and_check_exit_2_with_one_line_for_a_port_out_of_range():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKLESS_")}
    env.update(JAX_PLATFORMS="cpu", FORKLESS_WS_URL="ws://127.0.0.1:99999/feed")
    for args in ([], ["--check"]):
        proc = subprocess.run([sys.executable, "app.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == ("forkless: configuration error: FORKLESS_WS_URL='ws://127.0.0.1:99999/feed' "
                                       "is invalid: expected a ws:// or wss:// URL (port 1-65535), or empty")
        assert proc.stdout == ""


# ---- URLs and addresses, generated: bracketed hosts (IPv6 literals) above all ---------------------

HOSTS = st.one_of(
    st.sampled_from(["127.0.0.1", "localhost", "example.com", "h", ""]),
    st.sampled_from(["::1", "fe80::1%eth0", "fe80::1%25eth0", "::ffff:1.2.3.4", "zz", "", "v1.x", "::1]",
                     "[::1"]).map(lambda v6: f"[{v6}]"),
    st.sampled_from(["[::1", "::1]", "[::1]]", "[[::1]", "[::1]x", "a[b]", "[zz", "::1"]),
    st.text(alphabet="[]:%@.abf019", max_size=12),
)
PORTS = st.one_of(st.just(""), st.sampled_from([":", ":0", ":1", ":8080", ":65535", ":65536", ":-1", ":x", ":8 0"]))
URLS = st.builds(lambda scheme, user, host, port, path, query: f"{scheme}://{user}{host}{port}{path}{query}",
                 st.sampled_from(["ws", "wss", "http"]), st.sampled_from(["", "u:p@", "u@", "[u]@"]), HOSTS, PORTS,
                 st.sampled_from(["", "/", "/feed", "/[x]"]), st.sampled_from(["", "?token=t0ken", "#f"]))


def _refused_naming(name: str, environ: dict[str, str]) -> bool:
    """True when ``environ`` is refused with a ``ConfigError`` naming ``name`` (any other exception fails)."""
    try:
        Config.from_env(environ)
    except ConfigError as exc:
        assert name in str(exc) and "t0ken" not in str(exc)
        return True
    return False


def _usable_url(url: str) -> None:
    """What the client does with an accepted URL: show it, and hand it to aiohttp (yarl)."""
    import yarl
    from forkless.io_loop.net.netaddr import redact_url

    assert "t0ken" not in redact_url(url)
    parsed = yarl.URL(url)
    assert parsed.host and parsed.port


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(URLS)
def test_a_generated_feed_url_is_accepted_usable_or_refused_naming_the_variable(url):
    if not _refused_naming("FORKLESS_WS_URL", {"FORKLESS_WS_URL": url}):
        _usable_url(url)
    if not _refused_naming("FORKLESS_FEEDS", {"FORKLESS_FEEDS": json.dumps([{"url": url}])}):
        _usable_url(url)


@settings(max_examples=300, deadline=None)
@given(HOSTS, PORTS)
def test_a_generated_metrics_address_is_accepted_as_host_and_port_or_refused_naming_the_variable(host, port):
    from forkless.io_loop.net.netaddr import parse_host_port

    addr = host + port
    if not _refused_naming("FORKLESS_METRICS_ADDR", {"FORKLESS_METRICS_ADDR": addr}) and addr.strip():
        bound_host, bound_port = parse_host_port(addr)
        assert bound_host and "[" not in bound_host and "]" not in bound_host and 0 <= bound_port <= 65535


@pytest.mark.parametrize("url", ["ws://[::1/feed", "ws://[zz]/feed", "ws://[::1]x/feed"])
def test_the_app_exits_2_with_one_line_for_a_malformed_ipv6_url(url):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKLESS_")}
    env.update(JAX_PLATFORMS="cpu", FORKLESS_WS_URL=url)
    proc = subprocess.run([sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"forkless: configuration error: FORKLESS_WS_URL={url!r} is invalid: expected a "
                                   "ws:// or wss:// URL (port 1-65535), or empty")
