"""OffsetTracker: commit only finished prefixes, never skip a record."""

from __future__ import annotations

from streamapp.offsets import OffsetTracker

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


async def test_records_that_no_longer_exist_are_passed_once_the_records_before_finish() -> None:
    t = tracker(100)
    _, epoch = await t.on_read(T, 0, 100)
    t.skip_to(T, 0, 105)  # 101..104 were deleted by retention
    assert (await t.on_read(T, 0, 105))[0] == "accept"
    t.done(T, 0, 105, epoch)
    assert t.committable() == {}  # 100 is still running
    assert t.in_flight() == 1
    t.done(T, 0, 100, epoch)
    assert t.committable() == {(T, 0): 106}
    assert t.in_flight() == 0


async def test_a_second_ack_of_the_same_record_changes_nothing() -> None:
    t = tracker(0)
    epochs = [(await t.on_read(T, 0, o))[1] for o in range(3)]
    t.done(T, 0, 1, epochs[1])
    t.done(T, 0, 1, epochs[1])
    assert t.in_flight() == 2
    t.done(T, 0, 0, epochs[0])
    assert t.committable() == {(T, 0): 2}
    t.done(T, 0, 0, epochs[0])  # late duplicate below the finished prefix
    assert t.in_flight() == 1 and t.committable() == {(T, 0): 2}


async def test_many_out_of_order_acks_commit_exactly_the_finished_prefix() -> None:
    t = tracker(0)
    n = 10_000
    epoch = 0
    for o in range(n):
        epoch = (await t.on_read(T, 0, o))[1]
    for o in range(n - 1, 0, -1):  # every record but the first finishes, newest first
        t.done(T, 0, o, epoch)
    assert t.committable() == {} and t.in_flight() == 1
    t.done(T, 0, 0, epoch)
    assert t.committable() == {(T, 0): n} and t.in_flight() == 0
