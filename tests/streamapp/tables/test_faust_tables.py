"""Faust-backed device tables without a broker: partition choice of writes, RocksDB store,
and the changelog sealer (with a fake producer)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust
import pytest
from aiokafka.partitioner import DefaultPartitioner

from streamapp.settings import Settings
from streamapp.tables.faust_tables import SEAL_KEY, ChangelogSealer, define_tables


@dataclass
class Message:
    topic: str
    partition: int
    key: bytes


class Event:  # weak-referenceable, like Faust's
    def __init__(self, topic: str, partition: int, key: bytes) -> None:
        self.message = Message(topic, partition, key)


@pytest.fixture
def tables(tmp_path: Path) -> Any:
    settings = Settings(app_id="tables-test", topic_partitions=4, data_dir=tmp_path)
    app = faust.App(settings.app_id, broker="kafka://127.0.0.1:1", datadir=str(tmp_path),
                    topic_partitions=4)
    return define_tables(app, settings)


def _partitions_with(table: Any, key: bytes) -> list[int]:
    return sorted(p for p, db in table.data._dbs.items() if db.get(key) is not None)


def test_tables_use_rocksdb_with_raw_keys_and_json_values(tables: Any) -> None:
    for table in (tables.stats, tables.windows):
        assert type(table.data).__module__ == "faust.stores.rocksdb"
        assert table.data.use_rocksdict
        assert table.key_serializer == "raw" and table.value_serializer == "json"
        assert table.partitions == 4


def test_a_request_topic_event_decides_the_partition_of_the_write(tables: Any) -> None:
    event = Event(tables.request_topic, 2, b"cam1")
    with tables.writing(b"cam1", event):
        tables.set_stats(b"cam1", {"total": 1})
        assert tables.get_stats(b"cam1") == {"total": 1}
    assert _partitions_with(tables.stats, b"cam1") == [2]
    assert tables.get_stats(b"cam1") == {"total": 1}  # read outside any event, as views do


def test_without_a_request_topic_event_the_key_hash_decides(tables: Any) -> None:
    retry_event = Event("inference-retry", 0, b"cam7-request-id")
    with tables.writing(b"cam7", retry_event):
        tables.set_stats(b"cam7", {"total": 2})
    expected = DefaultPartitioner()(b"cam7", [0, 1, 2, 3], [0, 1, 2, 3])
    assert tables.partition_of(b"cam7") == expected
    assert _partitions_with(tables.stats, b"cam7") == [expected]


def test_bucket_rows_can_be_deleted_and_seal_keys_are_not_devices(tables: Any) -> None:
    event = Event(tables.request_topic, 1, b"cam2")
    with tables.writing(b"cam2", event):
        tables.set_bucket(b"cam2\x00k", {"count": 1})
        tables.set_stats(b"cam2", {"total": 1})
        tables.stats[SEAL_KEY] = {"not": "a device"}
        tables.delete_bucket(b"cam2\x00k")
        tables.delete_bucket(b"cam2\x00missing")
    assert tables.get_bucket(b"cam2\x00k") is None
    assert [k for k, _ in tables.iter_stats()] == []  # partition 1 is not assigned here...
    tables.app.assignor.assigned_actives = lambda: {  # ...until it is
        faust.types.TP(tables.stats.changelog_topic.get_topic_name(), 1)}
    assert [k for k, _ in tables.iter_stats()] == [b"cam2"]


# -- the sealer ---------------------------------------------------------------------------------


@dataclass
class FakeProducer:
    during_flush: list[Any] = field(default_factory=list)
    flushes: int = 0

    class Buffer:
        size = 0

    buffer = Buffer()

    async def flush(self) -> None:
        self.flushes += 1
        await asyncio.sleep(0)
        while self.during_flush:
            self.during_flush.pop()()


@dataclass
class FakeTable:
    name: str
    sent: list[tuple[int, bytes, Any]] = field(default_factory=list)

    class Topic:
        @staticmethod
        def get_topic_name() -> str:
            return "app-device_stats-changelog"

    changelog_topic = Topic()

    def send_changelog(self, partition: int, key: bytes, value: Any, **kw: Any) -> None:
        self.sent.append((partition, key, value))


@dataclass
class FakeApp:
    producer: FakeProducer = field(default_factory=FakeProducer)
    should_stop: bool = False
    owned: tuple[int, ...] = (0, 1, 2)

    @property
    def assignor(self) -> Any:
        owned = self.owned

        class Assignor:
            @staticmethod
            def assigned_actives() -> set[faust.types.TP]:
                return {faust.types.TP("app-device_stats-changelog", p) for p in owned}

        return Assignor()


async def test_the_sealer_ends_each_written_owned_partition_with_a_tombstone() -> None:
    app, stats, windows = FakeApp(), FakeTable("stats"), FakeTable("windows")
    sealer = ChangelogSealer(app, [stats, windows], idle_s=0.01)  # type: ignore[arg-type]
    for partition in (2, 0, 3):  # 3 is not (or no longer) ours
        sealer.touched(partition)
    await sealer.flushed()
    await asyncio.sleep(0.05)
    assert stats.sent == [(0, SEAL_KEY, None), (2, SEAL_KEY, None)]
    assert windows.sent == stats.sent
    assert sealer.seals == 2
    await asyncio.sleep(0.05)
    await sealer.seal()
    assert len(stats.sent) == 2  # nothing written since: nothing to seal


async def test_a_write_while_earlier_records_are_delivered_postpones_the_seal() -> None:
    app, stats = FakeApp(), FakeTable("stats")
    sealer = ChangelogSealer(app, [stats], idle_s=60)  # type: ignore[arg-type]
    sealer.touched(1)
    app.producer.during_flush.append(lambda: sealer.touched(1))
    assert await sealer.seal() == 0 and stats.sent == []
    assert await sealer.seal() == 1 and stats.sent == [(1, SEAL_KEY, None)]


async def test_while_stopping_every_flush_seals_inline() -> None:
    app, stats = FakeApp(should_stop=True), FakeTable("stats")
    sealer = ChangelogSealer(app, [stats], idle_s=60)  # type: ignore[arg-type]
    sealer.touched(0)
    await sealer.flushed()
    assert stats.sent == [(0, SEAL_KEY, None)]
    assert app.producer.flushes >= 2  # before the tombstones, and until they are delivered
