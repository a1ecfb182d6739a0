"""The decode cache of :class:`~streamapp.tables.rows.RowScreen`: rows read back with the bytes
this worker wrote are not decoded again, and anything else that changed the stored bytes (a
restored changelog record, a reset, a delete, another writer) is read as without the cache."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import faust
import pytest

from streamapp.settings import Settings
from streamapp.tables import MemoryDeviceTables
from streamapp.tables.base import bucket_key
from streamapp.tables.faust_tables import define_tables
from streamapp.tables.rows import (
    RowScreen,
    _bucket_row_ok,
    _bucket_row_problem,
    _stats_row_ok,
    _stats_row_problem,
)
from tests.streamapp.tables.test_device_state import make, result
from tests.streamapp.tables.test_faust_tables import Event, _restore

ROW = {"device_id": "cam1", "total": 1, "counts": {"result": 1, "dead_letter": 0, "retry": 0}}


def _written(screen: RowScreen, key: bytes, row: dict[str, Any]) -> bytes:
    raw = json.dumps(row).encode()
    screen.written(key, raw, row)
    return raw


def test_the_bytes_written_last_answer_the_written_row_without_a_decode() -> None:
    screen = RowScreen("device_stats", "stats", cache_rows=8)
    raw = _written(screen, b"cam1", ROW)
    # equal bytes, not the same object: what RocksDB returns for every get
    row = screen.read(b"cam1", bytes(bytearray(raw)))
    assert row is ROW and screen.cache_hits == 1


def test_bytes_changed_behind_the_cache_are_decoded_and_the_new_row_is_read() -> None:
    screen = RowScreen("device_stats", "stats", cache_rows=8)
    _written(screen, b"cam1", ROW)
    other = {**ROW, "total": 7, "counts": {"result": 7}}
    assert screen.read(b"cam1", json.dumps(other).encode()) == other
    assert screen.cache_hits == 0
    assert screen.read(b"cam1", json.dumps(other).encode()) == other  # now the cached one
    assert screen.cache_hits == 1
    assert screen.read(b"cam1", None) is None  # deleted


def test_bad_bytes_behind_the_cache_are_reset_and_logged_once_as_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    screen = RowScreen("device_stats", "stats", cache_rows=8, clock=lambda: 1_000.0)
    raw = _written(screen, b"cam1", ROW)
    with caplog.at_level(logging.ERROR, logger="streamapp.tables.rows"):
        resets = [screen.read(b"cam1", b"[1, 2]") for _ in range(3)]
    assert all(r is not None and r["total"] == 0 for r in resets)
    assert resets[0] is not None and resets[0]["state_reset"]["reason"] == "bad_shape"
    assert screen.rejected == {("bad_shape", "store"): 1}
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1
    assert screen.read(b"cam1", raw) == ROW  # the good bytes again: the good row


def test_a_written_row_the_check_rejects_is_not_kept_and_reads_as_a_reset() -> None:
    screen = RowScreen("device_stats", "stats", cache_rows=8)
    good = _written(screen, b"cam1", ROW)
    bad_row = {**ROW, "total": -1}
    bad = _written(screen, b"cam1", bad_row)
    row = screen.read(b"cam1", bad)
    assert row is not None and row["total"] == 0 and "state_reset" in row
    assert screen.rejected == {("bad_shape", "store"): 1}
    assert screen.read(b"cam1", good) == ROW and screen.cache_hits == 0  # forgotten


def test_the_cache_keeps_at_most_cache_rows_keys_least_recently_used_leaving_first() -> None:
    screen = RowScreen("device_windows", "bucket", cache_rows=3)
    raws = {}
    for i in range(5):
        raws[i] = _written(screen, f"k{i}".encode(), {"count": i})
        assert screen.cached_rows() == min(i + 1, 3)
    assert screen.read(b"k2", raws[2]) == {"count": 2} and screen.cache_hits == 1  # k2: newest
    screen.written(b"k5", json.dumps({"count": 5}).encode(), {"count": 5})  # k3 leaves
    assert screen.cached_rows() == 3
    assert screen.read(b"k3", raws[3]) == {"count": 3} and screen.cache_hits == 1  # decoded
    assert screen.read(b"k0", raws[0]) == {"count": 0} and screen.cache_hits == 1  # decoded
    assert screen.cached_rows() == 3  # reads that decode are kept, within the bound too
    assert screen.read(b"k3", raws[3]) is not None and screen.cache_hits == 2
    screen.forget(b"k3")
    assert screen.cached_rows() == 2


def test_no_cache_and_a_negative_bound() -> None:
    screen = RowScreen("device_stats", "stats")
    raw = _written(screen, b"cam1", ROW)
    assert screen.read(b"cam1", raw) == ROW and screen.cache_hits == 0
    assert screen.cached_rows() == 0
    with pytest.raises(ValueError, match="cache_rows is -1"):
        RowScreen("device_stats", "stats", cache_rows=-1)


async def test_the_flush_reads_back_its_own_rows_from_the_cache_and_no_caller_modifies_them(
) -> None:
    """The observer, the reader and the listing share the cached rows: after all of them ran,
    every cached row is still exactly what its stored bytes decode to."""
    tables, observer, reader, clock = make(now=1_000.0)
    for flush in range(4):
        for seq in range(6):
            observer.on_outcome(result(f"cam{seq % 3}", flush * 6 + seq, clock.now))
        observer.on_outcome(result("cam0", 99, clock.now, kind="dead_letter",
                                   reason="bad_shape"))
        await observer.flush()
        assert reader.stats(b"cam0") is not None
        assert reader.windows(b"cam1", "hopping", 6) is not None
        assert len(reader.devices()) == 3
        clock.now += 4.0  # into the next buckets now and then
    stats, windows = tables.screens["device_stats"], tables.screens["device_windows"]
    assert stats.cache_hits >= 3 * 3  # each flush after the first read its rows back
    assert windows.cache_hits > 0
    for screen, stored in ((stats, tables.stats), (windows, tables.buckets)):
        hits = screen.cache_hits
        for key, raw in stored.items():
            assert screen.read(key, raw) == json.loads(raw)
        assert screen.cache_hits == hits + len(stored)  # every row answered from the cache
    assert reader.stats(b"cam0")["total"] == 4 * 3  # type: ignore[index]


async def test_a_bad_row_put_in_the_memory_tables_behind_the_cache_is_reset() -> None:
    tables, observer, reader, _ = make(now=1_000.0)
    observer.on_outcome(result("cam1", 0, 1_000.0))
    await observer.flush()
    assert reader.stats(b"cam1")["total"] == 1  # type: ignore[index]
    tables.stats[b"cam1"] = b'{"total": "many"}'
    before = reader.stats(b"cam1")
    assert before is not None and before["total"] == 0 and "state_reset" in before
    observer.on_outcome(result("cam1", 1, 1_000.0))
    await observer.flush()
    after = reader.stats(b"cam1")
    assert after is not None and after["total"] == 1 and after["state_reset"] == \
        before["state_reset"]


async def test_listing_every_device_does_not_fill_the_cache() -> None:
    tables = MemoryDeviceTables(cache_rows=4)
    for i in range(10):
        tables.stats[f"cam{i}".encode()] = json.dumps({**ROW, "device_id": f"cam{i}"}).encode()
    assert len(list(tables.iter_stats())) == 10
    assert tables.screens["device_stats"].cached_rows() == 0


def test_a_deleted_bucket_leaves_the_cache() -> None:
    tables = MemoryDeviceTables()
    key = bucket_key(b"cam1", 10_000, 1_000_000)
    tables.set_bucket(key, {"count": 1})
    assert tables.screens["device_windows"].cached_rows() == 1
    tables.delete_bucket(key)
    assert tables.screens["device_windows"].cached_rows() == 0
    assert tables.get_bucket(key) is None


@pytest.fixture
def faust_tables(tmp_path: Path) -> Any:
    settings = Settings(app_id="cache-test", topic_partitions=4, data_dir=tmp_path)
    app = faust.App(settings.app_id, broker="kafka://127.0.0.1:1", datadir=str(tmp_path),
                    topic_partitions=4)
    return define_tables(app, settings)


async def test_a_changelog_record_restored_over_a_written_row_is_read(
    faust_tables: Any,
) -> None:
    """A rebalance: this worker wrote cg00 and cg01, another one wrote newer rows, and they
    come back from the changelog (one of them unreadable). (async: a Faust table write
    needs a running loop.)"""
    tables = faust_tables
    for key in (b"cg00", b"cg01"):
        with tables.writing(key, Event(tables.request_topic, 2, key)):
            tables.set_stats(key, {**ROW, "device_id": key.decode()})
            tables.set_bucket(key + b"\x00b", {"count": 1})
    screen = tables.screens["device_stats"]
    assert tables.get_stats(b"cg00")["total"] == 1 and screen.cache_hits == 1
    newer = {**ROW, "device_id": "cg01", "total": 9, "counts": {"result": 9}}
    _restore(tables.stats, [(5, b"cg01", json.dumps(newer).encode()),
                            (6, b"cg00", b"\xff\xfe garbage")])
    _restore(tables.windows, [(5, b"cg00\x00b", json.dumps({"count": 4}).encode()),
                              (6, b"cg01\x00b", None)])
    assert tables.get_stats(b"cg01") == newer
    reset = tables.get_stats(b"cg00")
    assert reset["total"] == 0 and reset["state_reset"]["reason"] == "undecodable"
    assert tables.get_bucket(b"cg00\x00b") == {"count": 4}
    assert tables.get_bucket(b"cg01\x00b") is None
    assert screen.cache_hits == 1  # none of them came from the cache


@pytest.mark.parametrize("value", [
    None, 0, -1, 1.5, 2.0, float("nan"), float("inf"), True, "x", [], [1], [True], {}, {"a": 1},
    {"a": -1}, {"a": True}, {"a": 1.0}, 2**1030,
])
def test_the_fast_checks_accept_no_row_the_full_checks_reject(value: Any) -> None:
    """The fast path of a check may send a good row to the full check, never a bad row past
    it: put every odd value in every field (and sub-field) of a full row."""
    stats = {
        "device_id": "cam1", "total": 2, "counts": {"result": 2}, "dead_letters_by_reason": {},
        "retries_by_reason": {"oom": 1}, "last_seq": 3, "last_result": {"seq": 3},
        "latency_ewma_ms": {"e2e": 1.5, "queue": None}, "clock_skew": {"count": 0},
        "first_seen": 1.0, "last_seen": 2, "_buckets": {"10000": [1, 2]},
        "_windows": {"tumbling_ms": 10, "hopping_ms": 20, "step_ms": 10}, "state_reset": {},
    }
    bucket = {"count": 1, "results": 1, "dead_letters": 0, "retries": 0, "skipped": 0,
              "e2e_sum_ms": 1.0, "e2e_n": 1, "e2e_max_ms": 1, "labels": {"3": 1},
              "state_reset": {}}
    assert _stats_row_ok(stats) and _bucket_row_ok(bucket)
    for full, ok, problem in ((stats, _stats_row_ok, _stats_row_problem),
                              (bucket, _bucket_row_ok, _bucket_row_problem)):
        rows: list[Any] = [value]
        for name, field_value in full.items():
            rows.append({**full, name: value})
            if isinstance(field_value, dict):
                for sub in [*field_value, "count", "tumbling_ms", "x"]:
                    rows.append({**full, name: {**field_value, sub: value}})
        rows.append({**full, "_buckets": {"ten": [1]}})
        for row in rows:
            if ok(row):
                assert problem(row) is None, row
