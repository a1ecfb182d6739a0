"""DLQ tooling: filters and the table (unit; ``--since`` parsing is in test_tail.py), then on the
session broker: reading to the end (fetch high watermark), filters, replay counts and byte-exact
re-published requests, ``--follow``, and the ``streamapp dlq`` commands."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from typer.testing import CliRunner

from streamapp.broker import EmbeddedBroker
from streamapp.cli import cli
from streamapp.codecs import encode_dead_letter
from streamapp.dlq import (
    NOT_KEPT,
    RECORD_BATCH,
    UNREADABLE_RETRY_RECORD,
    DeadLetterEntry,
    DeadLetterFilter,
    DeadLetterReader,
    ReplayRecord,
    format_entries,
    letter_device,
    letter_request_id,
    read_dead_letters,
    replay_dead_letters,
    replay_record,
)
from streamapp.exceptions import BrokerError, InvalidRequestError
from streamapp.kafka import create_topics
from streamapp.records import DeadLetter
from streamapp.retry import RetryRecord
from streamapp.settings import Settings, load_settings
from streamapp.tail import display_width

NOW = 1_800_000_000.0


def letter(
    n: int,
    reason: str = "bad_shape",
    device: str | None = "cam-1",
    ts: float = NOW,
    value: bytes | None = None,
    key: bytes | None = b"",
) -> DeadLetter:
    """A dead letter whose original value is distinct bytes (not even UTF-8) per ``n``."""
    return DeadLetter(
        value=value if value is not None else b"\xff\x00orig-%d\x80" % n,
        key=(device or "").encode() if key == b"" else key,
        error={"reason": reason, "type": "InvalidRequestError",
               "message": f"problem {n} with a long explanation " + "x" * 80, "stage": "validate"},
        attempts=1,
        first_failed_ts=ts,
        last_failed_ts=ts,
        source={"topic": "inference-request", "partition": n % 4, "offset": 100 + n},
        request_id=f"req-{n}" if device is not None else None,
        device_id=device,
        worker="host:1",
    )


def entry(n: int, **kwargs: object) -> DeadLetterEntry:
    return DeadLetterEntry(letter(n, **kwargs), partition=0, offset=n, timestamp_ms=0)  # type: ignore[arg-type]


def retry_envelope(key: bytes | None, value: bytes, /, **changes: object) -> bytes:
    """A retry record as a worker encodes it for the request ``key``/``value``, with ``changes``
    to its JSON fields (what makes it one the worker refuses)."""
    record = RetryRecord(
        request_id="req-r", device_id="cam-1", model="digits", attempt=1, not_before=NOW,
        errors=[], first_failed_ts=NOW,
        source={"topic": "inference-request", "partition": 1, "offset": 7}, key=key, value=value,
    )
    body = json.loads(record.encode())
    body.update(changes)
    return json.dumps(body).encode()


def retry_letter(envelope: bytes, retry_topic: str = "inference-retry") -> DeadLetter:
    """The dead letter a worker writes for a retry-topic record it cannot use: reason
    ``invalid_retry_record``, that record's own key (the request_id) and value, its position in
    the retry topic, and the ids it could read."""
    with pytest.raises(InvalidRequestError) as refused:
        RetryRecord.decode(envelope)
    assert refused.value.reason == "invalid_retry_record"
    ids = refused.value.fields
    return DeadLetter(
        value=envelope,
        key=b"req-r",
        error={"reason": "invalid_retry_record", "type": "InvalidRequestError",
               "message": str(refused.value), "stage": "decode"},
        attempts=1,
        first_failed_ts=NOW,
        last_failed_ts=NOW,
        source={"topic": retry_topic, "partition": 0, "offset": 3},
        request_id=ids.get("request_id"),
        device_id=ids.get("device_id"),
        worker="host:1",
    )


# -- filters and formatting -----------------------------------------------------------------------


def test_filter_criteria_all_must_hold() -> None:
    a = entry(1, reason="bad_shape", device="cam-1", ts=NOW)
    b = entry(2, reason="non_finite", device="cam-1", ts=NOW - 100)
    c = entry(3, reason="bad_shape", device="cam-2", ts=NOW - 100)

    def kept(where: DeadLetterFilter) -> list[int]:
        return [e.offset for e in (a, b, c) if where.matches(e)]

    assert kept(DeadLetterFilter()) == [1, 2, 3]
    assert kept(DeadLetterFilter(reason="bad_shape")) == [1, 3]
    assert kept(DeadLetterFilter(device="cam-1")) == [1, 2]
    assert kept(DeadLetterFilter(since=NOW - 50)) == [1]
    assert kept(DeadLetterFilter(reason="bad_shape", device="cam-2", since=NOW - 100)) == [3]
    assert DeadLetterFilter(reason="r", device="d").describe() == "reason=r device=d"


def test_device_filter_falls_back_to_the_key_for_undecoded_requests() -> None:
    undecoded = entry(4, reason="invalid_json", device=None, key=b"cam-9")

    assert DeadLetterFilter(device="cam-9").matches(undecoded)


def test_table_is_aligned_and_fits_the_width() -> None:
    entries = [entry(1), entry(22, reason="undecodable_image", device="camera-front-door")]

    lines = format_entries(entries, width=150).splitlines()

    assert lines[0].split() == ["TIME", "DEVICE", "REQUEST_ID", "REASON", "STAGE", "MESSAGE",
                                "SOURCE"]
    assert all(len(line) <= 150 for line in lines)
    starts = [line.index("inference-request[") for line in lines[1:]]
    assert len(set(starts)) == 1 and lines[0].index("SOURCE") == starts[0]
    assert "2027-01-15T08:00:00.000Z" in lines[1]  # NOW in UTC
    assert "…" in lines[1]  # the long message was shortened
    assert "inference-request[2]@122" in lines[2]
    assert format_entries([], header=False) == ""
    assert format_entries([]).split() == lines[0].split()


@pytest.mark.parametrize("fixed", [False, True])
def test_an_80_column_terminal_gets_rows_of_at_most_79_columns(fixed: bool) -> None:
    entries = [entry(1, device="camera-front-door-left"), entry(22, device="摄像头-大门-左侧")]

    lines = format_entries(entries, width=80, fixed=fixed).splitlines()

    assert max(display_width(line) for line in lines) <= 79
    # stage and source are left out first; every other column stays, aligned
    assert lines[0].split() == ["TIME", "DEVICE", "REQUEST_ID", "REASON", "MESSAGE"]
    reason_at = lines[0].index("REASON")
    assert all(display_width(line[:line.index("bad_")]) == reason_at for line in lines[1:])


def test_fixed_tables_line_up_across_calls() -> None:
    head = format_entries([entry(1)], width=140, fixed=True).splitlines()
    later = format_entries([entry(333, device="a-much-longer-device")], width=140, header=False,
                           fixed=True)

    assert later.index("inference-request[") == head[1].index("inference-request[")


def test_to_dict_carries_the_original_bytes() -> None:
    e = entry(5)

    body = json.loads(json.dumps(e.to_dict()))

    assert base64.b64decode(body["value"]) == b"\xff\x00orig-5\x80"
    assert base64.b64decode(body["key"]) == b"cam-1"
    assert body["error"]["reason"] == "bad_shape"
    assert body["dlq"] == {"partition": 0, "offset": 5, "timestamp_ms": 0}


# -- what a replay sends ---------------------------------------------------------------------------

ORIGINAL = b'{"request_id":"req-r","device_id":"cam-1","seq":4}'


def test_replay_sends_a_request_letters_own_key_and_value() -> None:
    normal = letter(1)

    assert replay_record(normal) == ReplayRecord(normal.key, normal.value)


@pytest.mark.parametrize("changes", [{"not_before": "soon"}, {"request_id": 123},
                                     {"errors": "none"}], ids=str)
def test_a_retry_record_letter_replays_the_request_the_record_carries(
    changes: dict[str, object],
) -> None:
    held = retry_letter(retry_envelope(b"cam-1", ORIGINAL, **changes))

    assert replay_record(held) == ReplayRecord(b"cam-1", ORIGINAL, recreated=True)


@pytest.mark.parametrize(
    "envelope",
    [
        b"\xff not json",
        b"[1, 2]",
        retry_envelope(b"cam-1", ORIGINAL, value="%% not base64"),
        retry_envelope(b"cam-1", ORIGINAL, value=None),
        retry_envelope(b"cam-1", b"", not_before="soon"),
        retry_envelope(None, ORIGINAL, not_before="soon"),
        retry_envelope(b"cam-2", ORIGINAL, not_before="soon"),  # key is not its device_id
        retry_envelope(b"cam-1", ORIGINAL, device_id=7),
    ],
    ids=["not-json", "not-an-object", "value-not-base64", "no-value", "empty-value",
         "null-key", "key-not-device", "device-not-text"],
)
def test_a_retry_record_letter_without_a_readable_request_is_not_replayed(
    envelope: bytes,
) -> None:
    assert replay_record(retry_letter(envelope)) == UNREADABLE_RETRY_RECORD


def test_a_letter_read_from_the_retry_topic_holds_a_retry_record_whatever_its_reason() -> None:
    held = letter(1, "internal_error", value=retry_envelope(b"cam-1", ORIGINAL))
    held.source = {"topic": "p.inference-retry", "partition": 0, "offset": 1}

    assert replay_record(held, retry_topic="p.inference-retry") == ReplayRecord(
        b"cam-1", ORIGINAL, recreated=True)
    assert replay_record(held) == ReplayRecord(held.key, held.value)  # retry topic unknown


def test_letters_without_their_value_or_of_a_record_batch_are_not_replayed() -> None:
    cut, batch = letter(1, "unproducible_outcome"), letter(2, "undecodable_record_batch")
    cut.extra = {"value_omitted": {"bytes": 9, "sha256": "0" * 64}}
    batch.extra = {"record_batch": {"first_offset": 5, "last_offset": 8}}
    kept_out = retry_letter(retry_envelope(b"cam-1", ORIGINAL, not_before="soon"))
    kept_out.extra = {"value_omitted": {"bytes": 9, "sha256": "0" * 64}}

    assert [replay_record(d) for d in (cut, batch, kept_out)] == [NOT_KEPT, RECORD_BATCH,
                                                                  NOT_KEPT]


def _retry_entry(envelope: bytes, retry_topic: str = "inference-retry") -> DeadLetterEntry:
    return DeadLetterEntry(retry_letter(envelope, retry_topic), partition=0, offset=3,
                           timestamp_ms=0)


@pytest.mark.parametrize(("envelope", "device"), [
    (retry_envelope(b"cam-1", ORIGINAL, not_before="soon"), "cam-1"),  # its device_id field
    (retry_envelope(b"cam-1", ORIGINAL, device_id=7), "cam-1"),  # else its request's key
    (retry_envelope(None, ORIGINAL, device_id=7), "-"),
    (retry_envelope(b"\xff", ORIGINAL, device_id=7), "-"),  # a key that is not UTF-8
    (b"\xff not json", "-"),
    (b"[1, 2]", "-"),
], ids=["device-id", "request-key", "no-key", "key-not-utf8", "not-json", "not-an-object"])
def test_a_retry_record_letter_shows_its_requests_device_never_the_request_id(
    envelope: bytes, device: str,
) -> None:
    # the letter's key is the retry record's: the request_id
    held = _retry_entry(envelope)

    (row,) = format_entries([held], width=160, header=False).splitlines()

    assert row.split()[1:4] == [device, "req-r", "invalid_retry_record"]
    assert letter_device(held.letter) == (None if device == "-" else device)
    assert DeadLetterFilter(device="req-r").matches(held) is False
    assert DeadLetterFilter(device="cam-1").matches(held) is (device == "cam-1")


def test_a_letter_read_from_the_retry_topic_shows_its_requests_device_whatever_its_reason(
) -> None:
    held = letter(1, "unproducible_outcome", device=None, key=b"req-r",
                  value=retry_envelope(None, ORIGINAL, device_id=7))
    held.source = {"topic": "p.inference-retry", "partition": 0, "offset": 1}
    shown = DeadLetterEntry(held, partition=0, offset=1, timestamp_ms=0)

    (row,) = format_entries([shown], width=160, header=False,
                            retry_topic="p.inference-retry").splitlines()

    assert row.split()[1:3] == ["-", "req-r"]
    assert not DeadLetterFilter(device="req-r", retry_topic="p.inference-retry").matches(shown)
    assert letter_request_id(held, retry_topic="p.inference-retry") == "req-r"
    assert letter_device(held) == "req-r"  # retry topic unknown: a request's key, as before



# -- on the broker --------------------------------------------------------------------------------


@pytest.fixture
def topics(kafka_broker: EmbeddedBroker, app_id: str) -> Settings:
    settings = load_settings(broker=kafka_broker.url, topic_prefix=f"{app_id}.")
    create_topics(kafka_broker.bootstrap_servers,
                  {settings.dlq_topic: 3, settings.request_topic: 2})
    return settings


async def produce(servers: str, topic: str, records: list[tuple[bytes | None, bytes]],
                  *, batched: bool = True) -> None:
    """Publish in order; ``batched`` sends without waiting, so records share produce batches
    (what makes Tansu's ListOffsets answer wrong)."""
    producer = AIOKafkaProducer(bootstrap_servers=servers, acks="all", linger_ms=20)
    await producer.start()
    try:
        futures = []
        for key, value in records:
            fut = await producer.send(topic, value, key=key)
            if batched:
                futures.append(fut)
            else:
                await fut
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def publish_letters(settings: Settings, letters: list[DeadLetter]) -> None:
    await produce(settings.bootstrap_servers, settings.dlq_topic,
                  [(d.key, encode_dead_letter(d)) for d in letters])


async def read_all(servers: str, topic: str, expect: int, timeout_s: float = 10.0,
                   ) -> list[tuple[bytes | None, bytes]]:
    consumer = AIOKafkaConsumer(bootstrap_servers=servers, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic)
                                                          or await _force(consumer, topic))]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        out: list[tuple[bytes | None, bytes]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                out.extend((r.key, r.value) for r in records)
            if len(out) >= expect:
                await asyncio.sleep(0.5)  # and nothing more arrives
                for records in (await consumer.getmany(timeout_ms=300)).values():
                    out.extend((r.key, r.value) for r in records)
                break
        return out
    finally:
        await consumer.stop()


async def _force(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    await consumer._client.force_metadata_update()
    return consumer.partitions_for_topic(topic) or set()


def mixed_letters() -> list[DeadLetter]:
    """12 letters: 3 devices × (bad_shape, non_finite, bad_shape at NOW-3600, empty_key)."""
    out = []
    for d in range(3):
        device = f"cam-{d}"
        out += [
            letter(10 * d + 1, "bad_shape", device, NOW),
            letter(10 * d + 2, "non_finite", device, NOW),
            letter(10 * d + 3, "bad_shape", device, NOW - 3600),
            letter(10 * d + 4, "empty_key", device, NOW, key=None),
        ]
    return out


@pytest.mark.kafka
async def test_reads_every_letter_to_the_end_in_partition_order(topics: Settings) -> None:
    letters = mixed_letters()
    await publish_letters(topics, letters)

    got = await read_dead_letters(topics.bootstrap_servers, topics.dlq_topic)

    assert sorted(e.letter.request_id or "" for e in got) == sorted(
        d.request_id or "" for d in letters
    )
    assert {e.letter.value for e in got} == {d.value for d in letters}
    assert [(e.partition, e.offset) for e in got] == sorted((e.partition, e.offset) for e in got)
    for device in ("cam-0", "cam-1", "cam-2"):  # keyed letters keep their order
        mine = [e.letter.request_id for e in got if e.letter.key == device.encode()]
        assert mine == sorted(mine, key=lambda r: int(str(r).split("-")[1]))


@pytest.mark.kafka
async def test_empty_topic_reads_to_an_empty_end_quickly(topics: Settings) -> None:
    started = time.monotonic()

    assert await read_dead_letters(topics.bootstrap_servers, topics.dlq_topic) == []
    assert time.monotonic() - started < 5


@pytest.mark.kafka
async def test_missing_topic_is_a_clear_error(kafka_broker: EmbeddedBroker, app_id: str) -> None:
    with pytest.raises(BrokerError, match="does not exist"):
        await read_dead_letters(kafka_broker.bootstrap_servers, f"{app_id}.nope")


@pytest.mark.kafka
async def test_many_multi_record_batches_are_read_completely(topics: Settings) -> None:
    # 600 letters sent without waiting: the producer packs them into multi-record batches,
    # after which Tansu's ListOffsets "latest" is too small; the fetch high watermark is not.
    letters = [letter(n, "bad_tensor", f"cam-{n % 7}", NOW) for n in range(600)]
    await publish_letters(topics, letters)

    got = await read_dead_letters(topics.bootstrap_servers, topics.dlq_topic)

    assert len(got) == 600
    assert {e.letter.request_id for e in got} == {f"req-{n}" for n in range(600)}


@pytest.mark.kafka
async def test_filters_on_the_broker(topics: Settings) -> None:
    await publish_letters(topics, mixed_letters())

    async def ids(**where: object) -> set[str | None]:
        got = await read_dead_letters(topics.bootstrap_servers, topics.dlq_topic,
                                      where=DeadLetterFilter(**where))  # type: ignore[arg-type]
        return {e.letter.request_id for e in got}

    assert await ids(reason="bad_shape") == {f"req-{n}" for n in (1, 3, 11, 13, 21, 23)}
    assert await ids(reason="bad_shape", device="cam-1") == {"req-11", "req-13"}
    assert await ids(reason="bad_shape", since=NOW - 60) == {"req-1", "req-11", "req-21"}
    assert await ids(reason="empty_key", device="cam-2") == {"req-24"}
    assert await ids(reason="no_such_reason") == set()


@pytest.mark.kafka
async def test_undecodable_records_are_skipped_and_counted(topics: Settings) -> None:
    await produce(topics.bootstrap_servers, topics.dlq_topic,
                  [(b"x", b"not a dead letter"), (b"cam-1", encode_dead_letter(letter(1)))],
                  batched=False)

    async with DeadLetterReader(topics.bootstrap_servers, topics.dlq_topic) as reader:
        got = await reader.read_to_end()

    assert [e.letter.request_id for e in got] == ["req-1"]
    assert reader.skipped == 1


@pytest.mark.kafka
async def test_replay_republishes_original_key_and_value_byte_exact(topics: Settings) -> None:
    letters = mixed_letters()
    # Original values that are not even valid requests, and an empty one: bytes, not requests.
    letters.append(letter(99, "bad_shape", "cam-1", NOW, value=b""))
    await publish_letters(topics, letters)
    where = DeadLetterFilter(reason="bad_shape", device="cam-1")

    report = await replay_dead_letters(
        topics.bootstrap_servers, topics.dlq_topic, topics.request_topic, where=where
    )

    expected = [(d.key, d.value) for d in letters
                if d.error["reason"] == "bad_shape" and d.device_id == "cam-1"]
    assert (report.matched, report.replayed, report.dry_run) == (3, 3, False)
    assert report.request_topic == topics.request_topic
    republished = await read_all(topics.bootstrap_servers, topics.request_topic, expect=3)
    assert republished == expected  # one device: one partition, original order, exact bytes


@pytest.mark.kafka
async def test_replay_skips_letters_whose_value_was_left_out(topics: Settings) -> None:
    whole = letter(1, "unproducible_outcome", "cam-1", NOW)
    cut = letter(2, "unproducible_outcome", "cam-1", NOW, value=b"")
    cut.extra = {"value_omitted": {"bytes": 999_845, "sha256": "0" * 64}}
    await publish_letters(topics, [whole, cut])

    report = await replay_dead_letters(
        topics.bootstrap_servers, topics.dlq_topic, topics.request_topic,
        where=DeadLetterFilter(reason="unproducible_outcome"),
    )

    assert (report.matched, report.replayed, report.skipped) == (2, 1, 1)
    republished = await read_all(topics.bootstrap_servers, topics.request_topic, expect=1)
    assert republished == [(whole.key, whole.value)]  # never an empty value in its place


@pytest.mark.kafka
async def test_cli_dry_run_counts_only_what_can_be_replayed(
    topics: Settings, runner: CliRunner
) -> None:
    whole = letter(1, "undecodable_record_batch", "cam-1", NOW)
    batch = letter(2, "undecodable_record_batch", "cam-1", NOW)
    batch.extra = {"record_batch": {"first_offset": 5, "last_offset": 8}}
    await publish_letters(topics, [whole, batch])

    dry = await asyncio.to_thread(
        runner.invoke, cli, ["dlq", "replay", *_args(
            topics, "--reason", "undecodable_record_batch", "--dry-run")]
    )

    assert dry.exit_code == 0, dry.output
    assert "would replay 1 dead letters (reason=undecodable_record_batch)" in dry.stdout
    assert "1 matching cannot be replayed" in dry.stdout


@pytest.mark.kafka
async def test_replay_never_sends_a_retry_envelope_to_the_request_topic(
    topics: Settings,
) -> None:
    normal = letter(1, "bad_shape", "cam-1")
    readable = retry_letter(retry_envelope(b"cam-1", ORIGINAL, not_before="soon"),
                            topics.retry_topic)
    unreadable = retry_letter(retry_envelope(b"cam-1", ORIGINAL, value="%%"), topics.retry_topic)
    await publish_letters(topics, [normal, readable, unreadable])

    report = await replay_dead_letters(
        topics.bootstrap_servers, topics.dlq_topic, topics.request_topic,
        where=DeadLetterFilter(device="cam-1"), retry_topic=topics.retry_topic,
    )

    assert (report.matched, report.replayed, report.skipped, report.recreated) == (3, 2, 1, 1)
    assert report.not_replayed == {UNREADABLE_RETRY_RECORD: 1}
    republished = await read_all(topics.bootstrap_servers, topics.request_topic, expect=2)
    assert sorted(republished) == sorted([(b"cam-1", ORIGINAL), (normal.key, normal.value)])


@pytest.mark.kafka
async def test_cli_replays_the_request_of_a_retry_record_and_counts_what_it_skips(
    topics: Settings, runner: CliRunner
) -> None:
    normal = letter(1, "bad_shape", "cam-1")
    readable = retry_letter(retry_envelope(b"cam-1", ORIGINAL, not_before="soon"),
                            topics.retry_topic)
    unreadable = retry_letter(b"\xff not json", topics.retry_topic)
    await publish_letters(topics, [normal, readable, unreadable])

    def replay(*args: str) -> str:
        result = runner.invoke(cli, ["dlq", "replay", *_args(topics, *args)])
        assert result.exit_code == 0, result.output
        assert result.stderr == ""  # the skipped count is on the one line, not in a log too
        return str(result.stdout)

    dry = await asyncio.to_thread(replay, "--reason", "invalid_retry_record", "--dry-run")
    retried = await asyncio.to_thread(replay, "--reason", "invalid_retry_record")
    plain = await asyncio.to_thread(replay, "--reason", "bad_shape")

    # the count once: one cause needs no count of its own
    skipped = f"; 1 matching cannot be replayed, they hold no request ({UNREADABLE_RETRY_RECORD})"
    recreated = " (1 of them re-created from the retry record that held the request)"
    assert dry.splitlines() == [
        f"dry run: would replay 1 dead letters (reason=invalid_retry_record) to "
        f"{topics.request_topic}{recreated}; nothing published{skipped}"]
    assert retried.splitlines() == [
        f"replayed 1 dead letters (reason=invalid_retry_record) to {topics.request_topic}"
        f"{recreated}{skipped}"]
    assert plain.splitlines() == [
        f"replayed 1 dead letters (reason=bad_shape) to {topics.request_topic}"]
    # one device, one partition: the re-created request, then the plain one; no envelope
    republished = await read_all(topics.bootstrap_servers, topics.request_topic, expect=2)
    assert republished == [(b"cam-1", ORIGINAL), (normal.key, normal.value)]


@pytest.mark.kafka
async def test_replay_with_null_keys_and_since(topics: Settings) -> None:
    letters = mixed_letters()
    await publish_letters(topics, letters)

    report = await replay_dead_letters(
        topics.bootstrap_servers, topics.dlq_topic, topics.request_topic,
        where=DeadLetterFilter(reason="empty_key", since=NOW - 1),
    )

    assert report.replayed == 3
    republished = await read_all(topics.bootstrap_servers, topics.request_topic, expect=3)
    assert sorted(republished, key=lambda r: r[1]) == sorted(
        ((None, d.value) for d in letters if d.error["reason"] == "empty_key"),
        key=lambda r: r[1],
    )


@pytest.mark.kafka
async def test_dry_run_publishes_nothing(topics: Settings) -> None:
    await publish_letters(topics, mixed_letters())

    report = await replay_dead_letters(
        topics.bootstrap_servers, topics.dlq_topic, topics.request_topic,
        where=DeadLetterFilter(reason="non_finite"), dry_run=True,
    )

    assert (report.matched, report.replayed, report.dry_run) == (3, 0, True)
    assert await read_all(topics.bootstrap_servers, topics.request_topic, expect=1,
                          timeout_s=1.5) == []


@pytest.mark.kafka
async def test_follow_yields_letters_written_after_the_end(topics: Settings) -> None:
    await publish_letters(topics, [letter(1)])
    async with DeadLetterReader(topics.bootstrap_servers, topics.dlq_topic) as reader:
        assert [e.letter.request_id for e in await reader.read_to_end()] == ["req-1"]
        follow = reader.follow()
        await publish_letters(topics, [letter(2), letter(3)])

        later = [await asyncio.wait_for(anext(follow), 10) for _ in range(2)]
        await follow.aclose()

    assert [e.letter.request_id for e in later] == ["req-2", "req-3"]


# -- the commands ----------------------------------------------------------------------------------


def _args(settings: Settings, *more: str) -> list[str]:
    return ["--broker", settings.broker, "--topic-prefix", settings.topic_prefix, *more]


@pytest.mark.kafka
async def test_cli_tail_table_and_json(topics: Settings, runner: CliRunner) -> None:
    await publish_letters(topics, mixed_letters())

    table = await asyncio.to_thread(
        runner.invoke, cli, ["dlq", "tail", *_args(topics, "--reason", "bad_shape")]
    )
    as_json = await asyncio.to_thread(
        runner.invoke, cli,
        ["dlq", "tail", *_args(topics, "--device", "cam-2", "--limit", "2", "--json")],
    )

    assert table.exit_code == 0, table.output
    rows = table.stdout.splitlines()
    assert rows[0].split()[:4] == ["TIME", "DEVICE", "REQUEST_ID", "REASON"]
    assert sorted(r.split()[2] for r in rows[1:]) == sorted(
        f"req-{n}" for n in (1, 3, 11, 13, 21, 23)
    )
    # oldest first: the three from NOW - 3600
    assert {r.split()[2] for r in rows[1:4]} == {"req-3", "req-13", "req-23"}
    assert "6 shown of 6 matching (reason=bad_shape) of 12 dead letters" in table.stderr
    assert as_json.exit_code == 0, as_json.output
    lines = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert len(lines) == 2 and {d["device_id"] for d in lines} == {"cam-2"}
    assert all(base64.b64decode(d["value"]).startswith(b"\xff\x00orig-2") for d in lines)
    assert "2 shown of 4 matching (device=cam-2)" in as_json.stderr


@pytest.mark.kafka
async def test_cli_replay_prints_the_count(topics: Settings, runner: CliRunner) -> None:
    await publish_letters(topics, mixed_letters())

    dry = await asyncio.to_thread(
        runner.invoke, cli, ["dlq", "replay", *_args(topics, "--reason", "non_finite",
                                                       "--dry-run")]
    )
    real = await asyncio.to_thread(
        runner.invoke, cli, ["dlq", "replay", *_args(topics, "--reason", "non_finite",
                                                       "--device", "cam-0", "--since", "100000d")]
    )

    assert dry.exit_code == 0, dry.output
    assert "would replay 3 dead letters (reason=non_finite)" in dry.stdout
    assert real.exit_code == 0, real.output
    assert "replayed 1 dead letters (reason=non_finite device=cam-0 since=" in real.stdout
    assert topics.request_topic in real.stdout
    republished = await read_all(topics.bootstrap_servers, topics.request_topic, expect=1)
    assert republished == [(b"cam-0", b"\xff\x00orig-2\x80")]


@pytest.mark.kafka
async def test_cli_replay_prints_the_skipped_count_once(
    topics: Settings, runner: CliRunner
) -> None:
    cut = letter(1, "unproducible_outcome", "cam-1", NOW, value=b"")
    cut.extra = {"value_omitted": {"bytes": 999_845, "sha256": "0" * 64}}
    batch = letter(2, "unproducible_outcome", "cam-1", NOW)
    batch.extra = {"record_batch": {"first_offset": 5, "last_offset": 8}}
    whole = letter(3, "unproducible_outcome", "cam-1", NOW)
    await publish_letters(topics, [cut, batch, whole])

    result = await asyncio.to_thread(runner.invoke, cli, ["dlq", "replay", *_args(
        topics, "--reason", "unproducible_outcome", "--dry-run")])

    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        f"dry run: would replay 1 dead letters (reason=unproducible_outcome) to "
        f"{topics.request_topic}; nothing published; 2 matching cannot be replayed, they hold "
        f"no request ({RECORD_BATCH}: 1, {NOT_KEPT}: 1)"]  # by cause: several


@pytest.mark.kafka
async def test_cli_tail_shows_the_device_of_a_retry_records_request(
    topics: Settings, runner: CliRunner
) -> None:
    readable = retry_letter(retry_envelope(b"cam-1", ORIGINAL, not_before="soon"),
                            topics.retry_topic)
    unreadable = retry_letter(b"\xff not json", topics.retry_topic)
    await publish_letters(topics, [readable, unreadable])

    def tail(*args: str) -> list[list[str]]:
        result = runner.invoke(cli, ["dlq", "tail", *_args(topics, *args)],
                               env={"COLUMNS": "160"})
        assert result.exit_code == 0, result.output
        return [row.split()[1:3] for row in result.stdout.splitlines()]

    shown = await asyncio.to_thread(tail)
    by_request = await asyncio.to_thread(tail, "--device", "req-r")
    by_device = await asyncio.to_thread(tail, "--device", "cam-1")

    # DEVICE, REQUEST_ID: never the request_id that keys a retry record in the device column
    assert sorted(shown[1:]) == [["-", "req-r"], ["cam-1", "req-r"]]
    assert by_request == []
    assert by_device[1:] == [["cam-1", "req-r"]]


def test_cli_replay_requires_a_reason(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["dlq", "replay", "--broker", "kafka://127.0.0.1:1"])

    assert result.exit_code == 2
    assert "--reason" in result.output
