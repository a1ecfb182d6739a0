"""Our own source-offset bookkeeping: commit only what is really finished, never skip a record.

Faust's commit path loses records around rebalances (faust-streaming issues #216, #221, #318,
#606, and docs/broker.md): messages prefetched in an old generation are acked as "skipped"
without being processed, and after a partition comes back Faust forgets its committed offset and
commits the highest *contiguous run of acked offsets* even when that run does not start at the
committed offset. Either way offsets are committed for records nobody processed.

This is not a Tansu artefact: on Apache Kafka 4.4.0 (tests/integration/test_delivery.py run
with ``--broker=kafka``, worker logs) Faust handed out records past the committed offset too.
After a SIGKILL and restart with static membership, the new worker was assigned each partition
at its committed offset (813/814), was handed two records, then the record 5-6 offsets further
on, on all four partitions. When a second worker joined and left, the first worker was handed
records 16 offsets past its position on two partitions, and the second joining worker, assigned
a partition at its committed offset 143, was handed 143 and 144 and then offset 3,375, near the
end of the partition (3,230 records skipped). Transaction markers and aborted
transactions also leave offsets that no consumer is handed; those are not gaps
(:meth:`OffsetTracker.skip_to` with ``lost=False``).

So streamapp turns Faust's acking off for its source topics (``acks=False``) and keeps this
tracker instead. Per partition it knows the next offset it must see (the committed offset when
the partition was assigned) and the offsets read but not yet finished:

* a record whose offset is the expected one is accepted;
* an offset *beyond* the expected one is a gap (records were skipped by the consumer): the
  caller reads the skipped records itself (a plain consumer, outside the group) and offers them
  first — seeking Faust's consumer back does not work reliably, because its fetch loop overwrites
  its read position with batches fetched before the seek and then drops the re-fetched records;
* an offset *below* it was already read in this assignment and is dropped;
* :meth:`OffsetTracker.done` marks a record finished once its outcome was acknowledged by the
  broker, and :meth:`OffsetTracker.committable` returns, per partition, the offset after the
  longest finished prefix — the only offset that is safe to commit.

Every call costs O(1) per record (amortised): a partition keeps the offset after its finished
prefix (a low-water mark) and the set of offsets finished above it; the mark moves over that set
as the records before them finish.

State is per assignment *epoch*: when a partition is revoked its state is dropped and late
``done`` calls from the old epoch are ignored, so they can never move a newer commit.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["TP", "Decision", "OffsetTracker", "PartitionState"]

log = logging.getLogger(__name__)

#: ``(topic, partition)``.
TP = tuple[str, int]

Decision = Literal["accept", "drop", "gap"]


@dataclass(slots=True)
class PartitionState:
    """Bookkeeping of one assigned partition.

    Attributes:
        epoch: Assignment epoch; ``done`` calls carrying another epoch are ignored.
        next_offset: The offset the next accepted record must have.
        committed: Last offset committed (the next offset to read after a restart).
        low: The offset after the longest finished prefix: every record below it is finished
            or no longer exists (``committed <= low <= next_offset``).
        finished: Offsets finished above ``low`` (outcomes acknowledged out of read order).
        missing: ``start -> end`` of offset ranges at or above ``low`` that no longer exist on
            the broker (given up by :meth:`OffsetTracker.skip_to`); ``low`` jumps over them.
        unfinished: Records accepted and not yet finished.
    """

    epoch: int
    next_offset: int
    committed: int
    low: int = 0
    finished: set[int] = field(default_factory=set)
    missing: dict[int, int] = field(default_factory=dict)
    unfinished: int = 0
    gaps: int = 0
    dropped: int = 0

    def accept(self, offset: int) -> None:
        """Take ``offset`` (== :attr:`next_offset`) as read and not yet finished."""
        self.next_offset = offset + 1
        self.unfinished += 1

    def finish(self, offset: int) -> None:
        """Mark an accepted record finished (a second call for the same offset is ignored)."""
        if offset < self.low or offset >= self.next_offset or offset in self.finished:
            return
        self.unfinished -= 1
        if offset != self.low:
            self.finished.add(offset)
            return
        self.low = offset + 1
        self._advance()

    def give_up_to(self, offset: int) -> None:
        """Records from :attr:`next_offset` up to ``offset`` no longer exist: move past them."""
        if self.low == self.next_offset:
            self.low = offset
        else:
            self.missing[self.next_offset] = offset
        self.next_offset = offset

    def _advance(self) -> None:
        low, finished, missing = self.low, self.finished, self.missing
        while True:
            if low in finished:
                finished.discard(low)
                low += 1
            elif low in missing:
                low = missing.pop(low)
            else:
                break
        self.low = low


class OffsetTracker:
    """Tracks read and finished offsets per partition; see the module docstring.

    Args:
        start_offset: ``async (topic, partition) -> int``: where a newly assigned partition
            starts — its committed offset, or the log start when nothing was committed yet.
    """

    def __init__(self, start_offset: Callable[[str, int], Awaitable[int]]) -> None:
        self._start_offset = start_offset
        self._parts: dict[TP, PartitionState] = {}
        self._epochs = 0
        self.gaps_total = 0
        self.gap_records_total = 0
        self.dropped_total = 0

    def state(self, tp: TP) -> PartitionState | None:
        return self._parts.get(tp)

    async def ensure(self, topic: str, partition: int) -> PartitionState:
        """The state of a partition, created from its start offset when first seen."""
        tp = (topic, partition)
        state = self._parts.get(tp)
        if state is None:
            start = await self._start_offset(topic, partition)
            state = self._parts.get(tp)  # another caller may have raced us here
            if state is None:
                self._epochs += 1
                state = PartitionState(
                    epoch=self._epochs, next_offset=start, committed=start, low=start
                )
                self._parts[tp] = state
                log.info("%s[%d] assigned: reading from offset %d", topic, partition, start)
        return state

    async def on_read(self, topic: str, partition: int, offset: int) -> tuple[Decision, int]:
        """Decide what to do with a record just read.

        Returns:
            ``(decision, epoch)``: ``accept`` (process it; pass ``epoch`` to :meth:`done`),
            ``drop`` (already read in this assignment), or ``gap`` (records between
            :attr:`PartitionState.next_offset` and this one were skipped by the consumer: the
            caller must read and offer those first, then offer this record again).
        """
        state = await self.ensure(topic, partition)
        if offset == state.next_offset:
            state.accept(offset)
            return "accept", state.epoch
        if offset < state.next_offset:
            state.dropped += 1
            self.dropped_total += 1
            return "drop", state.epoch
        state.gaps += 1
        self.gaps_total += 1
        self.gap_records_total += offset - state.next_offset
        # DEBUG: the offsets between may hold no data (transaction markers, aborted records);
        # the caller logs a warning once the direct read found records there.
        log.debug(
            "%s[%d]: read offset %d but expected %d: %d offsets between; reading them before "
            "going on so that no record is lost",
            topic, partition, offset, state.next_offset, offset - state.next_offset,
        )
        return "gap", state.epoch

    def skip_to(self, topic: str, partition: int, offset: int, *, lost: bool = True) -> None:
        """Move past offsets before ``offset`` that hold no record to process.

        Args:
            lost: True: the records were deleted by retention (an ERROR: they cannot be
                answered). False: the offsets hold no data records (transaction markers,
                records of aborted transactions); nothing is lost.
        """
        state = self._parts.get((topic, partition))
        if state is not None and offset > state.next_offset:
            if lost:
                log.error(
                    "%s[%d]: records %d..%d no longer exist on the broker (retention); they "
                    "cannot be answered", topic, partition, state.next_offset, offset - 1,
                )
            else:
                log.debug(
                    "%s[%d]: offsets %d..%d hold no data records (transaction markers or "
                    "aborted transactions)", topic, partition, state.next_offset, offset - 1,
                )
            state.give_up_to(offset)

    def try_accept(self, tp: TP, offset: int) -> PartitionState | None:
        """Accept ``offset`` without waiting when it is exactly the partition's next offset (the
        common case); None when :meth:`on_read` must decide (unknown partition, gap, repeat)."""
        state = self._parts.get(tp)
        if state is None or offset != state.next_offset:
            return None
        state.accept(offset)
        return state

    def done(self, topic: str, partition: int, offset: int, epoch: int) -> None:
        """Mark a record finished (its outcome is on the broker). Ignores other epochs."""
        state = self._parts.get((topic, partition))
        if state is not None and state.epoch == epoch:
            state.finish(offset)

    def committable(self) -> dict[TP, int]:
        """Per partition with progress: the offset after its longest finished prefix."""
        return {tp: s.low for tp, s in self._parts.items() if s.low > s.committed}

    def mark_committed(self, offsets: dict[TP, int]) -> None:
        """Record offsets the broker accepted as committed."""
        for tp, offset in offsets.items():
            state = self._parts.get(tp)
            if state is not None and offset > state.committed:
                state.committed = offset

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop the state of revoked partitions (their late ``done`` calls are then ignored)."""
        for tp in tps:
            self._parts.pop(tp, None)

    def assigned(self) -> list[TP]:
        return sorted(self._parts)

    def in_flight(self) -> int:
        """Records read and not yet finished, all partitions."""
        return sum(s.unfinished for s in self._parts.values())
