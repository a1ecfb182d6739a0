"""Faust-backed device tables without a broker: partition choice of writes, RocksDB store,
and the changelog sealer (with a fake producer)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust
import pytest
from aiokafka.partitioner import DefaultPartitioner

from streamapp.settings import Settings
from streamapp.tables.faust_tables import (
    MAX_WRITE_BUFFERS,
    SEAL_KEY,
    ChangelogSealer,
    define_tables,
)


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


#: A stats row (what update_stats writes, reduced to the fields a row needs).
ROW = {"device_id": "cam1", "total": 1, "counts": {"result": 1, "dead_letter": 0, "retry": 0}}


def test_tables_use_rocksdb_with_raw_keys_and_raw_json_values(tables: Any) -> None:
    for table in (tables.stats, tables.windows):
        assert type(table.data).__module__ == "faust.stores.rocksdb"
        assert table.data.use_rocksdict
        # raw values: Faust's JSON codec raised inside recovery (issue 18); we decode them
        assert table.key_serializer == "raw" and table.value_serializer == "raw"
        assert table.partitions == 4
    with tables.writing(b"cam1", Event(tables.request_topic, 0, b"cam1")):
        tables.set_stats(b"cam1", ROW)
    assert json.loads(tables.stats[b"cam1"]) == ROW  # the same JSON bytes as before


def _opened_options(table: Any, partition: int) -> dict[str, int]:
    """What RocksDB itself says the database of ``partition`` was opened with: its block cache
    capacity, and the write buffer options of the OPTIONS file RocksDB writes at open."""
    db = table.data._db_for_partition(partition)
    newest = sorted(table.data.partition_path(partition).glob("OPTIONS-*"))[-1].read_text()
    found = dict(re.findall(r"^\s*(write_buffer_size|max_write_buffer_number)=(\d+)$", newest,
                            re.M))
    return {"block_cache": db.property_int_value("rocksdb.block-cache-capacity"),
            **{name: int(value) for name, value in found.items()}}


def test_each_partition_database_opens_with_the_configured_memory_bounds(tmp_path: Path) -> None:
    settings = Settings(app_id="tables-test", topic_partitions=4, data_dir=tmp_path,
                        table_write_buffer_mib=3, table_block_cache_mib=5)
    app = faust.App(settings.app_id, broker="kafka://127.0.0.1:1", datadir=str(tmp_path),
                    topic_partitions=4)
    tables = define_tables(app, settings)
    for table in (tables.stats, tables.windows):
        for partition in (0, 3):
            assert _opened_options(table, partition) == {
                "block_cache": 5 * 1024 * 1024, "write_buffer_size": 3 * 1024 * 1024,
                "max_write_buffer_number": MAX_WRITE_BUFFERS,
            }


def test_by_default_the_databases_are_bounded_not_faust_sized(tables: Any) -> None:
    # Faust 0.15.3 alone: a 2 GiB block cache and 3 write buffers of 64 MiB per database
    for table in (tables.stats, tables.windows):
        assert _opened_options(table, 1) == {
            "block_cache": 2 * 1024 * 1024, "write_buffer_size": 1024 * 1024,
            "max_write_buffer_number": 2,
        }


def test_a_database_written_before_reopens_with_the_configured_bounds(tmp_path: Path) -> None:
    """A data directory written with Faust's own RocksDB options (before the tables had
    bounds), or with other settings, reopens with the configured ones, and keeps its rows:
    rocksdict would otherwise reopen it with the options of its OPTIONS file (new-user trial,
    twelfth session)."""
    from faust.stores.rocksdb import RocksDBOptions

    old = RocksDBOptions(use_rocksdict=True)  # Faust 0.15.3's defaults: 64 MiB x 3, 2 GiB
    path = tmp_path / "v1" / "tables" / "device_stats-2.db"
    path.parent.mkdir(parents=True)
    db = old.open(path)
    db[b"cam1"] = b'{"count": 7}'
    db.close()
    assert "write_buffer_size=67108864" in sorted(path.glob("OPTIONS-*"))[-1].read_text()

    settings = Settings(app_id="tables-test", topic_partitions=4, data_dir=tmp_path,
                        table_write_buffer_mib=3, table_block_cache_mib=5)
    app = faust.App(settings.app_id, broker="kafka://127.0.0.1:1", datadir=str(tmp_path),
                    topic_partitions=4)
    tables = define_tables(app, settings)
    assert tables.stats.data.partition_path(2) == path
    assert _opened_options(tables.stats, 2) == {
        "block_cache": 5 * 1024 * 1024, "write_buffer_size": 3 * 1024 * 1024,
        "max_write_buffer_number": MAX_WRITE_BUFFERS,
    }
    assert tables.stats.data._db_for_partition(2)[b"cam1"] == b'{"count": 7}'


def test_a_request_topic_event_decides_the_partition_of_the_write(tables: Any) -> None:
    event = Event(tables.request_topic, 2, b"cam1")
    with tables.writing(b"cam1", event):
        tables.set_stats(b"cam1", ROW)
        assert tables.get_stats(b"cam1") == ROW
    assert _partitions_with(tables.stats, b"cam1") == [2]
    assert tables.get_stats(b"cam1") == ROW  # read outside any event, as views do


def test_without_a_request_topic_event_the_key_hash_decides(tables: Any) -> None:
    retry_event = Event("inference-retry", 0, b"cam7-request-id")
    with tables.writing(b"cam7", retry_event):
        tables.set_stats(b"cam7", ROW)
    expected = DefaultPartitioner()(b"cam7", [0, 1, 2, 3], [0, 1, 2, 3])
    assert tables.partition_of(b"cam7") == expected
    assert _partitions_with(tables.stats, b"cam7") == [expected]


def test_bucket_rows_can_be_deleted_and_seal_keys_are_not_devices(tables: Any) -> None:
    event = Event(tables.request_topic, 1, b"cam2")
    with tables.writing(b"cam2", event):
        tables.set_bucket(b"cam2\x00k", {"count": 1})
        tables.set_stats(b"cam2", ROW)
        tables.stats[SEAL_KEY] = b'{"not": "a device"}'
        tables.delete_bucket(b"cam2\x00k")
        tables.delete_bucket(b"cam2\x00missing")
    assert tables.get_bucket(b"cam2\x00k") is None
    assert [k for k, _ in tables.iter_stats()] == []  # partition 1 is not assigned here...
    tables.app.assignor.assigned_actives = lambda: {  # ...until it is
        faust.types.TP(tables.stats.changelog_topic.get_topic_name(), 1)}
    assert [k for k, _ in tables.iter_stats()] == [b"cam2"]


# -- restoring changelog records that are not rows (issue 18, item 1) ---------------------------


class ChangelogMessage:
    def __init__(self, topic: str, partition: int, offset: int, key: bytes | None,
                 value: bytes | None) -> None:
        self.topic, self.partition, self.offset = topic, partition, offset
        self.key, self.value = key, value
        self.tp = faust.types.TP(topic, partition)


class ChangelogEvent:
    def __init__(self, message: ChangelogMessage) -> None:
        self.message = message
        self.key, self.value = message.key, message.value


def _restore(table: Any, records: list[tuple[int, bytes | None, bytes | None]]) -> None:
    """Apply ``(offset, key, value)`` records of partition 2 as Faust's recovery does."""
    topic = table.changelog_topic.get_topic_name()
    table.apply_changelog_batch([ChangelogEvent(ChangelogMessage(topic, 2, offset, key, value))
                                 for offset, key, value in records])


def test_a_restored_record_that_is_not_a_row_resets_the_device_once_with_its_offset(
    tables: Any, caplog: pytest.LogCaptureFixture
) -> None:
    garbage = bytes.fromhex("fffe0067617262616765")  # the record
    good = json.dumps({**ROW, "device_id": "cg01", "total": 5,
                       "counts": {"result": 5, "dead_letter": 0, "retry": 0}}).encode()
    with caplog.at_level(logging.ERROR, logger="streamapp.tables.rows"):
        _restore(tables.stats, [(7, b"cg00", good), (8, b"cg01", good), (9, b"cg00", garbage),
                                (10, None, good)])
    topic = tables.stats.changelog_topic.get_topic_name()
    assert tables.get_stats(b"cg01")["total"] == 5  # the other device is untouched
    reset = tables.get_stats(b"cg00")
    assert (reset["total"], reset["counts"]) == (0, {"result": 0, "dead_letter": 0, "retry": 0})
    assert reset["state_reset"]["reason"] == "undecodable"
    assert reset["state_reset"]["source"] == {"topic": topic, "partition": 2, "offset": 9}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2, errors  # the bad row, and the record without a key
    assert f"{topic}[2]@9, key 'cg00', cannot be read" in errors[0]
    assert "'utf-8' codec can't decode byte 0xff" in errors[0]
    assert f"{topic}[2]@10 has no key" in errors[1]
    assert tables.screens["device_stats"].rejected == {
        ("undecodable", "changelog"): 1, ("no_key", "changelog"): 1}
    assert tables.stats.data.persisted_offset(faust.types.TP(topic, 2)) == 9


def test_a_wrong_shape_bucket_is_restored_as_an_empty_bucket_and_tombstones_still_delete(
    tables: Any,
) -> None:
    bucket = {"count": 3, "results": 3, "labels": {"1": 3}}
    _restore(tables.windows, [(1, b"cam\x00a", json.dumps(bucket).encode()),
                              (2, b"cam\x00b", json.dumps(bucket).encode()),
                              (3, b"cam\x00b", None),
                              (4, b"cam\x00c", b'{"count": "many"}')])
    assert tables.get_bucket(b"cam\x00a") == bucket
    assert tables.get_bucket(b"cam\x00b") is None
    empty = tables.get_bucket(b"cam\x00c")
    assert empty["count"] == 0 and empty["state_reset"]["reason"] == "bad_shape"
    assert "count is" in empty["state_reset"]["detail"]


def test_a_wrong_shape_row_in_the_local_store_is_served_and_updated_as_a_reset(
    tables: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A row written into RocksDB by something else (or by a version before the checks):
    queries answer the reset row instead of a 500, logged once, however often it is read."""
    with tables.writing(b"cam3", Event(tables.request_topic, 3, b"cam3")):
        tables.stats[b"cam3"] = b'[1, 2]'
    with caplog.at_level(logging.ERROR, logger="streamapp.tables.rows"):
        rows = [tables.get_stats(b"cam3") for _ in range(3)]
    assert [r["total"] for r in rows] == [0, 0, 0]
    assert rows[0]["state_reset"]["source"] == {"store": "device_stats"}
    assert "a JSON list is not a stats row" in rows[0]["state_reset"]["detail"]
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1
    assert tables.screens["device_stats"].rejected == {("bad_shape", "store"): 1}


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
