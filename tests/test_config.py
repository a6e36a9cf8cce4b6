"""Configuration from FORKLESS_* variables: defaults, clear errors, exit status 2, --help."""

from __future__ import annotations

import pytest

from controller.config import VARIABLES, Config, ConfigError
from tests.harness import run_app

# one bad value for every variable that can be wrong
BAD = {
    "FORKLESS_WS_URL": "http://example.com/feed",
    "FORKLESS_SUBSCRIBE": "{not json",
    "FORKLESS_HEADERS": '["a"]',
    "FORKLESS_FEEDS": '[{"url": "http://example.com/feed"}]',
    "FORKLESS_SHARED_STREAMS": "sometimes",
    "FORKLESS_FEED_FATAL": "some",
    "FORKLESS_REPLIES": "bogus",
    "FORKLESS_CA_FILE": "/no/such/ca.pem",
    "FORKLESS_TLS_INSECURE": "maybe",
    "FORKLESS_FEATURES": "0",
    "FORKLESS_ALPHA": "1.5",
    "FORKLESS_THRESHOLD": "-1",
    "FORKLESS_WARMUP": "-3",
    "FORKLESS_MAX_STREAMS": "lots",
    "FORKLESS_DEVICES": "0",
    "FORKLESS_STREAM_IDLE_S": "-1",
    "FORKLESS_MAX_BATCH": "0",
    "FORKLESS_MAX_WAIT_MS": "-1",
    "FORKLESS_QUEUE_SIZE": "0",
    "FORKLESS_OVERFLOW": "drop_newest",
    "FORKLESS_MAX_MSG_BYTES": "10",
    "FORKLESS_MAX_FRAME_ITEMS": "0",
    "FORKLESS_HEARTBEAT_S": "-1",
    "FORKLESS_STALE_S": "nan",
    "FORKLESS_CONNECT_TIMEOUT_S": "0",
    "FORKLESS_RECONNECT_MIN_S": "-0.5",
    "FORKLESS_RECONNECT_MAX_S": "x",
    "FORKLESS_RECONNECT_RESET_S": "inf",
    "FORKLESS_RECONNECT_TRIES": "1.5",
    "FORKLESS_DURATION": "0",
    "FORKLESS_SHUTDOWN_TIMEOUT_S": "0",
    "FORKLESS_STATUS_S": "-1",
    "FORKLESS_LOG_LEVEL": "LOUD",
    "FORKLESS_LOG_FORMAT": "xml",
    "FORKLESS_METRICS_ADDR": "9464",
    "FORKLESS_DEMO_RATE": "0",
    "FORKLESS_DEMO_STREAMS": "0",
    "FORKLESS_CHECKPOINT_DIR": "/dev/null",
    "FORKLESS_CHECKPOINT_S": "0",
    "FORKLESS_CHECKPOINT_KEEP": "0",
    "FORKLESS_CHECKPOINT_RESTORE": "always",
    "FORKLESS_CHECKPOINT_PRIORITY": "low",
    "FORKLESS_RELAY_NATS": "http://127.0.0.1:4222",
    "FORKLESS_RELAY_SUBJECT": "ticks.*",
    "FORKLESS_RELAY_CREDS": "/no/such.creds",
    "FORKLESS_RELAY_SEQ": "global",
}


def test_every_variable_has_a_bad_value_in_this_test():
    assert {v.env for v in VARIABLES} - {"FORKLESS_AUTH_TOKEN", "FORKLESS_RELAY_TOKEN"} == set(BAD)


def test_defaults_are_the_documented_ones():
    c = Config.from_env({})
    assert (c.features, c.alpha, c.threshold, c.warmup, c.max_streams) == (8, 0.05, 4.0, 20, 4096)
    assert (c.reconnect_min_s, c.reconnect_max_s, c.reconnect_reset_s, c.reconnect_tries) == (0.5, 30.0, 5.0, 0)
    assert (c.heartbeat_s, c.stale_s, c.max_msg_bytes, c.shutdown_timeout_s) == (15.0, 0.0, 1 << 20, 10.0)
    assert c.duration_s is None and c.uses_demo_feed


@pytest.mark.parametrize(("name", "value"), sorted(BAD.items()))
def test_a_bad_value_names_the_variable_the_value_and_what_is_allowed(name, value):
    with pytest.raises(ConfigError) as err:
        Config.from_env({name: value})
    assert err.value.variable == name
    assert name in str(err.value) and "expected" in str(err.value)
    if name in ("FORKLESS_HEADERS", "FORKLESS_SUBSCRIBE", "FORKLESS_FEEDS"):  # secrets: never echoed
        assert value not in str(err.value) and "<hidden>" in str(err.value)
    else:
        assert repr(value) in str(err.value)


def test_values_are_parsed_and_cross_checked():
    c = Config.from_env({"FORKLESS_FEATURES": " 16 ", "FORKLESS_DURATION": "2.5", "FORKLESS_LOG_LEVEL": "debug",
                         "FORKLESS_HEADERS": '{"X-Key": "v"}', "FORKLESS_SUBSCRIBE": '{"op": "sub"}'})
    assert (c.features, c.duration_s, c.log_level, c.headers) == (16, 2.5, "DEBUG", (("X-Key", "v"),))
    with pytest.raises(ConfigError, match="FORKLESS_RECONNECT_MAX_S"):
        Config.from_env({"FORKLESS_RECONNECT_MIN_S": "5", "FORKLESS_RECONNECT_MAX_S": "1"})
    with pytest.raises(ConfigError, match="FORKLESS_DEMO_STREAMS"):
        Config.from_env({"FORKLESS_DEMO_STREAMS": "10", "FORKLESS_MAX_STREAMS": "5"})


def test_subscribe_can_name_a_file(tmp_path):
    path = tmp_path / "sub.json"
    path.write_text('{"op": "subscribe", "channels": ["a"]}')
    assert Config.from_env({"FORKLESS_SUBSCRIBE": f"@{path}"}).subscribe == path.read_text()


def test_secrets_stay_out_of_repr():
    c = Config(auth_token="s3cr3t-token", headers=(("X-Api-Key", "k3y-value"),),
               subscribe='{"op": "auth", "key": "subscr1be-key"}')
    assert "s3cr3t" not in repr(c) and "k3y-value" not in repr(c) and "subscr1be" not in repr(c)


def test_a_config_built_in_code_is_validated_too():
    with pytest.raises(ConfigError, match="FORKLESS_MAX_BATCH"):
        Config(max_batch=0)


@pytest.mark.parametrize("name", ["FORKLESS_FEATURES", "FORKLESS_WS_URL", "FORKLESS_OVERFLOW", "FORKLESS_DURATION"])
def test_the_app_exits_2_naming_the_bad_variable_before_starting(name):
    proc = run_app(env={name: BAD[name]})
    assert proc.returncode == 2
    assert name in proc.stderr and repr(BAD[name]) in proc.stderr
    assert proc.stdout == ""  # nothing ran: no status line


def test_help_lists_every_variable_with_its_default():
    proc = run_app("--help")
    assert proc.returncode == 0
    for var in VARIABLES:
        assert var.env in proc.stdout
    assert "default 0.05" in proc.stdout and "default 4096" in proc.stdout


def test_an_unknown_forkless_variable_is_warned_about():
    proc = run_app(env={"FORKLESS_FEATURE": "8", "FORKLESS_FEATURES": "0"})
    assert "FORKLESS_FEATURE is not a forkless variable" in proc.stderr and proc.returncode == 2


def test_devices_is_all_or_a_count():
    assert Config().devices == "all"
    assert Config.from_env({"FORKLESS_DEVICES": " ALL "}).devices == "all"
    assert Config.from_env({"FORKLESS_DEVICES": "4"}).devices == 4
    for bad in ("0", "two", "1.5", ""):
        with pytest.raises(ConfigError, match=r"FORKLESS_DEVICES=.* expected all, or an integer from 1 to 4096"):
            Config.from_env({"FORKLESS_DEVICES": bad})


def test_the_io_settings_carry_the_configuration_s_values_by_the_same_names():
    import dataclasses

    from io_loop.settings import IOSettings

    cfg = Config(ws_url="wss://127.0.0.1:9/feed", subscribe='{"s": 1}', auth_token="t", max_batch=16, stale_s=3.0,
                 metrics_addr="127.0.0.1:0", reconnect_tries=4)
    settings = cfg.io_settings()
    for f in dataclasses.fields(IOSettings):
        if f.name != "feeds_from_list":
            assert getattr(settings, f.name) == getattr(cfg, f.name), f.name
    assert settings.feed_specs == cfg.feed_specs and not settings.feeds_from_list and not settings.uses_demo_feed
    assert "auth_token" not in repr(settings) and '{"s": 1}' not in repr(settings)  # secrets stay out of repr
    several = Config(feeds='[{"url": "ws://127.0.0.1:9/a", "name": "a"}, {"url": "ws://127.0.0.1:9/b"}]')
    assert several.io_settings().feeds_from_list and len(several.io_settings().feed_specs) == 2
