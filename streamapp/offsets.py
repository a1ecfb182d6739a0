"""Our own source-offset bookkeeping: commit only what is really finished, never skip a record.

Faust's commit path loses records around rebalances (faust-streaming issues #216, #221, #318,
#606, and shared/BROKER.md): messages prefetched in an old generation are acked as "skipped"
without being processed, and after a partition comes back Faust forgets its committed offset and
commits the highest *contiguous run of acked offsets* even when that run does not start at the
committed offset. Either way offsets are committed for records nobody processed.

So streamapp turns Faust's acking off for its source topics (``acks=False``) and keeps this
tracker instead. Per partition it knows the next offset it must see (the committed offset when
the partition was assigned) and the offsets read but not yet finished:

* a record whose offset is the expected one is accepted;
* an offset *beyond* the expected one is a gap (records were skipped by the consumer): the
  partition is sought back to the expected offset and records are dropped until it arrives;
* an offset *below* it was already read in this assignment (re-delivery after such a seek) and is
  dropped;
* :meth:`OffsetTracker.done` marks a record finished once its outcome was acknowledged by the
  broker, and :meth:`OffsetTracker.committable` returns, per partition, the offset after the
  longest finished prefix — the only offset that is safe to commit.

State is per assignment *epoch*: when a partition is revoked its state is dropped and late
``done`` calls from the old epoch are ignored, so they can never move a newer commit.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["TP", "Decision", "OffsetTracker", "PartitionState"]

log = logging.getLogger(__name__)

#: ``(topic, partition)``.
TP = tuple[str, int]

Decision = Literal["accept", "drop", "seek"]


@dataclass
class PartitionState:
    """Bookkeeping of one assigned partition.

    Attributes:
        epoch: Assignment epoch; ``done`` calls carrying another epoch are ignored.
        next_offset: The offset the next accepted record must have.
        pending: ``[offset, finished]`` for records read and not yet committed, in offset order.
        committed: Last offset committed (the next offset to read after a restart).
        seeking: True after a gap, until the record at ``next_offset`` arrives.
    """

    epoch: int
    next_offset: int
    committed: int
    pending: deque[list[int | bool]] = field(default_factory=deque)
    seeking: bool = False
    last_seek_at: float = 0.0
    gaps: int = 0
    dropped: int = 0


class OffsetTracker:
    """Tracks read and finished offsets per partition; see the module docstring.

    Args:
        start_offset: ``async (topic, partition) -> int``: where a newly assigned partition
            starts — its committed offset, or the log start when nothing was committed yet.
        reseek_after_s: While a seek has not landed, records beyond the gap ask for another
            seek after this long. Faust's fetch loop can undo a seek: it overwrites its read
            position with the offsets of a batch fetched before the seek and then drops the
            re-fetched records as already read.
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        start_offset: Callable[[str, int], Awaitable[int]],
        *,
        reseek_after_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._start_offset = start_offset
        self._reseek_after_s = reseek_after_s
        self._clock = clock
        self._parts: dict[TP, PartitionState] = {}
        self._epochs = 0
        self.gaps_total = 0
        self.dropped_total = 0

    def state(self, tp: TP) -> PartitionState | None:
        return self._parts.get(tp)

    async def on_read(self, topic: str, partition: int, offset: int) -> tuple[Decision, int]:
        """Decide what to do with a record just read.

        Returns:
            ``(decision, epoch)``: ``accept`` (process it; pass ``epoch`` to :meth:`done`),
            ``drop`` (already read, or waiting for a seek to land), or ``seek`` (a gap: the
            caller must seek the partition to :attr:`PartitionState.next_offset` and drop the
            record).
        """
        tp = (topic, partition)
        state = self._parts.get(tp)
        if state is None:
            start = await self._start_offset(topic, partition)
            state = self._parts.get(tp)  # another record of tp may have raced us here
            if state is None:
                self._epochs += 1
                state = PartitionState(epoch=self._epochs, next_offset=start, committed=start)
                self._parts[tp] = state
        if offset == state.next_offset:
            state.seeking = False
            state.pending.append([offset, False])
            state.next_offset = offset + 1
            return "accept", state.epoch
        state.dropped += 1
        self.dropped_total += 1
        if offset < state.next_offset:
            return "drop", state.epoch
        now = self._clock()
        if state.seeking:
            if now - state.last_seek_at < self._reseek_after_s:
                return "drop", state.epoch
            log.info(
                "%s[%d]: the seek to %d has not landed yet (read %d); seeking again",
                topic, partition, state.next_offset, offset,
            )
            state.last_seek_at = now
            return "seek", state.epoch
        state.seeking = True
        state.last_seek_at = now
        state.gaps += 1
        self.gaps_total += 1
        log.warning(
            "%s[%d]: read offset %d but expected %d (the consumer skipped %d records); seeking "
            "back so that none is lost",
            topic, partition, offset, state.next_offset, offset - state.next_offset,
        )
        return "seek", state.epoch

    def done(self, topic: str, partition: int, offset: int, epoch: int) -> None:
        """Mark a record finished (its outcome is on the broker). Ignores other epochs."""
        state = self._parts.get((topic, partition))
        if state is None or state.epoch != epoch:
            return
        pending = state.pending
        # Outcomes are produced in read order, so the record is almost always near the front.
        for entry in pending:
            if entry[0] == offset:
                entry[1] = True
                break

    def committable(self) -> dict[TP, int]:
        """Per partition with progress: the offset after its longest finished prefix."""
        out = {}
        for tp, state in self._parts.items():
            pending = state.pending
            while pending and pending[0][1]:
                pending.popleft()
            upto = int(pending[0][0]) if pending else state.next_offset
            if upto > state.committed:  # during a seek, next_offset is the gap's start: safe
                out[tp] = upto
        return out

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
        return sum(sum(1 for e in s.pending if not e[1]) for s in self._parts.values())
