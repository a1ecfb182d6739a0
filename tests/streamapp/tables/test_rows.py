"""Rows that cannot be read (issue 18, item 1): the checks, the reset rows, and what a device
answers and counts after its stored row was bad. Integration: tests/integration/test_bad_rows.py."""

from __future__ import annotations

import json
import logging
from typing import Any

import faust
import pytest

from streamapp.app import TableRetryStore
from streamapp.tables.aggregates import public_stats
from streamapp.tables.base import bucket_key
from streamapp.tables.rows import RowScreen, check_bucket_row, check_stats_row, decode_row
from tests.streamapp.tables.test_device_state import make, result

GOOD_STATS = {"device_id": "cam1", "total": 5, "counts": {"result": 5, "dead_letter": 0,
                                                           "retry": 0}}


@pytest.mark.parametrize(("raw", "reason", "detail"), [
    (bytes.fromhex("fffe0067617262616765"), "undecodable", "'utf-8' codec can't decode"),
    (b'{"total": 5', "undecodable", "not UTF-8 JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "undecodable", "not UTF-8 JSON"),  # too deep to parse
    (b'"x"', "bad_shape", "a JSON str is not a stats row"),
    (b"[1, 2]", "bad_shape", "a JSON list is not a stats row"),
    (b"null", "bad_shape", "a JSON NoneType is not a stats row"),
    (b'{"total": "many"}', "bad_shape", 'total is "many", not an int >= 0'),
    (b'{"total": 5}', "bad_shape", "counts is null"),  # its total reset silently before
    (b'{"total": true, "counts": {}}', "bad_shape", "total is true"),
    (b'{"total": 5, "counts": {"result": -1}}', "bad_shape", "counts is"),
    (b'{"total": 5, "counts": {}, "_buckets": {"ten": [1]}}', "bad_shape", "_buckets is"),
    (b'{"total": 5, "counts": {}, "latency_ewma_ms": {"e2e": "fast"}}', "bad_shape",
     "latency_ewma_ms is"),
])
def test_stats_rows_that_cannot_be_read_say_why(raw: bytes, reason: str, detail: str) -> None:
    row, got_reason, got_detail = decode_row(raw, "stats")
    assert (row, got_reason) == (None, reason)
    assert detail in got_detail


def test_good_rows_pass_and_extra_keys_are_accepted_but_not_served() -> None:
    assert decode_row(json.dumps(GOOD_STATS).encode(), "stats") == (GOOD_STATS, "", "")
    extra = {**GOOD_STATS, "written_by": "a newer version"}
    row, reason, _ = decode_row(json.dumps(extra).encode(), "stats")
    assert row == extra and reason == ""
    assert "written_by" not in public_stats(extra)
    assert check_stats_row({**GOOD_STATS, "last_seq": None, "last_result": None}) is None
    assert check_bucket_row({"count": 0}) is None
    assert "labels is" in (check_bucket_row({"count": 1, "labels": {"3": "x"}}) or "")
    assert "e2e_max_ms is" in (check_bucket_row({"count": 1, "e2e_max_ms": "x"}) or "")


async def test_a_device_whose_stored_row_is_bad_answers_the_reset_then_counts_afresh(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The wrong-shape instances of the issue: ``/devices`` answered 500 and the device was
    never updated again (``"x"``, ``[1, 2]``), or its total went 5 -> 3 silently."""
    for bad in (b'"x"', b"[1, 2]", b'{"total": "many"}'):
        tables, observer, reader, _ = make(now=1_000.0)
        tables.stats[b"cam1"] = bad
        with caplog.at_level(logging.ERROR, logger="streamapp.tables.rows"):
            before = reader.stats(b"cam1")
            assert before is not None and before["total"] == 0
            assert before["state_reset"]["reason"] == "bad_shape"
            # every documented field, as a fresh device has it (not only until the next write)
            assert {k: v for k, v in before.items() if k != "state_reset"} == {
                "device_id": "cam1", "total": 0,
                "counts": {"result": 0, "dead_letter": 0, "retry": 0},
                "dead_letters_by_reason": {}, "retries_by_reason": {}, "last_seq": None,
                "last_result": None,
                "latency_ewma_ms": {"e2e": None, "queue": None, "infer": None},
                "clock_skew": {"count": 0, "last_ms": None, "last_ts": None},
                "first_seen": None, "last_seen": None}
            assert reader.windows(b"cam1", "tumbling", 3) is not None  # no 500 either
            assert [d["total"] for d in reader.devices()] == [0]
            for seq in range(3):
                observer.on_outcome(result("cam1", seq, 1_000.0))
            await observer.flush()
        assert observer.stats.failures == 0
        after = reader.stats(b"cam1")
        assert after is not None
        assert (after["total"], after["counts"]["result"]) == (3, 3)  # afresh, and says so
        assert after["state_reset"] == before["state_reset"]
        assert after["first_seen"] == 1_000.0 and after["last_seq"] == 2  # filled in afresh
        assert json.loads(tables.stats[b"cam1"])["total"] == 3  # the bad row is overwritten
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3  # one per bad row, however often it was read


async def test_a_bad_bucket_reads_as_an_empty_one_and_its_windows_say_so() -> None:
    tables, observer, reader, _ = make(now=1_000.0)
    observer.on_outcome(result("cam1", 0, 1_000.0))
    await observer.flush()
    key = bucket_key(b"cam1", 10_000, 1_000_000)
    tables.buckets[key] = b'{"count": -4}'
    windows = reader.windows(b"cam1", "tumbling", 1)
    assert windows is not None and windows[0]["count"] == 0
    assert windows[0]["state_reset"]["detail"] == "count is -4, not an int >= 0"
    observer.on_outcome(result("cam1", 1, 1_000.0))
    await observer.flush()
    windows = reader.windows(b"cam1", "tumbling", 1)
    assert windows is not None and windows[0]["count"] == 1 and "state_reset" in windows[0]
    stats = reader.stats(b"cam1")
    assert stats is not None and stats["total"] == 2 and "state_reset" not in stats


def test_the_retry_counts_table_drops_a_bad_restored_row_and_keeps_the_good_ones(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = faust.App("rows-test", broker="kafka://127.0.0.1:1", datadir=str(tmp_path))
    table = app.Table("retry_counts", key_type=bytes, value_type=bytes, partitions=4,
                      store="memory://")
    store = TableRetryStore(table)
    topic = table.changelog_topic.get_topic_name()

    class Message:
        def __init__(self, offset: int, key: bytes, value: bytes | None) -> None:
            self.topic, self.partition, self.offset = topic, 1, offset
            self.key, self.value, self.tp = key, value, faust.types.TP(topic, 1)

    class Event:
        def __init__(self, message: Message) -> None:
            self.message, self.key, self.value = message, message.key, message.value

    good = json.dumps({"attempts": 2, "last_error": None, "errors": [],
                       "device_id": "cam1"}).encode()
    with caplog.at_level(logging.ERROR, logger="streamapp.tables.rows"):
        table.apply_changelog_batch([Event(Message(0, b"r1", good)),
                                     Event(Message(1, b"r2", good)),
                                     Event(Message(2, b"r2", b"\xff\xfe\x00garbage")),
                                     Event(Message(3, b"r3", b'{"attempts": "two"}'))])
    assert store.get("r1") == json.loads(good)
    assert store.get("r2") is None and store.get("r3") is None
    assert b"r2" not in table and b"r3" not in table
    assert store.screen.rejected == {("undecodable", "changelog"): 1,
                                     ("bad_shape", "changelog"): 1}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and f"{topic}[1]@2, key 'r2'" in errors[0]
    assert "attempt row is dropped" in errors[0]


def test_a_bad_stored_row_is_counted_once_per_key() -> None:
    screen = RowScreen("device_stats", "stats")
    for i in range(3):
        assert screen.read(f"k{i}".encode(), b"[]") is not None
    assert screen.read(b"k0", b"[]") is not None
    assert screen.rejected == {("bad_shape", "store"): 3}
