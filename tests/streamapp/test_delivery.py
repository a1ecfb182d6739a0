"""Delivery: admission, gap filling, acknowledgement and commits against a fake consumer."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import pytest

from streamapp.agents.pipeline import SourceMessage
from streamapp.delivery import STABLE_OFFSET_TRIES, Delivery, Record
from streamapp.offsets import TP

T = "requests"


class FakeConsumer:
    """:class:`streamapp.delivery.Consumer` over a dict of records of one topic."""

    def __init__(self, records: dict[int, tuple[bytes, bytes]], start: int = 10,
                 position: int | None = None) -> None:
        self.records = records
        self.start = start
        self.at = position
        self.is_settled = True
        self.commits: list[dict[TP, int]] = []
        self.reads: list[tuple[int, int, int]] = []

    async def committed_or_earliest(self, topic: str, partition: int) -> int:
        return self.start

    async def commit(self, offsets: Mapping[TP, int]) -> bool:
        self.commits.append(dict(offsets))
        return True

    def settled(self, topic: str) -> bool:
        return self.is_settled

    async def position(self, topic: str, partition: int) -> int | None:
        return self.at

    async def read_range(self, topic: str, partition: int, start: int, end: int) -> list[Record]:
        self.reads.append((partition, start, end))
        return [(o, *self.records[o]) for o in range(start, end) if o in self.records]


def delivery(consumer: FakeConsumer) -> Delivery:
    return Delivery(consumer, commit_interval_s=60.0)


async def test_admit_reads_the_skipped_records_first_then_the_one_read() -> None:
    records = {o: (b"k", f"v{o}".encode()) for o in range(10, 20)}
    consumer = FakeConsumer(records)
    d = delivery(consumer)
    got = await d.admit(T, 0, 13, b"k", b"v13")  # the consumer resumed past the committed 10
    assert [(m.offset, m.value) for m in got] == [
        (10, b"v10"), (11, b"v11"), (12, b"v12"), (13, b"v13")
    ]
    assert consumer.reads == [(0, 10, 13)]
    # records read to fill the gap get an event of their own, for table writes
    assert [(m.event.message.partition, m.event.message.offset) for m in got[:3]] == [
        (0, 10), (0, 11), (0, 12)
    ]
    assert await d.admit(T, 0, 12, b"k", b"v12") == []  # re-delivered: already read
    assert [m.offset for m in await d.admit(T, 0, 14, b"k", b"v14")] == [14]
    for m in got:
        m.ack()
    await d.commit_now()
    assert consumer.commits == [{(T, 0): 14}]
    assert d.stats.commits == 1


async def test_admit_hands_out_the_agents_event_for_the_record_itself() -> None:
    d = delivery(FakeConsumer({}, start=0))
    event = object()
    [message] = await d.admit(T, 3, 0, b"k", b"v", event)
    assert isinstance(message, SourceMessage)
    assert (message.topic, message.partition, message.offset, message.event) == (T, 3, 0, event)


async def test_admit_skips_records_the_broker_no_longer_has(caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    records = {o: (b"k", b"v") for o in range(12, 20)}  # 10 and 11 deleted by retention
    d = delivery(FakeConsumer(records))
    got = await d.admit(T, 0, 13, b"k", b"v13")
    assert [m.offset for m in got] == [12, 13]
    assert "no longer exist" in caplog.text


class CommittingMeanwhile(FakeConsumer):
    """The group's committed offset answers ``answers`` in turn (the last one from then on): a
    previous owner committed after the assignment's first read."""

    def __init__(self, records: dict[int, tuple[bytes, bytes]], answers: list[int]) -> None:
        super().__init__(records, start=answers[0])
        self.answers = list(answers)
        self.asked = 0

    async def committed_or_earliest(self, topic: str, partition: int) -> int:
        self.asked += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


class OneTransaction:
    async def commit(self, committable: object) -> dict[TP, int]:
        return {}


async def test_a_gap_the_previous_owner_committed_meanwhile_is_not_read_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At-least-once: the assignment started from committed 10, the previous owner committed
    12 before the consumer fetched (from 13): only 12 is read and processed again."""
    caplog.set_level(logging.INFO, "streamapp.delivery")
    records = {o: (b"k", f"v{o}".encode()) for o in range(10, 20)}
    consumer = CommittingMeanwhile(records, [10, 12])
    d = delivery(consumer)
    got = await d.admit(T, 0, 13, b"k", b"v13")
    assert [m.offset for m in got] == [12, 13]
    assert consumer.reads == [(0, 12, 13)]
    assert d.stats.committed_meanwhile == 1
    assert "offsets 10..11 were committed by the partition's previous owner" in caplog.text
    for m in got:
        m.ack()
    await d.commit_now()
    assert consumer.commits == [{(T, 0): 14}]


async def test_exactly_once_waits_for_the_previous_owners_offsets_to_become_stable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """exactly_once: the committed offset still reads 10 twice (the previous owner's transaction
    markers not written yet, KIP-447), then 13: nothing before 13 is answered again."""
    monkeypatch.setattr("streamapp.delivery.STABLE_OFFSET_WAIT_S", 0.0)
    records = {o: (b"k", f"v{o}".encode()) for o in range(10, 20)}
    consumer = CommittingMeanwhile(records, [10, 10, 10, 13])
    d = Delivery(consumer, commit_interval_s=60.0, transactions=OneTransaction())
    got = await d.admit(T, 0, 13, b"k", b"v13")
    assert [m.offset for m in got] == [13]
    assert consumer.reads == []
    assert consumer.asked == 4  # the assignment's read, then three more


async def test_exactly_once_reads_a_real_gap_after_the_committed_offset_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("streamapp.delivery.STABLE_OFFSET_WAIT_S", 0.0)
    records = {o: (b"k", f"v{o}".encode()) for o in range(10, 20)}
    consumer = CommittingMeanwhile(records, [10])
    d = Delivery(consumer, commit_interval_s=60.0, transactions=OneTransaction())
    got = await d.admit(T, 0, 13, b"k", b"v13")
    assert [m.offset for m in got] == [10, 11, 12, 13]
    assert consumer.asked == 1 + STABLE_OFFSET_TRIES
    assert d.stats.committed_meanwhile == 0


async def test_sweep_reads_records_skipped_at_the_end_of_a_partition() -> None:
    """The consumer jumped past the last records and nothing later arrives to reveal the gap:
    when idle, the position beyond what was read is the evidence."""
    records = {o: (b"k", f"v{o}".encode()) for o in range(10, 16)}
    # the consumer fetched up to 15, but only 10 and 11 were delivered
    consumer = FakeConsumer(records, position=16)
    d = delivery(consumer)
    d.on_assigned({(T, 0)})
    processed: list[int] = []

    async def process(message: SourceMessage) -> None:
        processed.append(message.offset)
        message.ack()

    d._process, d._busy = process, lambda: False  # as start() sets them, without the loops
    for m in await d.admit(T, 0, 10, b"k", b"v10") + await d.admit(T, 0, 11, b"k", b"v11"):
        processed.append(m.offset)
        m.ack()
    assert await d.sweep_gaps() == 0  # not idle yet: records may still be in Faust's buffers
    d._last_admit_at -= 10  # idle for a while, and no rebalance lately
    d._last_rebalance_at -= 10
    consumer.is_settled = False  # Faust may still hold fetched records
    assert await d.sweep_gaps() == 0
    consumer.is_settled = True
    assert await d.sweep_gaps() == 0  # it was not settled for the whole idle time
    d._last_unsettled_at -= 10
    assert await d.sweep_gaps() == 0  # first look at the position: it may have just moved
    assert consumer.reads == []
    assert await d.sweep_gaps() == 4  # the same position one sweep later: skipped records
    assert processed == [10, 11, 12, 13, 14, 15]
    assert d.tracker.committable() == {(T, 0): 16}
    assert await d.sweep_gaps() == 0  # nothing left


async def test_records_of_partitions_no_longer_assigned_leave_no_state_behind() -> None:
    """A record fetched before its partition was revoked and delivered late must not create
    tracking state: when the partition came back, that state's old position made the worker
    re-read everything its other owner had done meanwhile."""
    records = {o: (b"k", b"v") for o in range(0, 2000)}
    consumer = FakeConsumer(records, start=0)
    d = delivery(consumer)
    d.on_assigned({(T, 0), (T, 1)})
    assert [m.offset for m in await d.admit(T, 1, 0, b"k", b"v")] == [0]
    await d.on_revoked({(T, 0), (T, 1)})
    d.on_assigned({(T, 0)})  # partition 1 went to another worker
    assert await d.admit(T, 1, 1, b"k", b"v") == []  # late record of partition 1: dropped
    assert d.tracker.state((T, 1)) is None
    await d.on_revoked({(T, 0)})
    d.on_assigned({(T, 0), (T, 1)})  # partition 1 is back; its other owner committed 1500
    consumer.start = 1500
    assert [m.offset for m in await d.admit(T, 1, 1500, b"k", b"v")] == [1500]  # no re-read
    assert consumer.reads == []


async def test_a_record_stops_being_current_when_its_partitions_revocation_begins() -> None:
    """The state flush that revocation runs before its commit already sees the revoked
    partition's records as not current: an outcome finished meanwhile is not produced (its row
    would reach the changelog after the next owner restored it)."""
    d = delivery(FakeConsumer({}, start=0))
    d.on_assigned({(T, 0), (T, 1)})
    [m0] = await d.admit(T, 0, 0, b"k", b"v")
    [m1] = await d.admit(T, 1, 0, b"k", b"v")
    assert (d.current(m0), d.current(m1)) == (True, True)
    seen: list[tuple[bool, bool]] = []

    async def flush() -> None:
        seen.append((d.current(m0), d.current(m1)))

    async def process(message: SourceMessage) -> None:
        raise AssertionError("nothing to recover")

    d.start(process, lambda: False, flush)
    try:
        await d.on_revoked({(T, 0)})
    finally:
        await d.stop()
    assert seen == [(False, True)]
    assert (d.current(m0), d.current(m1)) == (False, True)
