"""``streamapp.tail``: the ``--since`` parser (unit), then on both session brokers where a
:class:`TopicReader` starts: at a time (the offsets-for-times lookup, which Tansu answers from its
append times and with "offset 0, timestamp -1" past the end) and at the last N records."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.structs import ConsumerRecord
from typer.testing import CliRunner

from streamapp.cli import cli
from streamapp.kafka import create_topics
from streamapp.tail import TopicReader, cell, iso_utc, parse_since
from tests.conftest import Broker

NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10m", NOW - 600), ("90s", NOW - 90), ("2h", NOW - 7200), ("1d", NOW - 86_400),
        ("1w", NOW - 604_800), ("1h30m", NOW - 5400), ("500ms", NOW - 0.5), ("1.5h", NOW - 5400),
        ("1796000000", 1_796_000_000.0), ("1796000000.25", 1_796_000_000.25),
        ("2026-05-01T12:00:00Z", datetime(2026, 5, 1, 12, tzinfo=UTC).timestamp()),
        ("2026-05-01T12:00:00+02:00", datetime(2026, 5, 1, 10, tzinfo=UTC).timestamp()),
    ],
)
def test_parse_since(text: str, expected: float) -> None:
    assert parse_since(text, now=NOW) == pytest.approx(expected)


def test_parse_since_naive_iso_is_local_time() -> None:
    assert parse_since("2026-05-01") == datetime(2026, 5, 1).timestamp()


@pytest.mark.parametrize("text", ["", "yesterday", "10 minutes", "-5", "10x", "nan", "m10",
                                  "99999999999999", "1e300"])
def test_parse_since_rejects_with_examples(text: str) -> None:
    with pytest.raises(ValueError, match="since"):
        parse_since(text, now=NOW)


def test_epoch_milliseconds_get_a_hint_not_a_traceback(runner: CliRunner) -> None:
    # a new user's first try: the millisecond timestamps their devices send (year 58888)
    with pytest.raises(ValueError, match="epoch milliseconds"):
        parse_since("1796164752040", now=NOW)
    out = runner.invoke(cli, ["results", "tail", "--broker", "kafka://127.0.0.1:1",
                              "--since", "1796164752040"])
    assert out.exit_code == 2
    assert "epoch milliseconds" in out.output and "Traceback" not in out.output


@pytest.mark.parametrize("command", [["dlq", "tail"], ["dlq", "replay", "-r", "x"],
                                     ["results", "tail"]])
def test_commands_reject_a_bad_since_with_exit_2(runner: CliRunner, command: list[str]) -> None:
    out = runner.invoke(cli, [*command, "--broker", "kafka://127.0.0.1:1", "--since", "tuesday"])

    assert out.exit_code == 2
    assert "ISO 8601" in out.output


def test_iso_utc_and_cell() -> None:
    assert iso_utc(datetime(2026, 5, 1, 12, 0, 1, 250_000, tzinfo=UTC).timestamp()) == (
        "2026-05-01T12:00:01.250Z"
    )
    assert cell("two\nlines", 20) == "two lines"
    assert cell("abcdefghij", 5) == "abcd…"


# -- on the broker --------------------------------------------------------------------------------


class ValueReader(TopicReader[bytes]):
    def decode(self, tp: TopicPartition, record: ConsumerRecord[Any, Any]) -> bytes:
        return bytes(record.value)


async def produce(servers: str, topic: str, values: list[bytes]) -> None:
    """Sent without waiting in between, so records share multi-record batches; a value starting
    with ``a`` goes to partition 0, ``b`` to 1, and so on."""
    producer = AIOKafkaProducer(bootstrap_servers=servers, acks="all", linger_ms=20)
    await producer.start()
    try:
        futures = [await producer.send(topic, v, partition=v[0] - ord("a")) for v in values]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def read(broker: Broker, topic: str, *, since: float | None = None,
               last: int | None = None) -> list[bytes]:
    async with ValueReader(broker.bootstrap_servers, topic) as reader:
        if since is not None:
            await reader.start_at_time(since)
        if last is not None:
            await reader.start_at_last(last)
        return sorted(await reader.read_to_end())


@pytest.mark.kafka
async def test_start_at_time_reads_only_what_was_written_since(
    kafka_broker: Broker, app_id: str
) -> None:
    topic = f"{app_id}.t"
    create_topics(kafka_broker.bootstrap_servers, {topic: 3})
    old = [b"%c-old-%d" % (k, n) for n in range(20) for k in b"abc"]
    new = [b"%c-new-%d" % (k, n) for n in range(20) for k in b"abc"]
    await produce(kafka_broker.bootstrap_servers, topic, old)
    await asyncio.sleep(1.0)
    mark = time.time()
    await asyncio.sleep(0.2)
    await produce(kafka_broker.bootstrap_servers, topic, new)

    assert await read(kafka_broker, topic, since=mark) == sorted(new)
    assert await read(kafka_broker, topic, since=mark - 3600) == sorted(old + new)
    # After the last record: Tansu answers offset 0 with timestamp -1, which must not mean
    # "from the beginning".
    assert await read(kafka_broker, topic, since=time.time() + 60) == []


@pytest.mark.kafka
async def test_start_at_time_past_the_end_then_follows(kafka_broker: Broker, app_id: str) -> None:
    topic = f"{app_id}.t"
    create_topics(kafka_broker.bootstrap_servers, {topic: 2})
    await produce(kafka_broker.bootstrap_servers, topic, [b"a-old", b"b-old"])
    async with ValueReader(kafka_broker.bootstrap_servers, topic) as reader:
        await reader.start_at_time(time.time() + 1)
        assert await reader.read_to_end() == []
        follow = reader.follow()
        await asyncio.sleep(1.2)  # so that the new records are later than the start time
        await produce(kafka_broker.bootstrap_servers, topic, [b"a-new", b"b-new"])
        later = [await asyncio.wait_for(anext(follow), 10) for _ in range(2)]
        await follow.aclose()

    assert sorted(later) == [b"a-new", b"b-new"]


@pytest.mark.kafka
async def test_start_at_last_reads_at_least_the_last_n_of_each_partition(
    kafka_broker: Broker, app_id: str, broker_kind: str
) -> None:
    topic = f"{app_id}.t"
    create_topics(kafka_broker.bootstrap_servers, {topic: 2})
    values = [b"%c-%03d" % (k, n) for n in range(200) for k in b"ab"]
    await produce(kafka_broker.bootstrap_servers, topic, values)

    got = await read(kafka_broker, topic, last=5)

    # Tansu's ListOffsets end may be short of the real end: then more is read, never less.
    for k in b"ab":
        mine = [v for v in got if v[0] == k]
        assert mine[-5:] == [b"%c-%03d" % (k, n) for n in range(195, 200)]
    if broker_kind == "kafka":  # right ListOffsets answer: exactly the last 5 of each
        assert len(got) == 10
