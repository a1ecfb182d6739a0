"""Window arithmetic for the per-device aggregates (no Faust, no I/O).

Windows are aligned to the epoch and measured in **processing time**: an outcome counts in the
window that holds the moment it was produced (``Outcome.ts``), not the device's capture time,
so a device with a wrong clock cannot write into far-away windows.

Storage keeps *buckets*: tumbling windows of ``tumbling_window_s``, and buckets of
``hopping_step_s`` from which hopping windows are assembled at read time (a hopping window of
60 s every 10 s is the sum of six 10 s buckets). Every aggregate is mergeable (counts, sums,
maxima, histograms), so this is exact, and a write touches one bucket per series instead of
``hopping_window_s / hopping_step_s`` overlapping windows. When the tumbling size equals the
hopping step the two series are the same buckets, stored once.

Why not Faust's windowed tables
-------------------------------
The design brief asked for windowed tables to build micro-batches. The product does two
different things instead, for these reasons:

*Micro-batches are built in memory* (:mod:`streamapp.batching`), not in a table. A batch lives for
at most ``max_batch_delay_ms`` (5 ms by default), and what makes it durable is that none of its
records' offsets is committed until every outcome is acknowledged by the broker: after a crash
the records are read again (:mod:`streamapp.offsets`). Collecting requests in a table would add,
per request, a RocksDB put and a changelog record carrying the whole tensor (up to
``max_request_bytes``), plus a delete when the batch closes, and a worker taking over a partition
would first restore those pending requests from the changelog — all to protect data Kafka
already keeps. Faust closes windows from a timer (``table_cleanup_interval``, 30 s by default),
far too coarse for a 5 ms batch deadline.

*Per-device window aggregates are our own buckets* in plain RocksDB tables
(:mod:`streamapp.tables.faust_tables`) rather than ``Table(...).tumbling()`` / ``.hopping()``:

* Writes: a Faust hopping table writes every window that contains the timestamp — ``size / step``
  keys, each a RocksDB put and a changelog record (6 for 60 s every 10 s) — for every update. We
  write one step bucket per series, and only once per batch per device (the observer groups a
  batch's outcomes): a batch of 32 requests of one device writes its stats row and one bucket
  (two when the tumbling size differs from the hopping step), where windowed tables updated per
  request would write 32 × (1 tumbling + 6 hopping) window keys with the default sizes.
* Restore: what a moved partition restores is the buckets (``hopping_window_s / hopping_step_s``
  times fewer rows than overlapping hopping windows), with the device's stats row, from compacted
  changelogs; the restart tests check the rows come back.
* Known Faust issues on this path: faust-streaming #172 (a tumbling table's ``on_window_close``
  fired irregularly, and for only one of several partitions) and the thread of pull request #412
  (hopping windows not holding a whole window's data; a maintainer noting that windowed data did not
  survive a worker restart or rebalance with the RocksDB driver). In the faust-streaming 0.15.3
  installed here, ``Table._del_old_keys`` looks up ``_partition_timestamp_keys`` by ``(partition,
  window_range)`` while it is keyed by ``(partition, range_end)``, so the lookup never matches (a
  comment there says so). Expiry and window closing are exactly where these bugs sit, and our
  windows need neither callbacks nor Faust's timer.

What it costs: this module and :mod:`streamapp.tables.aggregates` are ours to maintain; a
hopping window is summed from its step buckets at every read; buckets expire
(``window_expires_s``) only when their device writes again, so a silent device keeps its old
buckets on disk (not served); windows use processing time only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from streamapp.settings import Settings

__all__ = ["WindowKind", "WindowPlan", "WindowRange"]

WindowKind = Literal["tumbling", "hopping"]
WINDOW_KINDS: tuple[WindowKind, ...] = ("tumbling", "hopping")


@dataclass(frozen=True, slots=True)
class WindowRange:
    """One window to answer: ``[start_ms, end_ms)`` and the bucket starts (ms) it is made of."""

    start_ms: int
    end_ms: int
    bucket_size_ms: int
    buckets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """Sizes of the windows and buckets, all in integer milliseconds.

    Args:
        tumbling_ms: Tumbling window size.
        hopping_ms: Hopping window size, a multiple of ``step_ms``.
        step_ms: Hopping step (= size of the buckets hopping windows are made of).
        expires_ms: Buckets ending longer ago than this are deleted and not served.
    """

    tumbling_ms: int
    hopping_ms: int
    step_ms: int
    expires_ms: int
    #: :attr:`bucket_sizes_ms`, computed once (it is read for every outcome)
    _sizes_ms: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_sizes_ms", tuple(sorted({self.tumbling_ms, self.step_ms})))

    @classmethod
    def from_settings(cls, settings: Settings) -> WindowPlan:
        return cls(
            tumbling_ms=round(settings.tumbling_window_s * 1000),
            hopping_ms=round(settings.hopping_window_s * 1000),
            step_ms=round(settings.hopping_step_s * 1000),
            expires_ms=round(settings.window_expires_s * 1000),
        )

    @property
    def bucket_sizes_ms(self) -> tuple[int, ...]:
        """Sizes of the stored bucket series (one or two), ascending, ms."""
        return self._sizes_ms

    @staticmethod
    def bucket_start(ts_s: float, size_ms: int) -> int:
        """Start (epoch ms) of the bucket of ``size_ms`` holding epoch second ``ts_s``."""
        return (math.floor(ts_s * 1000) // size_ms) * size_ms

    def bucket_starts(self, ts_s: float) -> dict[int, int]:
        """``{bucket size: bucket start}`` of every series for an outcome at ``ts_s``."""
        ms = math.floor(ts_s * 1000)
        return {size: (ms // size) * size for size in self._sizes_ms}

    def expired(self, size_ms: int, start_ms: int, now_s: float) -> bool:
        """True when the bucket ended more than ``expires_ms`` before ``now_s``."""
        return start_ms + size_ms <= math.floor(now_s * 1000) - self.expires_ms

    def max_last(self, kind: WindowKind) -> int:
        """The most windows of ``kind`` a query can ask for (what expiry keeps)."""
        if kind == "tumbling":
            return max(1, self.expires_ms // self.tumbling_ms)
        return max(1, (self.expires_ms - self.hopping_ms) // self.step_ms + 1)

    def size_ms(self, kind: WindowKind) -> int:
        return self.tumbling_ms if kind == "tumbling" else self.hopping_ms

    def step_of(self, kind: WindowKind) -> int:
        return self.tumbling_ms if kind == "tumbling" else self.step_ms

    def last_windows(self, kind: WindowKind, last: int, now_s: float) -> list[WindowRange]:
        """The ``last`` most recent windows of ``kind`` at ``now_s``, oldest first.

        The newest tumbling window is the one holding ``now_s`` (still filling). The newest
        hopping window is the one that ends when the current step bucket ends, i.e. the last
        ``hopping_window_s`` up to now; each older one starts ``hopping_step_s`` earlier.
        """
        if kind == "tumbling":
            size = self.tumbling_ms
            current = self.bucket_start(now_s, size)
            return [
                WindowRange(start, start + size, size, (start,))
                for start in (current - i * size for i in range(last - 1, -1, -1))
            ]
        step, size = self.step_ms, self.hopping_ms
        newest_end = self.bucket_start(now_s, step) + step
        out = []
        for i in range(last - 1, -1, -1):
            end = newest_end - i * step
            start = end - size
            out.append(WindowRange(start, end, step, tuple(range(start, end, step))))
        return out
