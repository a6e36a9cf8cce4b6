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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forkless.controller.commands.cli import main
from forkless.controller.config import VARIABLES, Config
from forkless.io_loop.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]

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


# ---- a variable's JSON from a file or in depth (issue 54, items 8 and 9) ------------------------------

FEEDS_ALLOWED = "configuration error: FORKLESS_FEEDS='<hidden>' is invalid: expected a JSON list of "


def _main_refuses(environ: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> str:
    """The program (``main``, as ``python app.py`` runs it) with ``environ``: exit status 2 and one line on
    stderr, which is returned. ``FORKLESS_DURATION`` ends a run that should not have started."""
    for key in [k for k in os.environ if k.startswith("FORKLESS_")]:
        monkeypatch.delenv(key)
    for key, value in {"FORKLESS_DURATION": "1", **environ}.items():
        monkeypatch.setenv(key, value)
    assert main([]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and captured.out == "", captured
    return err[0]


@pytest.mark.parametrize("text", ["", " \n\t\n"], ids=["empty", "blank"])
def test_feeds_from_an_empty_or_blank_file_are_refused_naming_the_file_never_taken_as_unset(
        tmp_path, text, monkeypatch, capsys):
    # taken as unset, the demo feed ran in the configured feeds' place and the program exited 0
    path = tmp_path / "feeds.json"
    path.write_text(text)
    line = _main_refuses({"FORKLESS_FEEDS": f"@{path}"}, monkeypatch, capsys)
    assert line.startswith("forkless: " + FEEDS_ALLOWED)
    assert line.endswith(f": {path} is empty: write the JSON list of feeds in it, or leave FORKLESS_FEEDS unset")
    with pytest.raises(ConfigError, match=f"{path} is empty"):
        Config(feeds=f"@{path}")


DEEP = 100_000  # levels: far past Python's recursion limit, which json's decoder recursed into


@pytest.mark.parametrize(("name", "text"), [
    ("FORKLESS_FEEDS", "[" * DEEP + "]" * DEEP),
    ("FORKLESS_FEEDS", '[{"url": "ws://127.0.0.1:9/feed", "subscribe": ' + "[" * 60_000 + "]" * 60_000 + "}]"),
    ("FORKLESS_SUBSCRIBE", "[" * DEEP),
    ("FORKLESS_HEADERS", '{"a": ' * DEEP),
], ids=["feeds", "feeds-subscribe", "subscribe", "headers"])
def test_json_nested_past_the_bound_is_refused_in_one_line_naming_the_variable(name, text, tmp_path, monkeypatch,
                                                                                capsys):
    # it crashed with a RecursionError traceback (exit 1); from a file as in the variable
    path = tmp_path / "value.json"
    path.write_text(text)
    for value in [text] if name == "FORKLESS_HEADERS" else [text, f"@{path}"]:
        line = _main_refuses({name: value}, monkeypatch, capsys)
        assert line.startswith(f"forkless: configuration error: {name}=") and line.endswith(
            ": nested more than 64 levels deep (arrays and objects inside one another)"), line


def test_json_nested_to_the_bound_is_taken_and_in_code_past_it_is_refused():
    def nested(levels: int) -> str:
        return "[" * levels + "]" * levels

    def feeds(subscribe: str) -> str:  # the entry's subscribe inside the list and the entry: two levels more
        return json.dumps([{"url": "ws://127.0.0.1:9/feed", "subscribe": "X"}]).replace('"X"', subscribe)

    assert Config(subscribe=nested(64)).subscribe == nested(64)
    in_strings = json.dumps({"text": "[" * 100, "quoted": '"{{{' * 50})  # a string's brackets are no nesting
    assert Config(subscribe=in_strings).subscribe == in_strings
    assert Config(feeds=feeds(nested(62))).feed_specs[0].subscribe == nested(62)
    with pytest.raises(ConfigError, match=r"FORKLESS_SUBSCRIBE='<hidden>' is invalid: .*nested more than 64 levels"):
        Config(subscribe=nested(65))
    with pytest.raises(ConfigError, match=r"FORKLESS_FEEDS='<hidden>' is invalid: .*nested more than 64 levels"):
        Config(feeds=feeds(nested(63)))


def test_the_app_exits_2_with_one_line_for_feeds_nested_too_deep_in_a_file(tmp_path):
    path = tmp_path / "feeds.json"
    path.write_text("[" * DEEP + "]" * DEEP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKLESS_")}
    env.update(JAX_PLATFORMS="cpu", FORKLESS_FEEDS=f"@{path}", FORKLESS_DURATION="1")
    proc = subprocess.run([sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("forkless: " + FEEDS_ALLOWED) and proc.stderr.strip().endswith(
        ": nested more than 64 levels deep (arrays and objects inside one another)"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
