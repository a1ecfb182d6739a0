"""OffsetTracker and WorkerRuntime.admit: commit only finished prefixes, never skip a record."""

from __future__ import annotations

from typing import Any

import pytest

from streamapp.offsets import OffsetTracker
from streamapp.runtime import WorkerRuntime
from streamapp.settings import Settings

T = "requests"


def tracker(start: int = 100) -> OffsetTracker:
    async def start_offset(topic: str, partition: int) -> int:
        return start

    return OffsetTracker(start_offset)


async def test_commits_only_the_finished_prefix_of_each_partition() -> None:
    t = tracker(100)
    epochs = {}
    for offset in (100, 101, 102, 103):
        decision, epochs[offset] = await t.on_read(T, 0, offset)
        assert decision == "accept"
    assert t.committable() == {}  # nothing finished yet
    t.done(T, 0, 101, epochs[101])
    t.done(T, 0, 102, epochs[102])
    assert t.committable() == {}  # 100 is not finished: 101 and 102 must wait for it
    t.done(T, 0, 100, epochs[100])
    assert t.committable() == {(T, 0): 103}  # the next offset to read after a restart
    t.mark_committed({(T, 0): 103})
    assert t.committable() == {}
    t.done(T, 0, 103, epochs[103])
    assert t.committable() == {(T, 0): 104}
    assert t.in_flight() == 0


async def test_a_record_beyond_the_expected_offset_is_a_gap_and_below_it_a_duplicate() -> None:
    t = tracker(100)
    assert (await t.on_read(T, 0, 100))[0] == "accept"
    assert (await t.on_read(T, 0, 105))[0] == "gap"  # 101..104 were skipped by the consumer
    assert t.state((T, 0)).next_offset == 101  # type: ignore[union-attr]
    assert (await t.on_read(T, 0, 100))[0] == "drop"
    for offset in range(101, 106):
        assert (await t.on_read(T, 0, offset))[0] == "accept"
    assert t.gaps_total == 1 and t.gap_records_total == 4


async def test_late_acks_from_a_revoked_assignment_cannot_move_a_newer_commit() -> None:
    t = tracker(100)
    _, old_epoch = await t.on_read(T, 0, 100)
    t.forget([(T, 0)])
    _, new_epoch = await t.on_read(T, 0, 100)  # assigned again, read again
    assert new_epoch != old_epoch
    t.done(T, 0, 100, old_epoch)  # the old outcome's ack arrives late
    assert t.committable() == {}
    t.done(T, 0, 100, new_epoch)
    assert t.committable() == {(T, 0): 101}


def runtime(records: dict[int, tuple[bytes, bytes]], start: int = 10) -> WorkerRuntime:
    async def start_offset(topic: str, partition: int) -> int:
        return start

    async def read_range(topic: str, partition: int, lo: int, hi: int) -> list[Any]:
        return [(o, *records[o]) for o in range(lo, hi) if o in records]

    async def commit(offsets: Any) -> bool:
        return True

    return WorkerRuntime(Settings(), start_offset=start_offset, commit=commit,
                         read_range=read_range)


async def test_admit_reads_the_skipped_records_first_then_the_one_read() -> None:
    records = {o: (b"k", f"v{o}".encode()) for o in range(10, 20)}
    rt = runtime(records)
    got = await rt.admit(T, 0, 13, b"k", b"v13")  # the consumer resumed past the committed 10
    assert [(a.offset, a.value) for a in got] == [
        (10, b"v10"), (11, b"v11"), (12, b"v12"), (13, b"v13")
    ]
    assert await rt.admit(T, 0, 12, b"k", b"v12") == []  # re-delivered: already read
    assert [a.offset for a in await rt.admit(T, 0, 14, b"k", b"v14")] == [14]
    for a in got:
        a.ack()
    assert rt.tracker.committable() == {(T, 0): 14}


async def test_admit_skips_records_the_broker_no_longer_has(caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    records = {o: (b"k", b"v") for o in range(12, 20)}  # 10 and 11 deleted by retention
    rt = runtime(records)
    got = await rt.admit(T, 0, 13, b"k", b"v13")
    assert [a.offset for a in got] == [12, 13]
    assert "no longer exist" in caplog.text


async def test_sweep_reads_records_skipped_at_the_end_of_a_partition() -> None:
    """The consumer jumped past the last records and nothing later arrives to reveal the gap:
    when idle, the position beyond what was read is the evidence."""
    records = {o: (b"k", f"v{o}".encode()) for o in range(10, 16)}
    processed: list[int] = []

    async def start_offset(topic: str, partition: int) -> int:
        return 10

    async def read_range(topic: str, partition: int, lo: int, hi: int) -> list[Any]:
        return [(o, *records[o]) for o in range(lo, hi) if o in records]

    async def commit(offsets: Any) -> bool:
        return True

    async def position(topic: str, partition: int) -> int:
        return 16  # the consumer fetched up to 15, but only 10 and 11 were delivered

    rt = WorkerRuntime(
        Settings(), start_offset=start_offset, commit=commit, read_range=read_range,
        position=position,
    )
    rt.on_assigned({(T, 0)})

    class Batcher:
        pending, max_pending = 0, 10

    class Pipeline:
        batcher = Batcher()

    rt.pipeline = Pipeline()  # type: ignore[assignment]

    async def process(message: Any) -> None:
        processed.append(message.offset)
        message.ack()

    rt.set_processor(process)
    for a in await rt.admit(T, 0, 10, b"k", b"v10") + await rt.admit(T, 0, 11, b"k", b"v11"):
        processed.append(a.offset)
        a.ack()
    assert await rt.sweep_gaps() == 0  # not idle yet: records may still be in Faust's buffers
    rt._last_admit_at -= 10  # idle for a while, and no rebalance lately
    rt._last_rebalance_at -= 10
    assert await rt.sweep_gaps() == 4
    assert processed == [10, 11, 12, 13, 14, 15]
    assert rt.tracker.committable() == {(T, 0): 16}
    assert await rt.sweep_gaps() == 0  # nothing left


async def test_records_of_partitions_no_longer_assigned_leave_no_state_behind() -> None:
    """A record fetched before its partition was revoked and delivered late must not create
    tracking state: when the partition came back, that state's old position made the worker
    re-read everything its other owner had done meanwhile."""
    records = {o: (b"k", b"v") for o in range(0, 2000)}
    rt = runtime(records, start=0)
    rt.on_assigned({(T, 0), (T, 1)})
    assert [a.offset for a in await rt.admit(T, 1, 0, b"k", b"v")] == [0]
    await rt.on_revoked({(T, 0), (T, 1)})
    rt.on_assigned({(T, 0)})  # partition 1 went to another worker
    assert await rt.admit(T, 1, 1, b"k", b"v") == []  # late record of partition 1: dropped
    assert rt.tracker.state((T, 1)) is None
    rt.tracker.forget([(T, 0)])
    await rt.on_revoked({(T, 0)})
    rt.on_assigned({(T, 0), (T, 1)})  # partition 1 is back; its other owner committed 1500

    async def committed(topic: str, partition: int) -> int:
        return 1500

    rt.tracker._start_offset = committed
    assert [a.offset for a in await rt.admit(T, 1, 1500, b"k", b"v")] == [1500]  # no re-read
