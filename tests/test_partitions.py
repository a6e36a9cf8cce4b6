"""io_loop/partitions.py: stream names as subject tokens, the partition function (proven against a
real nats-server's ``{{partition(P,1)}}`` subject transform), partition ranges, instance shares,
and the arithmetic of OPERATING.md's Kubernetes example."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from io_loop.partitions import (
    escape_stream,
    instance_share,
    parse_partitions,
    partition_of,
    partitions_of,
    unescape_stream,
)
from tests.harness import UNIT_S

ROOT = Path(__file__).resolve().parent.parent

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
    assert not differing, (f"nats-server's partition differs from io_loop/partitions.py's for {len(differing)} of "
                           f"{len(names)} names (name: (server, ours)), such as {some}")
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
