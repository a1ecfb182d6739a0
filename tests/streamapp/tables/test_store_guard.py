"""A full disk under the RocksDB tables (issue 18 item 3), without a broker: rows RocksDB
refuses are served from memory, the ERROR is logged once per interval, and when space returns
the database is reopened and the rows and the held-back changelog offset land on disk."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faust
import pytest
from faust.types import TP
from rocksdict import AccessType, Rdict

from streamapp.settings import Settings
from streamapp.tables.faults import FAULTS_ENV, DiskFullDB
from streamapp.tables.faust_tables import define_tables
from tests.streamapp.tables.test_faust_tables import Event


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The control file of the injected fault: while it exists the disk is full."""
    control = tmp_path / "disk-full"
    monkeypatch.setenv(FAULTS_ENV, str(control))
    return control


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A current event loop: Faust's table writes (sync here) queue their changelog record
    on it, and an earlier test may have left none (asyncio.run clears it)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()


@pytest.fixture
def tables(tmp_path: Path, disk: Path, loop: asyncio.AbstractEventLoop) -> Any:
    settings = Settings(app_id="guard-test", topic_partitions=4, data_dir=tmp_path)
    app = faust.App(settings.app_id, broker="kafka://127.0.0.1:1", datadir=str(tmp_path),
                    topic_partitions=4)
    return define_tables(app, settings)


def _count(tables: Any, device: bytes, partition: int, n: int) -> None:
    """One flush of a device: read its row, add ``n`` to its total, write it back."""
    with tables.writing(device, Event(tables.request_topic, partition, device)):
        row = tables.get_stats(device) or _row(0)
        tables.set_stats(device, _row(row["total"] + n))


def _row(total: int) -> dict[str, Any]:
    """The smallest stats row the tables serve (``total`` and ``counts``)."""
    return {"total": total, "counts": {"result": total}}


def _stored(total: int) -> bytes:
    """``_row(total)`` as the tables store it."""
    return b'{"total":%d,"counts":{"result":%d}}' % (total, total)


def _on_disk(tables: Any, device: bytes, partition: int) -> bytes | None:
    """The device's stats row in the partition's database files (None: not there)."""
    db = tables.stats.data._dbs.get(partition)
    if db is None:  # not open (its open failed): read the files themselves
        path = tables.stats.data.partition_path(partition)
        if not (path / "CURRENT").exists():
            return None
        reader = Rdict(str(path), access_type=AccessType.read_only())
        try:
            return reader.get(device)  # type: ignore[no-any-return]
        finally:
            reader.close()
    return db._db.get(device) if isinstance(db, DiskFullDB) else db.get(device)


def test_rows_refused_by_a_full_disk_are_served_and_written_when_space_returns(
    tables: Any, disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _count(tables, b"cam1", 2, 10)
    assert _on_disk(tables, b"cam1", 2) == _stored(10)
    disk.touch()  # the disk fills up
    with caplog.at_level(logging.ERROR, logger="streamapp.tables.store_guard"):
        for _ in range(10):
            _count(tables, b"cam1", 2, 1)
    assert tables.get_stats(b"cam1") == _row(20)  # served from memory meanwhile
    topic = tables.stats.changelog_topic.get_topic_name()
    tables.app.assignor.assigned_actives = lambda: {TP(topic, 2)}
    assert dict(tables.iter_stats())[b"cam1"] == _row(20)  # what GET /devices lists
    assert _on_disk(tables, b"cam1", 2) == _stored(10)
    status = tables.write_status()["device_stats"]
    assert status.degraded and status.partitions == (2,) and status.rows_in_memory == 1
    assert status.write_errors == 1  # later writes join the kept rows without trying
    assert "No space left on device" in status.error
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "device_stats partition 2" in errors[0].getMessage()
    # Faust persists the changelog offset after each acknowledged changelog record: held back
    tables.stats.data.set_persisted_offset(TP("x", 2), 41)

    disk.unlink()  # space freed: the database still refuses (RocksDB's background error)...
    with pytest.raises(Exception, match="No space left"):
        tables.stats.data._dbs[2].put(b"probe", b"1")
    guard = tables.guards[0]
    guard.retry_interval_s = 0.0  # ...until the guard reopens it, at the next write
    _count(tables, b"cam1", 2, 1)
    assert _on_disk(tables, b"cam1", 2) == _stored(21)
    assert tables.stats.data.persisted_offset(TP("x", 2)) == 41
    status = tables.write_status()["device_stats"]
    assert not status.degraded and status.rows_in_memory == 0 and status.reopens == 1


def test_a_worker_idle_after_the_disk_recovers_writes_the_rows_from_a_timer(
    tables: Any, disk: Path
) -> None:
    disk.touch()
    _count(tables, b"cam3", 1, 5)
    assert _on_disk(tables, b"cam3", 1) is None
    disk.unlink()
    assert tables.guards[1].recover() and tables.guards[0].recover()  # what the timer calls
    assert _on_disk(tables, b"cam3", 1) == _stored(5)


def test_a_disk_still_full_keeps_the_rows_and_does_not_log_again_within_the_interval(
    tables: Any, disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk.touch()
    with caplog.at_level(logging.ERROR, logger="streamapp.tables.store_guard"):
        _count(tables, b"cam4", 0, 1)
        guard = tables.guards[0]
        assert not guard.recover()  # reopened, still full
        guard.retry_interval_s = 0.0
        _count(tables, b"cam4", 0, 1)
    assert tables.get_stats(b"cam4") == _row(2)
    assert guard.status.degraded and guard.status.reopens == 0
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1


def test_a_revoked_partition_drops_its_kept_rows_the_changelog_has_them(
    tables: Any, disk: Path
) -> None:
    disk.touch()
    _count(tables, b"cam5", 3, 1)
    topic = tables.stats.changelog_topic.get_topic_name()
    tables.stats.data.revoke_partitions(tables.stats, {TP(topic, 3)})
    assert not tables.write_status()["device_stats"].degraded


def test_a_partition_first_opened_while_the_disk_is_full_loses_no_device(
    tables: Any, disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The trial's failure: a partition database opened (first or again) on a full disk
    raised out of every read, so devices lost updates and answered 404 (issue f1)."""
    _count(tables, b"cam7", 2, 10)  # partition 2 open, with rows on disk
    _count(tables, b"cam8", 2, 4)
    disk.touch()  # the disk fills up
    guard = tables.guards[0]
    with caplog.at_level(logging.ERROR, logger="streamapp.tables.store_guard"):
        _count(tables, b"cam6", 1, 5)  # partition 1 was never opened: its open fails
        _count(tables, b"cam6", 1, 5)
        _count(tables, b"cam7", 2, 1)  # refused, kept
        assert not guard.recover()  # partition 2 closed and its reopen fails: served read-only
        # ...through a reader with the configured block cache (2 MiB), not rocksdict's 8 MiB
        reader = guard._readers[2]._db
        assert reader.property_int_value("rocksdb.block-cache-capacity") == 2 * 1024 * 1024
        _count(tables, b"cam7", 2, 1)
        for _ in range(3):
            assert not guard.recover()
    assert tables.get_stats(b"cam6") == _row(10)
    assert tables.get_stats(b"cam7") == _row(12)
    assert tables.get_stats(b"cam8") == _row(4)  # on disk only: still served, not unknown
    topic = tables.stats.changelog_topic.get_topic_name()
    tables.app.assignor.assigned_actives = lambda: {TP(topic, 1), TP(topic, 2)}
    assert dict(tables.iter_stats()) == {
        b"cam6": _row(10), b"cam7": _row(12), b"cam8": _row(4)
    }  # what GET /devices lists
    status = tables.write_status()["device_stats"]
    assert status.partitions == (1, 2) and status.rows_in_memory == 2
    assert "No space left on device" in status.error
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors  # one per interval (only device_stats is written here)
    assert all(r.exc_info is None for r in errors)

    disk.unlink()  # space freed: the next retry opens both and writes the kept rows
    assert guard.recover() and tables.guards[1].recover()
    assert not tables.write_status()["device_stats"].degraded
    assert _on_disk(tables, b"cam6", 1) == _stored(10)
    assert _on_disk(tables, b"cam7", 2) == _stored(12)
    assert _on_disk(tables, b"cam8", 2) == _stored(4)
    _count(tables, b"cam8", 2, 1)
    assert tables.get_stats(b"cam8") == _row(5) and _on_disk(tables, b"cam8", 2) == _stored(5)
