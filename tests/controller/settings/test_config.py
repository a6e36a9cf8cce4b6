"""Configuration from FORKLESS_* variables: defaults, clear errors, exit status 2, --help."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forkless
from forkless import (
    CheckpointSettings,
    Credentials,
    DemoSettings,
    DetectorSettings,
    Limits,
    PartitionSettings,
    ReconnectSettings,
    StepSettings,
    Timeouts,
)
from forkless.controller.commands.edge import load_config
from forkless.controller.commands.relaycmd import relay_settings
from forkless.controller.config import GROUPS, VARIABLES, Config
from forkless.io_loop.connectors.jetstream.partitions import instance_share
from forkless.io_loop.errors import ConfigError
from forkless.io_loop.settings import as_text, settings_of
from tests.harness import run_app

# one bad value for every variable that can be wrong
BAD = {
    "FORKLESS_WS_URL": "http://example.com/feed",
    "FORKLESS_WS_UNIX_SOCKET": "relative/feed.sock",
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
    "FORKLESS_STEPS_IN_FLIGHT": "0",
    "FORKLESS_HANDOFF": "yield",
    "FORKLESS_QUEUE_SIZE": "0",
    "FORKLESS_OVERFLOW": "drop_newest",
    "FORKLESS_SOURCE_BUFFER": "-1",
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
    "FORKLESS_LOSSY_STOP_EXIT": "126",
    "FORKLESS_STATUS_S": "-1",
    "FORKLESS_LOG_LEVEL": "LOUD",
    "FORKLESS_LOG_FORMAT": "xml",
    "FORKLESS_METRICS_ADDR": "9464",
    "FORKLESS_DEMO_RATE": "0",
    "FORKLESS_DEMO_STREAMS": "0",
    "FORKLESS_DEMO_UNIX_SOCKET": "/no/such/directory/demo.sock",
    "FORKLESS_CHECKPOINT_DIR": "/dev/null",
    "FORKLESS_CHECKPOINT_S": "0",
    "FORKLESS_CHECKPOINT_KEEP": "0",
    "FORKLESS_CHECKPOINT_RESTORE": "always",
    "FORKLESS_CHECKPOINT_PRIORITY": "low",
    "FORKLESS_CHECKPOINT_BUCKET": "ckpt.bucket",
    "FORKLESS_INSTANCE": "-1",
    "FORKLESS_INSTANCES": "0",
    "FORKLESS_LEASE_S": "0",
    "FORKLESS_LEASE_BUCKET": "forkless leases",
    "FORKLESS_RELAY_NATS": "http://127.0.0.1:4222",
    "FORKLESS_RELAY_SUBJECT": "ticks.*",
    "FORKLESS_RELAY_CREDS": "/no/such.creds",
    "FORKLESS_RELAY_SEQ": "global",
    "FORKLESS_RELAY_MAX_HELD": "0",
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
    # the demo feed's settings are checked where it runs (the program, a controller that runs it),
    # not by the configuration alone: an embedding program's own sources run instead of it
    small = Config.from_env({"FORKLESS_DEMO_STREAMS": "10", "FORKLESS_MAX_STREAMS": "5"})
    with pytest.raises(ConfigError, match="FORKLESS_DEMO_STREAMS"):
        small.check_demo_feed()
    with pytest.raises(ConfigError, match="FORKLESS_DEMO_STREAMS"):
        load_config({"FORKLESS_DEMO_STREAMS": "10", "FORKLESS_MAX_STREAMS": "5"})
    load_config({"FORKLESS_DEMO_STREAMS": "10", "FORKLESS_MAX_STREAMS": "5", "FORKLESS_WS_URL": "ws://h/"})


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


# a value of the wrong type given in code: checked as it is (not written as text and read back, where
# True passed as 1 and 1 as True, and malformed header pairs raised a bare ValueError)
WRONG_TYPES = [
    ({"features": "8"}, "FORKLESS_FEATURES", "'8'", "in code an integer, not a str"),
    ({"max_batch": 2.5}, "FORKLESS_MAX_BATCH", "'2.5'", "in code an integer, not a float"),
    ({"features": True}, "FORKLESS_FEATURES", "'1'", "in code an integer, not a bool"),
    ({"alpha": True}, "FORKLESS_ALPHA", "'1'", "in code a number, not a bool"),
    ({"alpha": 1 + 0j}, "FORKLESS_ALPHA", "'(1+0j)'", "in code a number, not a complex"),
    ({"stream_idle_s": "5"}, "FORKLESS_STREAM_IDLE_S", "'5'", "in code a number or None, not a str"),
    ({"devices": 8.0}, "FORKLESS_DEVICES", "'8.0'", "in code 'all' or an integer, not a float"),
    ({"tls_insecure": 1}, "FORKLESS_TLS_INSECURE", "'1'", "in code True or False, not an int"),
    ({"log_level": None}, "FORKLESS_LOG_LEVEL", "''", "in code a str, not None"),
    ({"ws_url": 1}, "FORKLESS_WS_URL", "'1'", "in code a str, not an int"),
    ({"auth_token": 12345}, "FORKLESS_AUTH_TOKEN", "'<hidden>'", "in code a str, not an int"),
    ({"headers": [("X-Key", "k3y")]}, "FORKLESS_HEADERS", "'<hidden>'", "not a list"),
    ({"headers": (("X-Key",),)}, "FORKLESS_HEADERS", "'<hidden>'", "expected a JSON object of string values"),
]


@pytest.mark.parametrize(("changes", "name", "shown", "detail"), WRONG_TYPES,
                         ids=[next(iter(c)) + "=" + repr(next(iter(c.values()))) for c, *_ in WRONG_TYPES])
def test_a_value_of_the_wrong_type_in_code_is_a_config_error_naming_the_variable_and_the_types(
        changes, name, shown, detail):
    with pytest.raises(ConfigError) as err:
        Config(**changes)
    assert err.value.variable == name
    assert str(err.value).startswith(f"{name}={shown} is invalid: expected ") and detail in str(err.value), err.value
    assert "k3y" not in str(err.value) and "12345" not in str(err.value)


def test_a_value_given_in_code_is_kept_in_its_plain_python_type_when_its_type_is_right():
    cfg = Config(alpha=1, stream_idle_s=0, duration_s=2, devices=2, steps_in_flight=3, tls_insecure=True)
    assert (cfg.alpha, cfg.stream_idle_s, cfg.duration_s, cfg.devices, cfg.steps_in_flight) == (1, 0, 2, 2, 3)
    assert type(cfg.alpha) is float and type(cfg.devices) is int
    # a text variable's value is the text its variable would hold: no surrounding spaces, no @path read
    for changes in ({"ws_url": " ws://127.0.0.1:9/feed"}, {"log_level": "info"}, {"subscribe": "@/etc/hostname"}):
        with pytest.raises(ConfigError):
            Config(**changes)


def test_every_default_is_written_as_text_that_reads_back_as_it():
    # what --help and --check show for a default (as_text) is the variable's own text for it
    defaults = Config()
    for var in VARIABLES:
        value = getattr(defaults, var.keyword)
        assert value == var.default and var.check(value) == value, var.env
        assert var.parse(as_text(value)) == value, var.env


def test_a_number_in_code_may_be_any_real_number_and_an_integer_any_integral_one():
    numpy = pytest.importorskip("numpy")
    from fractions import Fraction

    cfg = Config(alpha=Fraction(1, 20), threshold=numpy.float32(3.5), features=numpy.int64(4),
                 max_wait_ms=numpy.int16(3), stream_idle_s=Fraction(3, 2), devices=numpy.uint8(1))
    assert (cfg.alpha, cfg.threshold, cfg.features, cfg.max_wait_ms, cfg.stream_idle_s, cfg.devices) == (
        0.05, 3.5, 4, 3.0, 1.5, 1)
    assert [type(v) for v in (cfg.alpha, cfg.threshold, cfg.features, cfg.max_wait_ms, cfg.devices)] == [
        float, float, int, float, int]  # kept as plain Python numbers: a Config is JSON-able, hashable, comparable
    for bad, allowed in (({"features": numpy.float64(4.0)}, "in code an integer, not a float64"),
                         ({"features": numpy.bool_(True)}, "in code an integer, not a bool"),
                         ({"threshold": numpy.float64("nan")}, "a number > 0"),
                         ({"max_streams": numpy.int64(0)}, "an integer from 1 to 10000000")):
        with pytest.raises(ConfigError, match=allowed):
            Config(**bad)


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


def test_steps_in_flight_is_auto_or_a_count():
    assert Config().steps_in_flight == "auto"
    assert Config.from_env({"FORKLESS_STEPS_IN_FLIGHT": " Auto "}).steps_in_flight == "auto"
    assert Config.from_env({"FORKLESS_STEPS_IN_FLIGHT": "3"}).steps_in_flight == 3
    for bad in ("0", "65", "two", "1.5", ""):
        with pytest.raises(ConfigError, match=r"FORKLESS_STEPS_IN_FLIGHT=.* expected auto, or an integer from 1 to 64"):
            Config.from_env({"FORKLESS_STEPS_IN_FLIGHT": bad})


def test_the_io_settings_carry_the_configuration_s_groups_and_what_a_source_reads_of_the_others():
    from forkless.io_loop.iosettings import IOSettings

    cfg = Config(ws_url="wss://127.0.0.1:9/feed", subscribe='{"s": 1}', auth_token="t", max_batch=16, stale_s=3.0,
                 metrics_addr="127.0.0.1:0", reconnect_tries=4, reconnect_min_s=0.25, tls_insecure=True,
                 demo_rate=50.0, warmup=7, lease_s=3.0)
    settings = cfg.io_settings()
    groups = {f.name for f in dataclasses.fields(IOSettings)} & set(GROUPS)
    assert groups == {"reconnect", "timeouts", "tls", "credentials", "limits", "demo", "partitioning"}
    for name in groups:
        assert getattr(settings, name) == getattr(cfg, name), name
    # the names that differ from the variables' say which they come from
    assert (settings.reconnect.min_s, settings.reconnect.tries, settings.tls.insecure) == (0.25, 4, True)
    assert (settings.demo.rate, settings.warmup) == (50.0, 7)  # anomalies planted once the detector is warm
    assert (settings.timeouts.stale_s, settings.max_batch, settings.partitioning.lease_s) == (3.0, 16, 3.0)
    assert settings.metrics_addr == cfg.metrics_addr and settings.feed_fatal == cfg.feed_fatal
    assert settings.feed_specs == cfg.feed_specs and not settings.feeds_from_list and not settings.uses_demo_feed
    assert "auth_token" not in repr(settings) and '{"s": 1}' not in repr(settings)  # secrets stay out of repr
    assert "'t'" not in repr(settings.credentials)
    several = Config(feeds='[{"url": "ws://127.0.0.1:9/a", "name": "a"}, {"url": "ws://127.0.0.1:9/b"}]')
    assert several.io_settings().feeds_from_list and len(several.io_settings().feed_specs) == 2


# ---- partitioned JetStream feeds (docs/partitions.md) ------------------------------------------------


def _partitioned(**fields) -> str:
    entry = {"name": "ticks", "nats": "nats://127.0.0.1:4222", "stream": "TICKS", "subject": "ticks.{partition}.>",
             "results": "scores", "partition_count": 12}
    return json.dumps([{**entry, **fields}])


def test_a_partitioned_feed_consumes_the_subjects_of_the_partitions_its_entry_names():
    spec = Config.from_env({"FORKLESS_FEEDS": _partitioned(partitions="0-2, 7,9-10")}).feed_specs[0].options
    assert spec.partitioned and (spec.partition_count, spec.partitions) == (12, (0, 1, 2, 7, 9, 10))
    assert spec.subjects() == ("ticks.0.>", "ticks.1.>", "ticks.2.>", "ticks.7.>", "ticks.9.>", "ticks.10.>")


def test_instance_and_instances_give_a_partitioned_feed_its_contiguous_share():
    env = {"FORKLESS_FEEDS": _partitioned(), "FORKLESS_INSTANCES": "5"}
    shares = [Config.from_env({**env, "FORKLESS_INSTANCE": str(i)}).feed_specs[0].options.partitions
              for i in range(5)]
    assert shares == [(0, 1), (2, 3), (4, 5, 6), (7, 8), (9, 10, 11)]  # [i*12//5, (i+1)*12//5)
    cfg = Config.from_env({**env, "FORKLESS_INSTANCE": "4"})
    assert (cfg.instance, cfg.instances) == (4, 5)


def test_the_partition_of_a_delivered_subject_is_read_where_the_subject_has_the_placeholder():
    spec = Config.from_env({"FORKLESS_FEEDS": _partitioned(subject="md.*.{partition}.>", partitions="0")}
                           ).feed_specs[0].options
    assert spec.partition_of_subject("md.eu.11.BTC~2DUSD") == 11
    assert spec.partition_of_subject("md.us.0.x.y") == 0
    for bad in ("md.eu.12.x", "md.eu.x.y", "md.eu.07.x", "md.eu", "md.eu.-1.x"):
        with pytest.raises(ValueError, match="no partition 0-11"):
            spec.partition_of_subject(bad)


def test_a_feed_that_is_not_partitioned_has_its_subject_or_the_whole_stream():
    feeds = [{"name": "a", "nats": "nats://h:1", "stream": "A", "subject": "a.>", "results": "r"}]
    spec = Config.from_env({"FORKLESS_FEEDS": json.dumps(feeds)}).feed_specs[0].options
    assert not spec.partitioned and spec.subjects() == ("a.>",) and spec.partitions == ()
    with pytest.raises(ValueError, match="not consumed by partition"):
        spec.partition_of_subject("a.1")
    whole = Config.from_env({"FORKLESS_FEEDS": json.dumps([{**feeds[0], "subject": ""}])}).feed_specs[0].options
    assert whole.subjects() == ()


@pytest.mark.parametrize(("fields", "expected"), [
    ({"partition_count": 0}, '"partition_count" must be an integer from 1 to 65536'),
    ({"partition_count": 65537}, '"partition_count" must be an integer from 1 to 65536'),
    ({"partition_count": "12"}, '"partition_count" must be an integer from 1 to 65536'),
    ({"partition_count": True}, '"partition_count" must be an integer from 1 to 65536'),
    ({"subject": "ticks.>"}, '"subject" of a partitioned feed must hold {partition} once, as one whole token'),
    ({"subject": "ticks.p{partition}.>"}, '"subject" of a partitioned feed must hold {partition} once'),
    ({"subject": "{partition}.{partition}"}, '"subject" of a partitioned feed must hold {partition} once'),
    ({"subject": ""}, '"subject" of a partitioned feed must hold {partition} once'),
    ({"subject": "ticks.>.{partition}"}, '"subject" must be a NATS subject filter'),
    ({"partitions": "0-12"}, '"partitions" must be partitions and ranges of 0-11, such as "0-5" or "0,2,7-9": '
                             "partition 12 is outside 0-11"),
    ({"partitions": "5-3"}, "the range '5-3' goes backwards"),
    ({"partitions": "1,1"}, "partition 1 is given twice"),
    ({"partitions": "one"}, "'one' is not a partition or a range a-b"),
    ({"partitions": [0, 1]}, '"partitions" must be a string of partitions and ranges'),
    ({"partition_count": None, "partitions": "0"}, '"partitions" needs "partition_count"'),
    ({"partition_count": None, "partitions": None},
     '"subject" holds {partition} but the feed has no "partition_count"'),
])
def test_a_bad_partitioned_entry_names_the_feed_and_the_field(fields, expected):
    entry = json.loads(_partitioned(**{"partitions": "0-5", **fields}))[0]
    entry = {k: v for k, v in entry.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        Config.from_env({"FORKLESS_FEEDS": json.dumps([entry])})
    assert err.value.variable == "FORKLESS_FEEDS" and "feed 0 ('ticks')" in str(err.value), str(err.value)
    assert expected in str(err.value), str(err.value)


@pytest.mark.parametrize(("env", "variable", "expected"), [
    ({"FORKLESS_FEEDS": _partitioned()}, "FORKLESS_FEEDS",
     'feed 0 (\'ticks\'): a partitioned feed ("partition_count") needs the partitions this instance owns: '
     '"partitions" in the entry (such as "0-5"), or FORKLESS_INSTANCE and FORKLESS_INSTANCES'),
    ({"FORKLESS_FEEDS": _partitioned(partitions="0-5"), "FORKLESS_INSTANCE": "0", "FORKLESS_INSTANCES": "2"},
     "FORKLESS_INSTANCE", 'names its "partitions": either the entry\'s partitions or this instance\'s share'),
    ({"FORKLESS_FEEDS": _partitioned(), "FORKLESS_INSTANCE": "1"}, "FORKLESS_INSTANCE",
     "set together with FORKLESS_INSTANCES (both or neither)"),
    ({"FORKLESS_FEEDS": _partitioned(), "FORKLESS_INSTANCES": "2"}, "FORKLESS_INSTANCES",
     "set together with FORKLESS_INSTANCE (both or neither)"),
    ({"FORKLESS_FEEDS": _partitioned(), "FORKLESS_INSTANCE": "3", "FORKLESS_INSTANCES": "3"}, "FORKLESS_INSTANCE",
     "an integer from 0 to FORKLESS_INSTANCES - 1 = 2"),
    ({"FORKLESS_FEEDS": _partitioned(), "FORKLESS_INSTANCE": "0", "FORKLESS_INSTANCES": "13"}, "FORKLESS_INSTANCES",
     "at most the partition_count of feed 0 ('ticks') of FORKLESS_FEEDS (12): 13 instances for 12 partitions"),
    ({"FORKLESS_INSTANCE": "0", "FORKLESS_INSTANCES": "1"}, "FORKLESS_INSTANCE",
     "without a partitioned JetStream feed"),
    ({"FORKLESS_CHECKPOINT_BUCKET": "ckpt"}, "FORKLESS_CHECKPOINT_BUCKET",
     'a partitioned JetStream feed (a FORKLESS_FEEDS entry with "partition_count"), whose server holds the bucket'),
    ({"FORKLESS_FEEDS": _partitioned(partitions="0"), "FORKLESS_CHECKPOINT_BUCKET": "ckpt",
      "FORKLESS_CHECKPOINT_DIR": "/tmp"}, "FORKLESS_CHECKPOINT_BUCKET",
     "either FORKLESS_CHECKPOINT_BUCKET (a partitioned feed's checkpoints) or FORKLESS_CHECKPOINT_DIR, not both"),
    ({"FORKLESS_FEEDS": _partitioned(partitions="0"), "FORKLESS_CHECKPOINT_DIR": "/tmp"}, "FORKLESS_CHECKPOINT_DIR",
     "empty with a partitioned feed (feed 'ticks' (nats://127.0.0.1:4222)): its checkpoints are kept per partition "
     "in FORKLESS_CHECKPOINT_BUCKET"),
    ({"FORKLESS_FEEDS": json.dumps([*json.loads(_partitioned(partitions="0")), {"url": "ws://127.0.0.1:9/f"}])},
     "FORKLESS_FEEDS", "feed 0 ('ticks') is partitioned (\"partition_count\"), so it must be the only feed of the "
     "process (2 are given)"),
])
def test_a_partitioned_configuration_that_does_not_add_up_names_the_variable(env, variable, expected):
    with pytest.raises(ConfigError) as err:
        Config.from_env(env)
    assert err.value.variable == variable and expected in str(err.value), str(err.value)


def test_the_checkpoint_bucket_turns_checkpoints_on_and_the_leases_have_their_defaults():
    cfg = Config.from_env({"FORKLESS_FEEDS": _partitioned(partitions="0-11"), "FORKLESS_CHECKPOINT_BUCKET": "ckpt"})
    assert cfg.checkpoints_on and (cfg.checkpoint_bucket, cfg.checkpoint_dir) == ("ckpt", "")
    assert (cfg.lease_s, cfg.lease_bucket, cfg.instance, cfg.instances) == (10.0, "forkless-leases", None, None)
    assert cfg.partitioning == PartitionSettings(checkpoint_bucket="ckpt")
    io = cfg.io_settings().partitioning
    assert (io.checkpoint_bucket, io.lease_s, io.lease_bucket) == ("ckpt", 10.0, "forkless-leases")
    tuned = Config.from_env({"FORKLESS_FEEDS": _partitioned(partitions="3"), "FORKLESS_LEASE_S": "2.5",
                             "FORKLESS_LEASE_BUCKET": "my_leases-1"})
    assert (tuned.lease_s, tuned.lease_bucket, tuned.checkpoints_on) == (2.5, "my_leases-1", False)


def test_the_app_exits_2_when_a_partitioned_feed_is_given_its_partitions_twice():
    proc = run_app(env={"FORKLESS_FEEDS": _partitioned(partitions="0-5"), "FORKLESS_INSTANCE": "0",
                        "FORKLESS_INSTANCES": "2"})
    assert proc.returncode == 2
    assert "FORKLESS_INSTANCE='0' is invalid" in proc.stderr and '"partitions"' in proc.stderr
    assert proc.stdout == ""


@settings(max_examples=300, deadline=None)
@given(count=st.integers(1, 40), instances=st.integers(-2, 45), instance=st.integers(-2, 45))
def test_any_instance_numbering_is_its_share_or_refused_naming_the_variable(count, instances, instance):
    env = {"FORKLESS_FEEDS": _partitioned(partition_count=count), "FORKLESS_INSTANCE": str(instance),
           "FORKLESS_INSTANCES": str(instances)}
    try:
        cfg = Config.from_env(env)
    except ConfigError as exc:
        assert exc.variable in ("FORKLESS_INSTANCE", "FORKLESS_INSTANCES")
        assert not (0 <= instance < instances <= count)
    else:
        assert 0 <= instance < instances <= count
        assert cfg.feed_specs[0].options.partitions == instance_share(instance, instances, count)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="0123456789-, x", max_size=12), count=st.integers(1, 20))
def test_any_partitions_text_is_parsed_or_refused_naming_the_feed(text, count):
    try:
        cfg = Config.from_env({"FORKLESS_FEEDS": _partitioned(partition_count=count, partitions=text)})
    except ConfigError as exc:
        assert exc.variable == "FORKLESS_FEEDS" and "feed 0 ('ticks'): \"partitions\"" in str(exc)
    else:
        owned = cfg.feed_specs[0].options.partitions
        assert owned and list(owned) == sorted(set(owned)) and all(0 <= p < count for p in owned)


def test_the_relays_bound_on_held_messages_is_its_own_variable_not_the_batch_size() -> None:
    """FORKLESS_RELAY_MAX_HELD bounds the relay's held messages; FORKLESS_MAX_BATCH, the micro-batch's
    size, no longer does (its default, 256, is the bound's)."""
    env = {"FORKLESS_RELAY_NATS": "nats://127.0.0.1:4222", "FORKLESS_RELAY_SUBJECT": "relayed"}
    assert Config.from_env(env).relay.max_held == 256
    assert Config.from_env({**env, "FORKLESS_MAX_BATCH": "8"}).relay.max_held == 256
    assert Config.from_env({**env, "FORKLESS_RELAY_MAX_HELD": "3"}).relay.max_held == 3
    assert all(spec.replies == "none" for spec in relay_settings(Config.from_env(env)).feed_specs)
    with pytest.raises(ConfigError, match=r"FORKLESS_RELAY_MAX_HELD='0'.*an integer from 1 to 1000000"):
        Config.from_env({**env, "FORKLESS_RELAY_MAX_HELD": "0"})


# ---- settings as value objects (forkless.Timeouts, forkless.Limits …: issue 56 item 4) ----------------------


def test_every_settings_group_is_public_and_declares_each_setting_once():
    keywords = []
    for argument, group in GROUPS.items():
        assert getattr(forkless, group.__name__) is group, group  # one import path: forkless.<Group>
        built = group()  # every field has a default: a group is built with only what differs
        for declared in settings_of(group):
            assert getattr(built, declared.field) == declared.default, declared.env
            keywords.append(declared.keyword)
        assert getattr(Config(), argument) == built, argument  # and Config gives each back
    assert sorted(keywords) == sorted(var.keyword for var in VARIABLES) and len(set(keywords)) == len(VARIABLES) == 60
    assert [field.name for field in dataclasses.fields(Config)] == list(GROUPS)  # a Config is its groups


def test_a_config_is_built_from_groups_and_fields_each_group_giving_only_the_fields_it_was_built_with():
    cfg = Config(features=4, reconnect=ReconnectSettings(max_s=60.0), limits=Limits(queue_size=64),
                 checkpoints=CheckpointSettings(dir="", keep=5), timeouts=Timeouts(stale_s=30.0))
    assert (cfg.features, cfg.queue_size, cfg.reconnect_max_s, cfg.reconnect_min_s) == (4, 64, 60.0, 0.5)
    assert (cfg.checkpoint_keep, cfg.stale_s, cfg.heartbeat_s) == (5, 30.0, 15.0)
    assert cfg.limits == Limits(queue_size=64, overflow="block", max_msg_bytes=1 << 20, source_buffer=20_000)
    assert cfg.reconnect == ReconnectSettings(min_s=0.5, max_s=60.0, reset_s=5.0, tries=0)
    assert cfg.step == StepSettings(features=4)
    assert cfg == Config(features=4, reconnect_max_s=60.0, queue_size=64, checkpoint_keep=5, stale_s=30.0)
    # a group read back from one Config builds another as it was (it was built with every field)
    assert Config(reconnect=cfg.reconnect, limits=cfg.limits).queue_size == 64


def test_replace_and_the_environment_loader_take_groups_and_a_group_given_in_code_wins_over_the_environment():
    cfg = Config(features=4).replace(timeouts=Timeouts(stale_s=3.0))
    assert (cfg.features, cfg.stale_s) == (4, 3.0)
    assert cfg.replace(stale_s=4.0, connect_timeout_s=2.0).timeouts == Timeouts(stale_s=4.0, connect_timeout_s=2.0)
    env = {"FORKLESS_RECONNECT_MAX_S": "9", "FORKLESS_RECONNECT_TRIES": "2"}
    loaded = Config.from_env(env, reconnect=ReconnectSettings(max_s=61.0))
    assert (loaded.reconnect_max_s, loaded.reconnect_tries) == (61.0, 2)  # what the group was not built with: env


def test_a_field_given_twice_with_two_values_an_unknown_keyword_or_a_group_of_the_wrong_kind_is_a_type_error():
    with pytest.raises(TypeError, match=r"two values for features: as features= and as "
                                        r"step=StepSettings\(features=\.\.\.\); give it once"):
        Config(features=4, step=StepSettings(features=8))
    with pytest.raises(TypeError, match=r"two values for auth_token: .*; give it once") as raised:
        Config(auth_token="token-a", credentials=Credentials(auth_token="token-b"))
    assert "token-a" not in str(raised.value) and "token-b" not in str(raised.value)  # secrets never shown
    with pytest.raises(TypeError, match=r"Config\(reconnect=\.\.\.\) takes a forkless\.ReconnectSettings .*not dict"):
        Config(reconnect={"max_s": 60.0})
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'featurs': did you mean 'features'\?"):
        Config(featurs=4)
    assert Config(features=4, step=StepSettings(features=4)).features == 4  # twice, the same value: fine


def test_a_bad_value_in_a_group_is_a_config_error_naming_its_variable_where_the_group_is_made():
    with pytest.raises(ConfigError, match=r"FORKLESS_RECONNECT_MIN_S='-1.0' is invalid: expected a number > 0"):
        ReconnectSettings(min_s=-1.0)
    with pytest.raises(ConfigError, match=r"FORKLESS_RECONNECT_MAX_S='0.1' is invalid: expected a number >= "
                                          r"FORKLESS_RECONNECT_MIN_S \(0.5\)"):
        ReconnectSettings(max_s=0.1)


# a setting that moved to another group: its old spelling works for one release, with a DeprecationWarning naming
# the new one (the one policy, io_loop/renamed.py; tests/controller/test_renamed.py holds its removal)
MOVED = [
    (Limits, "features", 4, "StepSettings(features=...)", "step"),
    (Limits, "max_batch", 16, "StepSettings(max_batch=...)", "step"),
    (DemoSettings, "features", 4, "StepSettings(features=...)", "step"),
    (DemoSettings, "warmup", 3, "DetectorSettings(warmup=...)", "detector"),
    (CheckpointSettings, "bucket", "ckpt", "PartitionSettings(checkpoint_bucket=...)", "partitioning"),
]


@pytest.mark.parametrize(("group", "old", "value", "spelling", "home"), MOVED,
                         ids=[f"{g.__name__}.{old}" for g, old, *_ in MOVED])
def test_a_moved_field_warns_naming_its_new_spelling_and_still_takes_its_value(group, old, value, spelling, home):
    with pytest.warns(DeprecationWarning, match=re.escape(f"{group.__name__}({old}=...) is deprecated since forkless "
                                                          f"0.3.0 and is removed in 0.4.0: write {spelling}")):
        given = group(**{old: value})
    argument = next(name for name, kind in GROUPS.items() if kind is group)
    keyword = {"bucket": "checkpoint_bucket"}.get(old, old)
    if keyword == "checkpoint_bucket":  # a bucket goes with a partitioned feed only: the moved value reaches it
        with pytest.raises(ConfigError, match="FORKLESS_CHECKPOINT_BUCKET"):
            Config(**{argument: given})
        return
    cfg = Config(**{argument: given})
    assert getattr(getattr(cfg, home), keyword) == value
    with pytest.warns(DeprecationWarning, match=re.escape(f"{group.__name__}.{old} is deprecated")):
        assert getattr(getattr(cfg, argument), old) == value  # read back where it was, for one release
    assert isinstance(getattr(forkless, spelling.split("(")[0]), type)
    assert DetectorSettings().warmup == 20


def test_what_built_a_group_of_the_config_warns_naming_the_group():
    cfg = Config(features=3, checkpoint_dir="", relay_nats="nats://127.0.0.1:4222", relay_subject="md")
    with pytest.warns(DeprecationWarning, match=re.escape("config.step_settings() is deprecated")):
        assert cfg.step_settings() == cfg.step
    with pytest.warns(DeprecationWarning, match=re.escape("write config.checkpoints")):
        assert cfg.checkpoint_settings() == cfg.checkpoints
    with pytest.warns(DeprecationWarning, match=re.escape("write config.relay")):
        io, relay = cfg.relay_settings()
    assert relay == cfg.relay and all(spec.replies == "none" for spec in io.feed_specs)
