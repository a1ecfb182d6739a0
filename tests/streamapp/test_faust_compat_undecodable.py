"""guard_undecodable_batches: the stand-in that a skipped changelog batch leaves (so that Faust's
recovery reaches the partition's end) never reaches a table's store; real changelog records,
tombstones included, still do."""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any
from uuid import uuid4

import faust
from aiokafka.consumer import fetcher
from aiokafka.consumer.fetcher import READ_UNCOMMITTED
from aiokafka.structs import TopicPartition

from streamapp.faust_compat import guard_undecodable_batches
from tests.record_batch_bytes import batch_bytes, with_bad_crc


class RecordingStore:
    """Stands in for a table's store: keeps what ``apply_changelog_batch`` was given."""

    def __init__(self) -> None:
        self.applied: list[tuple[bytes | None, bytes | None, int]] = []

    def apply_changelog_batch(self, batch: Iterable[Any], to_key: Any, to_value: Any) -> None:
        self.applied += [(e.message.key, e.message.value, e.message.offset) for e in batch]


def event(topic: str, offset: int, key: bytes | None, value: bytes | None) -> Any:
    message = SimpleNamespace(topic=topic, partition=0, offset=offset, key=key, value=value,
                              tp=TopicPartition(topic, 0))
    return SimpleNamespace(message=message, key=key, value=value)


def test_the_stand_in_of_a_skipped_changelog_batch_never_reaches_the_store() -> None:
    app = faust.App(f"test-{uuid4().hex[:8]}", broker="kafka://127.0.0.1:1")
    table = app.Table("device_stats", key_type=bytes, value_type=bytes, store="memory://")
    changelog = table.changelog_topic_name
    guard_undecodable_batches([f"{app.conf.id}.requests"])
    # what the consumer hands recovery: a good row, then a corrupt batch of offsets 1..2
    data = batch_bytes([(b"dev-a", b"row-0")]) + with_bad_crc(
        batch_bytes([(b"dev-a", b"row-1"), (b"dev-b", b"row-2")], base_offset=1)
    )
    records = list(fetcher.PartitionRecords(
        TopicPartition(changelog, 0), fetcher.MemoryRecords(data), None, 0, None, None, True,
        READ_UNCOMMITTED,
    ))
    assert [(r.offset, r.key, r.value) for r in records] == [
        (0, b"dev-a", b"row-0"), (2, None, None)  # the stand-in: recovery reaches offset 2
    ]
    store = RecordingStore()
    table._data = store

    table.apply_changelog_batch(
        [event(changelog, r.offset, r.key, r.value) for r in records]
        + [event(changelog, 3, b"dev-c", None)]  # a real tombstone after it
    )

    assert store.applied == [(b"dev-a", b"row-0", 0), (b"dev-c", None, 3)]


def test_a_real_record_without_key_and_value_is_not_taken_for_a_stand_in() -> None:
    app = faust.App(f"test-{uuid4().hex[:8]}", broker="kafka://127.0.0.1:1")
    table = app.Table("t", key_type=bytes, value_type=bytes, store="memory://")
    guard_undecodable_batches([])
    store = RecordingStore()
    table._data = store

    table.apply_changelog_batch([event(table.changelog_topic_name, 7, None, None)])

    assert store.applied == [(None, None, 7)]  # Faust's own handling, unchanged
