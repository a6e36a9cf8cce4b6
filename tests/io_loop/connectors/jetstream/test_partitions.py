"""io_loop/connectors/jetstream/partitions.py: stream names as subject tokens, the partition function (proven against a
real nats-server's ``{{partition(P,1)}}`` subject transform), partition ranges, instance shares,
and the arithmetic of the kit's partitioned StatefulSet (deploy/kubernetes/partitioned.yaml)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import pytest

from forkless.io_loop.connectors.jetstream.partitions import (
    PartitionTransform,
    escape_stream,
    format_partitions,
    instance_share,
    parse_partitions,
    partition_of,
    partition_transform,
    partitions_of,
    transform_problems,
    unescape_stream,
)
from tests.harness import UNIT_S, run_app

ROOT = Path(__file__).resolve().parents[4]

# names a relay meets: plain, dotted, NATS wildcards, spaces, the escape character itself, non-ASCII
AWKWARD = ["BTC-USD", "btc_usd", "a.b", "...", "*", ">", "a*b>c", "two words", " ", "~", "~41", "~~", "%41",
           "café", "東京", "🚀", "Ünïcödé.x", "tab\there", "new\nline", "a/b\\c", "{partition}", "x" * 200, "0", "-"]


def _names(count: int, seed: int) -> list[str]:
    """``AWKWARD`` and random names over a broad alphabet, all different."""
    rng = random.Random(seed)
    alphabet = "abcXYZ019_-.*> ~/é東🚀\t"
    names = list(AWKWARD)
    while len(names) < count:
        name = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))
        if name not in names:
            names.append(name)
    return names


# ---- escaping ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", AWKWARD)
def test_a_stream_name_escapes_to_one_subject_token_and_back(name):
    token = escape_stream(name)
    assert re.fullmatch(r"[A-Za-z0-9_~-]+", token), token  # one token: no '.', '*', '>', space
    assert unescape_stream(token) == name


def test_plain_names_stay_as_they_are_and_everything_else_is_tilde_hex_of_its_utf8_bytes():
    assert escape_stream("BTC-USD_1") == "BTC-USD_1"
    assert escape_stream("a.b") == "a~2Eb"
    assert escape_stream("*>") == "~2A~3E"
    assert escape_stream("two words") == "two~20words"
    assert escape_stream("~41") == "~7E41"
    assert escape_stream("café") == "caf~C3~A9"


def test_random_names_round_trip_and_different_names_get_different_tokens():
    names = _names(2000, seed=5)
    tokens = [escape_stream(n) for n in names]
    assert len(set(tokens)) == len(names)
    assert [unescape_stream(t) for t in tokens] == names


@pytest.mark.parametrize(("token", "why"), [
    ("~4", "a '~' must be followed by two hex digits"),
    ("a~zz", "a '~' must be followed by two hex digits"),
    ("~c3~a9", "a '~' must be followed by two hex digits"),  # lower-case hex is not what escape_stream writes
    ("a.b", "'.' is escaped as ~XX"),
    ("a b", "' ' is escaped as ~XX"),
    ("~FF", "not UTF-8"),
    ("~41", "escapes a character that needs none"),
])
def test_a_token_escape_stream_did_not_make_is_refused(token, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        unescape_stream(token)


def test_an_empty_stream_name_has_no_token():
    with pytest.raises(ValueError, match="an empty stream name"):
        escape_stream("")


# ---- the partition function ---------------------------------------------------------------------------


def test_the_partition_function_is_fnv1a_32_modulo_the_count():
    # FNV-1a 32 reference values: "" -> 0x811c9dc5, "a" -> 0xe40c292c, "foobar" -> 0xbf9cf968
    assert partition_of("", 1 << 32) == 0x811C9DC5
    assert partition_of("a", 1 << 32) == 0xE40C292C
    assert partition_of("foobar", 1000) == 0xBF9CF968 % 1000
    assert partition_of("a", 1) == 0


def test_partitions_of_many_names_agrees_with_partition_of_each():
    names = _names(3000, seed=6)
    for count in (1, 12, 4096):
        got = partitions_of(names, count)
        assert got.dtype.name == "int32"
        assert got.tolist() == [partition_of(escape_stream(n), count) for n in names]
    assert partitions_of([], 12).tolist() == []


def _transformed_stream(url: str, count: int, stream: str = "TICKS") -> None:
    from nats.js.api import SubjectTransform

    from tests.natsserver import create_streams

    create_streams(url, stream=stream, subjects=[f"{stream.lower()}.*"], results="",
                   subject_transform=SubjectTransform(
                       src=f"{stream.lower()}.*",
                       dest=f"{stream.lower()}.{{{{partition({count},1)}}}}.{{{{wildcard(1)}}}}"))


@pytest.mark.timeout(120 * UNIT_S)
@pytest.mark.parametrize("count", [12, 4096])
def test_the_servers_subject_transform_puts_every_stream_in_the_partition_partition_of_computes(nats_server, count):
    from tests.natsserver import publish, read_stream_subjects

    _transformed_stream(nats_server.url, count)
    names = _names(300, seed=count)
    publish(nats_server.url, lambda i: "ticks." + escape_stream(names[i]), [json.dumps({"stream": n}) for n in names])
    stored = read_stream_subjects(nats_server.url, "TICKS")
    assert len(stored) == len(names)
    by_server = {}
    for subject, data in stored:
        name = json.loads(data)["stream"]
        prefix, partition, token = subject.split(".")
        assert (prefix, token) == ("ticks", escape_stream(name))  # {{wildcard(1)}}: the token as published
        assert unescape_stream(token) == name
        by_server[name] = int(partition)
    ours = {name: partition_of(escape_stream(name), count) for name in names}
    differing = {name: (by_server[name], ours[name]) for name in names if by_server[name] != ours[name]}
    some = dict(list(differing.items())[:5])
    assert not differing, (f"nats-server's partition differs from io_loop/connectors/jetstream/partitions.py's for "
                           f"{len(differing)} "
                           f"of {len(names)} names (name: (server, ours)), such as {some}")
    assert partitions_of(names, count).tolist() == [by_server[n] for n in names]
    assert len(set(by_server.values())) > min(count, 300) // 2  # the names spread over the partitions


# ---- ranges and shares ----------------------------------------------------------------------------------


def test_partitions_are_ranges_and_lists_sorted():
    assert parse_partitions("0-5", 12) == (0, 1, 2, 3, 4, 5)
    assert parse_partitions(" 9 , 0 - 2,7", 12) == (0, 1, 2, 7, 9)
    assert parse_partitions("11", 12) == (11,)
    assert parse_partitions("0-65535", 65536) == tuple(range(65536))


@pytest.mark.parametrize(("text", "count", "why"), [
    ("", 12, "'' is not a partition or a range a-b"),
    ("a", 12, "'a' is not a partition or a range a-b"),
    ("1-", 12, "'1-' is not a partition or a range a-b"),
    ("-1", 12, "'-1' is not a partition or a range a-b"),
    ("1.5", 12, "'1.5' is not a partition or a range a-b"),
    ("0,,1", 12, "'' is not a partition or a range a-b"),
    ("5-3", 12, "the range '5-3' goes backwards"),
    ("12", 12, "partition 12 is outside 0-11 (partition_count is 12)"),
    ("0-12", 12, "partition 12 is outside 0-11"),
    ("1,1", 12, "partition 1 is given twice"),
    ("0-3,2", 12, "partition 2 is given twice"),
    ("0", 0, "partition_count must be at least 1"),
])
def test_a_bad_partitions_text_names_the_problem(text, count, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        parse_partitions(text, count)


@pytest.mark.parametrize("count", [1, 2, 3, 7, 12, 64, 257])
def test_every_number_of_instances_up_to_p_covers_every_partition_exactly_once_in_contiguous_shares(count):
    for instances in range(1, count + 1):
        shares = [instance_share(i, instances, count) for i in range(instances)]
        assert [p for share in shares for p in share] == list(range(count)), (count, instances)
        sizes = {len(share) for share in shares}
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1  # as even as it can be


def test_a_large_p_is_shared_the_same_way():
    for instances in (1, 2, 3, 5, 64, 1000, 4095, 4096):
        shares = [instance_share(i, instances, 4096) for i in range(instances)]
        assert [p for share in shares for p in share] == list(range(4096))


@pytest.mark.parametrize(("instance", "instances", "count", "why"), [
    (0, 13, 12, "13 instances for 12 partitions: some would own none"),
    (3, 3, 12, "instance 3 is not in 0-2"),
    (-1, 3, 12, "instance -1 is not in 0-2"),
])
def test_an_instance_outside_its_numbering_or_more_instances_than_partitions_is_refused(instance, instances, count,
                                                                                         why):
    with pytest.raises(ValueError, match=re.escape(why)):
        instance_share(instance, instances, count)


def test_partitions_are_written_back_as_the_ranges_they_are_parsed_from():
    assert format_partitions((0, 1, 2, 7, 9, 10)) == "0-2,7,9-10"
    assert format_partitions(()) == ""
    rng = random.Random(3)
    for _ in range(200):
        owned = tuple(sorted(rng.sample(range(40), rng.randint(1, 40))))
        assert parse_partitions(format_partitions(owned), 40) == owned


# ---- a stream's subject transform, as --check reads it -------------------------------------------------


@pytest.mark.parametrize(("dest", "expected"), [
    ("ticks.{{partition(12,1)}}.{{wildcard(1)}}", (12, 1, (1,))),
    ("ticks.{{ Partition( 64, 1 ) }}.$1", (64, 1, (1,))),
    ("{{partition(4096,2)}}.ticks.{{wildcard(2)}}", (4096, 0, (2,))),
    ("ticks.{{partition(12,1,2)}}.{{wildcard(1)}}", (12, 1, (1, 2))),
    ("ticks.p{{partition(12,1)}}.{{wildcard(1)}}", None),  # inside a longer token: written out literally
    ("ticks.{{PARTITION(12,1)}}.$1", None),  # the server knows "partition" and "Partition" only
    ("ticks.{{wildcard(1)}}", None),
    ("ticks.{{partition(x,1)}}", None),
])
def test_the_partition_token_of_a_transform_is_read_as_the_server_reads_it(dest, expected):
    found = partition_transform("ticks.*", dest)
    assert (None if found is None else (found.count, found.position, found.wildcards)) == expected


def test_a_transform_that_agrees_with_the_feed_has_no_problems():
    transform = partition_transform("ticks.*", "ticks.{{partition(12,1)}}.{{wildcard(1)}}")
    for subject in ("ticks.{partition}.>", "ticks.{partition}.*", "*.{partition}.>", "ticks.{partition}.BTC-USD"):
        assert transform_problems(subject, 12, transform) == [], subject
    deep = PartitionTransform("md.*.*", "md.{{wildcard(1)}}.{{partition(8,2)}}.>", 8, 2, (2,))
    assert transform_problems("md.*.{partition}.>", 8, deep) == []


@pytest.mark.parametrize(("subject", "count", "dest", "expected"), [
    ("ticks.{partition}.>", 8, "ticks.{{partition(12,1)}}.{{wildcard(1)}}",
     "makes 12 partitions, the feed's \"partition_count\" is 8"),
    ("ticks.{partition}.>", 12, "ticks.{{wildcard(1)}}.{{partition(12,1)}}",
     "the feed's subject 'ticks.{partition}.>' has {partition} at token 2, the subject transform 'ticks.*.*' -> "
     "'ticks.{{wildcard(1)}}.{{partition(12,1)}}' writes the partition at token 3"),
    ("md.{partition}.>", 12, "ticks.{{partition(12,1)}}.{{wildcard(1)}}",
     "the feed's subject 'md.{partition}.>' matches none of the subjects the subject transform"),
    ("ticks.{partition}", 12, "ticks.{{partition(12,1)}}.{{wildcard(1)}}", "matches none of the subjects"),
    ("ticks.{partition}.*.*", 12, "ticks.{{partition(12,1)}}.{{wildcard(1)}}", "matches none of the subjects"),
    ("ticks.{partition}.>", 12, "ticks.{{partition(12,1,2)}}.{{wildcard(1)}}",
     "hashes the source's wildcards 1, 2: forkless computes a stream's partition from its name's token alone"),
])
def test_a_transform_that_disagrees_with_the_feed_is_a_problem_naming_both(subject, count, dest, expected):
    problems = transform_problems(subject, count, partition_transform("ticks.*.*", dest))
    assert len(problems) == 1 and expected in problems[0], problems


def _probe(url: str, entry: dict, **config: object) -> tuple[list[str], str | None]:
    """``--check``'s network half for one feed (io_loop/probe.py), in this process: what it printed,
    and its failure (None when the feed passed)."""
    from forkless.controller.codec import JsonCodec
    from forkless.controller.commands.check import probe_feeds
    from forkless.controller.config import Config
    from forkless.io_loop.probe import ProbeFailed

    cfg = Config(feeds=json.dumps([{"name": "ticks", "nats": url, "results": "scores", **entry}]),
                 connect_timeout_s=5.0, **config)
    lines: list[str] = []
    try:
        probe_feeds(cfg.io_settings(), JsonCodec(cfg.features), lines.append)
    except ProbeFailed as exc:
        return lines, str(exc)
    return lines, None


def _check_streams(url: str) -> None:
    """Streams whose transforms agree with a P=12 feed, disagree, or are missing."""
    import asyncio

    import nats
    from nats.js.api import StreamConfig, StreamSource, SubjectTransform

    from tests.natsserver import create_streams

    create_streams(url, stream="", results="SCORES", results_subject="scores")

    def transformed(name: str, dest: str) -> StreamConfig:
        return StreamConfig(name=name.upper(), subjects=[f"{name}.*"],
                            subject_transform=SubjectTransform(src=f"{name}.*", dest=dest))

    async def body() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(transformed("ticks", "ticks.{{partition(12,1)}}.{{wildcard(1)}}"))
        await js.add_stream(transformed("eight", "eight.{{partition(8,1)}}.{{wildcard(1)}}"))
        await js.add_stream(transformed("shape", "shape.{{wildcard(1)}}.{{Partition(12,1)}}"))
        await js.add_stream(StreamConfig(name="PLAIN", subjects=["plain.>"]))
        await js.add_stream(StreamConfig(name="RAW", subjects=["raw.*"]))
        await js.add_stream(StreamConfig(name="SOURCED", sources=[StreamSource(name="RAW", subject_transforms=[
            SubjectTransform(src="raw.*", dest="src.{{partition(12,1)}}.{{wildcard(1)}}")])]))
        await nc.close()

    asyncio.run(body())


@pytest.mark.timeout(120 * UNIT_S)
def test_check_verifies_the_stream_s_partition_transform_against_the_feed_and_names_both_values(nats_server):
    _check_streams(nats_server.url)
    good = {"stream": "TICKS", "subject": "ticks.{partition}.>", "partition_count": 12}
    lines, failure = _probe(nats_server.url, {**good, "partitions": "4-7,11"})
    out = "\n".join(lines)
    assert failure is None, out
    assert ("partitioned by the stream's subject transform 'ticks.*' -> 'ticks.{{partition(12,1)}}.{{wildcard(1)}}': "
            '12 partitions, as the feed\'s "partition_count"') in out
    assert "this instance's partitions: 4-7,11 (5 of 12); consuming ticks.4.>, ticks.5.>, ticks.6.>, ticks.7.>, … " \
           "(5 subjects)" in out
    lines, failure = _probe(nats_server.url, {"stream": "SOURCED", "subject": "src.{partition}.>",
                                              "partition_count": 12, "partitions": "0"})
    assert failure is None and "partitioned by source 'RAW''s subject transform 'raw.*' -> " in "\n".join(lines)

    lines, failure = _probe(nats_server.url, {**good, "stream": "EIGHT", "subject": "eight.{partition}.>",
                                              "partitions": "0"})
    assert failure == ("stream 'EIGHT': the subject transform 'eight.*' -> 'eight.{{partition(8,1)}}.{{wildcard(1)}}' "
                       'makes 8 partitions, the feed\'s "partition_count" is 12')
    lines, failure = _probe(nats_server.url, {**good, "stream": "SHAPE", "subject": "shape.{partition}.>",
                                              "partitions": "0"})
    assert failure is not None and "has {partition} at token 2" in failure and "at token 3" in failure
    lines, failure = _probe(nats_server.url, {**good, "stream": "PLAIN", "subject": "plain.{partition}.>",
                                              "partitions": "0"})
    assert failure is not None and failure.startswith(
        "stream 'PLAIN' has no subject transform writing a partition (its subject transforms: none), but the "
        "feed's \"partition_count\" is 12")


@pytest.mark.timeout(120 * UNIT_S)
def test_check_says_whether_the_checkpoint_and_lease_buckets_exist(nats_server):
    import asyncio

    import nats

    _check_streams(nats_server.url)
    feed = {"stream": "TICKS", "subject": "ticks.{partition}.>", "partition_count": 12}
    lines, failure = _probe(nats_server.url, feed, instance=1, instances=3, checkpoint_bucket="ckpt")
    out = "\n".join(lines)
    assert failure is None, out
    assert "this instance's partitions: 4-7 (4 of 12)" in out
    assert "checkpoint bucket 'ckpt' (object store): does not exist yet; the first instance to start creates it" in out
    assert "lease bucket 'forkless-leases' (KV): does not exist yet" in out

    async def make_buckets() -> None:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        await js.create_object_store("ckpt")
        await js.create_key_value(bucket="leases")
        await nc.close()

    asyncio.run(make_buckets())
    lines, failure = _probe(nats_server.url, feed, instance=1, instances=3, checkpoint_bucket="ckpt",
                            lease_bucket="leases")
    out = "\n".join(lines)
    assert failure is None, out
    assert "checkpoint bucket 'ckpt' (object store, stream OBJ_ckpt): exists" in out
    assert "lease bucket 'leases' (KV, stream KV_leases): exists" in out
    lines, _ = _probe(nats_server.url, {**feed, "partitions": "0"})
    assert 'no FORKLESS_CHECKPOINT_BUCKET: no checkpoints; every start consumes its partitions from "start"' in \
        "\n".join(lines)


@pytest.mark.timeout(240 * UNIT_S)
def test_the_check_command_prints_the_instance_s_partitions_and_passes_on_an_agreeing_stream(nats_server):
    _check_streams(nats_server.url)
    env = {"FORKLESS_FEATURES": "4", "FORKLESS_MAX_BATCH": "4", "FORKLESS_INSTANCE": "2", "FORKLESS_INSTANCES": "3",
           "FORKLESS_CHECKPOINT_BUCKET": "ckpt", "FORKLESS_FEEDS": json.dumps([{
               "name": "ticks", "nats": nats_server.url, "stream": "TICKS", "subject": "ticks.{partition}.>",
               "results": "scores", "partition_count": 12}])}
    result = run_app("--check", env=env, timeout_s=180 * UNIT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (f"feed 'ticks' ({nats_server.url}): partitioned, partition_count 12; this instance owns 8-11 (4 of 12, "
            "from FORKLESS_INSTANCE 2 of FORKLESS_INSTANCES 3); checkpoints in bucket 'ckpt', leases in "
            "'forkless-leases' for 10 s") in result.stdout
    assert "this instance's partitions: 8-11 (4 of 12); consuming ticks.8.>, ticks.9.>, ticks.10.>, ticks.11.>" \
        in result.stdout
    assert "check passed" in result.stdout


# ---- the kit's partitioned StatefulSet (deploy/kubernetes/partitioned.yaml) ---------------------------


def _statefulset_example() -> tuple[int, float, dict[str, str], dict[str, str]]:
    """The StatefulSet of deploy/kubernetes/partitioned.yaml (docs/partitions-running.md, "Kubernetes"):
    its replicas, its termination grace period, its env values, and its env taken from fields (the
    downward API)."""
    import yaml  # a test dependency (requirements-dev.txt), for this test's manifests only

    documents = list(yaml.safe_load_all((ROOT / "deploy/kubernetes/partitioned.yaml").read_text(encoding="utf-8")))
    spec = next(d for d in documents if d["kind"] == "StatefulSet")["spec"]
    pod = spec["template"]["spec"]
    env = pod["containers"][0]["env"]
    values = {e["name"]: e["value"] for e in env if "value" in e}
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in env if "valueFrom" in e}
    return spec["replicas"], float(pod["terminationGracePeriodSeconds"]), values, fields


def _shares(env: dict[str, str], replicas: int) -> list[tuple[int, ...]]:
    """Each pod's partitions, from the configuration forkless reads with the pod's ordinal."""
    from forkless.controller.config import Config

    return [Config.from_env({**env, "FORKLESS_INSTANCE": str(ordinal)}).feed_specs[0].options.partitions
            for ordinal in range(replicas)]


def test_the_kubernetes_example_gives_each_pod_its_share_and_the_pods_cover_every_partition_once():
    from forkless.controller.config import VARIABLES, Config

    replicas, grace_s, env, fields = _statefulset_example()
    assert fields == {"FORKLESS_INSTANCE": "metadata.labels['apps.kubernetes.io/pod-index']"}
    named = {name for name in [*env, *fields] if name.startswith("FORKLESS_")}  # JAX's own pass through
    assert named <= {var.env for var in VARIABLES}  # no typo: every FORKLESS_ name is a forkless variable
    assert int(env["FORKLESS_INSTANCES"]) == replicas
    count = json.loads(env["FORKLESS_FEEDS"])[0]["partition_count"]
    assert grace_s > Config.from_env(env | {"FORKLESS_INSTANCE": "0"}).shutdown_timeout_s + 0.5
    shares = _shares(env, replicas)
    assert shares == [instance_share(ordinal, replicas, count) for ordinal in range(replicas)]
    assert sorted(p for share in shares for p in share) == list(range(count))
    # what the section's text says of it
    assert (replicas, count) == (3, 12) and shares == [tuple(range(4 * i, 4 * i + 4)) for i in range(3)]


def test_rescaling_the_kubernetes_example_changes_the_shares_and_still_covers_every_partition_once():
    from forkless.io_loop.errors import ConfigError

    replicas, _, env, _ = _statefulset_example()
    count = json.loads(env["FORKLESS_FEEDS"])[0]["partition_count"]
    before = _shares(env, replicas)
    for rescaled in range(1, count + 1):
        shares = _shares({**env, "FORKLESS_INSTANCES": str(rescaled)}, rescaled)
        assert sorted(p for share in shares for p in share) == list(range(count)), rescaled
        assert (shares == before) == (rescaled == replicas)
    with pytest.raises(ConfigError, match=f"FORKLESS_INSTANCES='{count + 1}' is invalid"):
        _shares({**env, "FORKLESS_INSTANCES": str(count + 1)}, count + 1)


@pytest.mark.parametrize("declares", [{"per_stream": False}, {"restore_shared": True}])
def test_a_processor_whose_state_cannot_be_split_by_partition_is_refused(declares):
    from forkless.controller.config import Config
    from forkless.controller.errors import ProcessorContractError
    from forkless.controller.loop import Controller
    from forkless.controller.processor import ewma_processor

    cfg = Config(feeds=json.dumps([{"name": "ticks", "nats": "nats://127.0.0.1:9", "stream": "TICKS",
                                    "subject": "ticks.{partition}.>", "results": "scores", "partition_count": 12,
                                    "partitions": "0-5"}]))
    made = ewma_processor()
    processor = made._replace(description=dataclasses.replace(made.description, **declares))
    with pytest.raises(ProcessorContractError, match=next(iter(declares))):
        Controller(cfg, processor=processor)
    Controller(cfg, processor=ewma_processor())  # the default detector keeps streams apart: accepted
