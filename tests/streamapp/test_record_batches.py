"""Undecodable record batches (streamapp.record_batches): crafted batch bytes unpacked by
aiokafka's own fetcher code with the guard installed. On a request topic every offset of a bad
batch comes out as a stand-in record and the batch is registered with what an operator needs;
on any other topic the batch is skipped with one ERROR; the consumer's next fetch offset moves
past the batch either way."""

from __future__ import annotations

import hashlib
import logging
from typing import Any
from uuid import uuid4

import aiokafka.codec
import pytest
from aiokafka.consumer import fetcher
from aiokafka.consumer.fetcher import READ_UNCOMMITTED
from aiokafka.structs import TopicPartition

from streamapp import record_batches
from streamapp.record_batches import (
    guard_record_batches,
    is_skipped_stand_in,
    take_undecodable,
    undecodable_counts,
)
from tests.record_batch_bytes import batch_bytes, with_bad_crc


def values(first: int, n: int) -> list[tuple[bytes | None, bytes | None]]:
    return [(b"dev-a", f"v{first + i}".encode()) for i in range(n)]


def unpack(
    topic: str, data: bytes, *, fetch_offset: int = 0, check_crcs: bool = True
) -> tuple[list[tuple[int, bytes | None]], int]:
    """What aiokafka's fetcher hands out of one partition's fetched bytes: ``(offset, value)``
    of each record, and the offset it fetches next."""
    records = fetcher.PartitionRecords(
        TopicPartition(topic, 0), fetcher.MemoryRecords(data), None, fetch_offset, None, None,
        check_crcs, READ_UNCOMMITTED,
    )
    return [(r.offset, r.value) for r in records], records.next_fetch_offset


@pytest.fixture(autouse=True, params=["google-crc32c", "aiokafka"])
def crc_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice: the batch CRC computed by google-crc32c over the fetched buffer, and
    by aiokafka (where google-crc32c's C extension is missing)."""
    if request.param == "aiokafka":
        monkeypatch.setattr(record_batches, "_crc32c", None)
    else:
        assert record_batches._crc32c is not None, "google-crc32c's C extension is installed"
    return str(request.param)


def test_the_crc_is_checked_by_the_chosen_code(
    crc_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = f"req-{uuid4().hex[:8]}"
    guard_record_batches([topic])
    calls: list[int] = []
    if crc_by == "google-crc32c":
        real = record_batches._crc32c
        monkeypatch.setattr(record_batches, "_crc32c",
                            lambda data: calls.append(len(data)) or real(data))
    big = [(b"dev-a", bytes(range(256)) * 1200)]  # 307 kB, as a ResNet-50 tensor request
    good = batch_bytes(big) + batch_bytes(values(1, 2), base_offset=1)
    bad = with_bad_crc(batch_bytes(big, base_offset=3))

    assert unpack(topic, good)[0] == [(0, big[0][1]), (1, b"v1"), (2, b"v2")]
    assert unpack(topic, bad, fetch_offset=3)[0] == [(3, None)]
    if crc_by == "google-crc32c":  # from the attributes on; a small batch is aiokafka's
        assert calls == [len(batch_bytes(big)) - 21, len(bad) - 21]


@pytest.fixture
def request_topic() -> str:
    """A fresh guarded topic (the registry is process-wide)."""
    topic = f"req-{uuid4().hex[:8]}"
    guard_record_batches([topic])
    return topic


def test_a_batch_with_a_bad_crc_becomes_one_stand_in_per_offset(request_topic: str) -> None:
    bad = with_bad_crc(batch_bytes(values(2, 3), base_offset=2))
    data = batch_bytes(values(0, 2)) + bad + batch_bytes(values(5, 2), base_offset=5)

    records, next_offset = unpack(request_topic, data)

    assert records == [(0, b"v0"), (1, b"v1"), (2, None), (3, None), (4, None), (5, b"v5"),
                       (6, b"v6")]
    assert next_offset == 7
    batch = take_undecodable(request_topic, 0, 2)
    assert batch is not None
    assert (batch.first_offset, batch.last_offset, batch.undecoded_from) == (2, 4, 2)
    assert (batch.record_count, batch.codec, batch.attributes) == (3, "none", 0)
    assert batch.error_type == "CorruptRecordException"
    assert "Invalid CRC" in batch.error_message and f"{request_topic}[0]@2" in batch.error_message
    assert batch.data == bad
    assert (batch.size_bytes, batch.sha256) == (len(bad), hashlib.sha256(bad).hexdigest())
    assert take_undecodable(request_topic, 0, 4) == batch  # its last offset: then forgotten
    assert take_undecodable(request_topic, 0, 3) is None
    assert take_undecodable(request_topic, 0, 5) is None  # a good record is never a stand-in
    assert undecodable_counts([request_topic]) == {(request_topic, "dead_lettered"): (1, 3)}


def test_an_lz4_batch_without_lz4_becomes_stand_ins_with_the_codec_error(
    request_topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lz4 = batch_bytes(values(1, 4), base_offset=1, codec="lz4")
    data = batch_bytes(values(0, 1)) + lz4 + batch_bytes(values(5, 1), base_offset=5)
    monkeypatch.setattr(aiokafka.codec, "has_lz4", lambda: False)  # as without cramjam

    records, next_offset = unpack(request_topic, data)

    assert records == [(0, b"v0"), (1, None), (2, None), (3, None), (4, None), (5, b"v5")]
    assert next_offset == 6
    batch = take_undecodable(request_topic, 0, 1)
    assert batch is not None
    assert (batch.first_offset, batch.last_offset, batch.record_count) == (1, 4, 4)
    assert (batch.codec, batch.attributes & 0x07) == ("lz4", 3)
    assert batch.error_type == "UnsupportedCodecError"
    assert "lz4" in batch.error_message
    assert batch.data == lz4


def test_the_same_lz4_batch_decodes_when_the_codec_is_there(request_topic: str) -> None:
    data = batch_bytes(values(0, 3), codec="lz4")

    assert unpack(request_topic, data) == ([(0, b"v0"), (1, b"v1"), (2, b"v2")], 3)
    assert take_undecodable(request_topic, 0, 0) is None
    assert undecodable_counts([request_topic]) == {}


def test_a_batch_failing_part_way_keeps_the_records_before_and_stands_in_for_the_rest(
    request_topic: str,
) -> None:
    good = batch_bytes(values(0, 4))
    at = good.index(b"v2")
    broken = bytearray(good)
    broken[at - 1] = 0x7E  # record 2's value length now claims 63 bytes: beyond the batch

    records, next_offset = unpack(request_topic, bytes(broken), check_crcs=False)

    assert records == [(0, b"v0"), (1, b"v1"), (2, None), (3, None)]
    assert next_offset == 4
    batch = take_undecodable(request_topic, 0, 2)
    assert batch is not None
    assert (batch.first_offset, batch.undecoded_from, batch.last_offset) == (0, 2, 3)
    assert batch.error_type == "CorruptRecordException"


def test_a_fetch_from_the_middle_of_a_bad_batch_stands_in_for_the_rest_only(
    request_topic: str,
) -> None:
    """After a restart whose committed offset lies inside the batch (its first letters were
    committed), only the offsets from there are handed out."""
    data = with_bad_crc(batch_bytes(values(10, 4), base_offset=10))

    assert unpack(request_topic, data, fetch_offset=12) == ([(12, None), (13, None)], 14)


def test_a_bad_batch_of_another_topic_is_skipped_with_one_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    changelog = f"app-{uuid4().hex[:8]}-device_stats-changelog"
    data = batch_bytes(values(0, 1)) + with_bad_crc(batch_bytes(values(1, 3), base_offset=1))

    with caplog.at_level(logging.ERROR, logger="streamapp.record_batches"):
        records, next_offset = unpack(changelog, data)

    # one stand-in, for the last offset (Faust's recovery waits for the partition's end);
    # the tables never see it (test_faust_compat.py)
    assert records == [(0, b"v0"), (3, None)]
    assert next_offset == 4
    assert is_skipped_stand_in(changelog, 0, 3)
    assert not any(is_skipped_stand_in(changelog, 0, o) for o in (0, 1, 2, 4))
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert f"{changelog}[0]@1..3" in error.getMessage()
    assert "CorruptRecordException" in error.getMessage()
    assert take_undecodable(changelog, 0, 3) is None  # no dead letters for a changelog
    assert undecodable_counts([changelog]) == {(changelog, "skipped"): (1, 3)}


def test_a_batch_met_twice_is_counted_once(request_topic: str) -> None:
    data = with_bad_crc(batch_bytes(values(0, 2)))

    first: Any = unpack(request_topic, data)
    second: Any = unpack(request_topic, data)  # fetched again, e.g. after a rebalance

    assert first == second == ([(0, None), (1, None)], 2)
    assert undecodable_counts([request_topic]) == {(request_topic, "dead_lettered"): (1, 2)}


def test_a_batch_beyond_the_memory_bound_is_registered_without_its_bytes(
    request_topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches wait in memory for their dead letters; beyond MAX_KEPT_BATCH_BYTES only their
    size and sha256 are kept (the first letter then has no bytes to hold)."""
    bad = with_bad_crc(batch_bytes(values(0, 2)))
    monkeypatch.setattr(record_batches, "MAX_KEPT_BATCH_BYTES", len(bad) - 1)

    assert unpack(request_topic, bad) == ([(0, None), (1, None)], 2)

    batch = take_undecodable(request_topic, 0, 0)
    assert batch is not None and batch.data is None
    assert (batch.size_bytes, batch.sha256) == (len(bad), hashlib.sha256(bad).hexdigest())
