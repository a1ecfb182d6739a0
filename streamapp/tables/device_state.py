"""Per-device state: a pipeline observer that writes it, and a reader the views answer from.

:class:`DeviceStateObserver` collects outcomes in memory (:meth:`~DeviceStateObserver.on_outcome`
is a dict update) and writes each touched device's rows once per batch
(:meth:`~DeviceStateObserver.flush`): one stats row and one bucket per window series, plus the
deletion of buckets that expired. Faust's per-write cost (a RocksDB put and a changelog record)
is what limits a table-updating agent to a few thousand messages per second
(``docs/broker.md``); batching the writes keeps tables off the critical path.

A device is identified by its **record key** (raw bytes) when the outcome came from the request
topic — the key routing and partitioning use — and by the request's ``device_id`` otherwise
(retries). Records with neither (no key, undecodable value), with a key longer than
:data:`MAX_DEVICE_KEY_BYTES`, and dead letters whose key is not a valid device id
(:func:`streamapp.records.device_id_problem`: no view could show such a device) are not
attributed to a device; metrics still count them.

Counts are at-least-once like the pipeline: after a crash, requests that were processed but not
committed are processed again and counted again (bounded by the in-flight window).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamapp.agents.observer import Outcome
from streamapp.batching import BatchInfo
from streamapp.exceptions import TableUnavailableError
from streamapp.records import device_id_problem
from streamapp.tables.aggregates import (
    DeviceDelta,
    merge_bucket,
    public_stats,
    render_window,
    update_stats,
)
from streamapp.tables.base import DeviceTables, bucket_key
from streamapp.tables.windows import WindowKind, WindowPlan

__all__ = ["MAX_DEVICE_KEY_BYTES", "DeviceStateObserver", "DeviceStateReader", "FlushStats"]

#: Longest device key (bytes) whose rows are kept. A row's key and its ``device_id`` travel in
#: one changelog record, which must stay far below the producer's 1 MB limit; ids this long are
#: not ids (issue 10: a 600,000-character device_id). Their outcomes count as unattributed.
MAX_DEVICE_KEY_BYTES = 1024

log = logging.getLogger(__name__)


@dataclass
class FlushStats:
    """Counters since start: flushes, rows written, buckets expired, failed device flushes,
    outcomes that could not be attributed to a device."""

    flushes: int = 0
    rows_written: int = 0
    buckets_expired: int = 0
    failures: int = 0
    unattributed: int = 0


def _queryable(key: bytes) -> bool:
    """Whether ``key`` is a device id the views answer for (the rule requests are checked with
    at intake, :func:`streamapp.records.device_id_problem`)."""
    try:
        return device_id_problem(key.decode("utf-8")) is None
    except UnicodeDecodeError:
        return False


class DeviceStateObserver:
    """:class:`~streamapp.agents.observer.PipelineObserver` that keeps ``device_stats`` and the
    window buckets.

    Args:
        tables: Where rows go.
        plan: Window sizes and expiry.
        request_topic: Outcomes whose event came from this topic are keyed by the record key.
        ewma_alpha: Weight of the newest latency in the EWMA.
        clock: Epoch seconds (tests pass a fake).
    """

    #: Commits wait for this observer's flush (see ``InferencePipeline.flush_state``).
    writes_state = True

    def __init__(
        self,
        tables: DeviceTables,
        plan: WindowPlan,
        *,
        request_topic: str,
        ewma_alpha: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.tables = tables
        self.plan = plan
        self.request_topic = request_topic
        self.ewma_alpha = ewma_alpha
        self.clock = clock
        self.stats = FlushStats()
        self._pending: dict[bytes, tuple[DeviceDelta, Any]] = {}

    def _device(self, outcome: Outcome) -> tuple[bytes, Any] | None:
        event = outcome.event
        message = getattr(event, "message", None)
        if message is not None and message.topic == self.request_topic and message.key:
            key = bytes(message.key)
            device = outcome.device_id.encode() if outcome.device_id else None
            # The event is not always the outcome's own record: records read to fill a
            # consumer gap (streamapp.app.admitted) share the event of the record that revealed
            # the gap, whose key is another device's. A decoded request's key equals its
            # device_id (else it is dead-lettered as key_mismatch), so a device_id that differs
            # from the event's key means the event belongs to another record: the device is the
            # device_id (same partition: both keys hash to it). A dead letter stays with the
            # record's key: its device_id (when readable) was never checked against the key.
            if outcome.kind == "dead_letter" and not _queryable(key):
                return None  # e.g. bad_device_id: no view could ever show this device
            if device is None or device == key or outcome.kind == "dead_letter":
                return key, event
            return device, None
        if outcome.device_id and outcome.reason != "invalid_retry_record":
            # (the ids of an invalid retry record are whatever its writer put there)
            return outcome.device_id.encode(), None
        return None

    def on_outcome(self, outcome: Outcome) -> None:
        device = self._device(outcome)
        if device is None or len(device[0]) > MAX_DEVICE_KEY_BYTES:
            self.stats.unattributed += 1
            return
        key, event = device
        pending = self._pending.get(key)
        if pending is None:
            delta = DeviceDelta(key.decode("utf-8", "replace"))
            self._pending[key] = (delta, event)
        else:
            delta = pending[0]
            if event is not None:  # the newest event of the device selects the partition
                self._pending[key] = (delta, event)
        delta.add(outcome, self.plan)

    def on_batch(self, model: str, info: BatchInfo) -> None:
        return None

    def discard_pending(self) -> int:
        """Drop the outcomes not written yet (the tables cannot take them); returns how many
        devices had some."""
        dropped, self._pending = len(self._pending), {}
        return dropped

    async def flush(self) -> None:
        """Write what the outcomes since the last flush changed, one device at a time."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        now = self.clock()
        self.stats.flushes += 1
        for key, (delta, event) in pending.items():
            try:
                self._write(key, delta, event, now)
            except TableUnavailableError:
                # its partition's database cannot even be read (the guard logs that once per
                # interval): nothing was written, so the update waits for the next flush
                self.stats.failures += 1
                self._pending.setdefault(key, (delta, event))
            except Exception:
                self.stats.failures += 1
                log.exception("could not update the tables of device %r", key)
        await self.tables.flushed()

    def _write(self, key: bytes, delta: DeviceDelta, event: Any, now: float) -> None:
        tables = self.tables
        with tables.writing(key, event):
            row, expired = update_stats(
                tables.get_stats(key), delta, self.plan, alpha=self.ewma_alpha, now_s=now
            )
            for (size, start), part in delta.buckets.items():
                if (size, start) in expired:
                    continue
                bkey = bucket_key(key, size, start)
                tables.set_bucket(bkey, merge_bucket(tables.get_bucket(bkey), part))
            for size, start in expired:
                tables.delete_bucket(bucket_key(key, size, start))
            tables.set_stats(key, row)
        self.stats.rows_written += 1 + len(delta.buckets)
        self.stats.buckets_expired += len(expired)


class DeviceStateReader:
    """Answers queries from the rows this worker holds (the views route to the owner first)."""

    def __init__(self, tables: DeviceTables, plan: WindowPlan,
                 clock: Callable[[], float] = time.time) -> None:
        self.tables = tables
        self.plan = plan
        self.clock = clock

    def stats(self, device_key: bytes) -> dict[str, Any] | None:
        """The device's stats as served, or None when this worker has no row for it."""
        row = self.tables.get_stats(device_key)
        return None if row is None else public_stats(row)

    def windows(
        self, device_key: bytes, kind: WindowKind, last: int
    ) -> list[dict[str, Any]] | None:
        """The ``last`` most recent windows of ``kind`` (oldest first, empty ones included),
        or None when the device is unknown here."""
        if self.tables.get_stats(device_key) is None:
            return None
        now = self.clock()
        cache: dict[tuple[int, int], dict[str, Any] | None] = {}

        def bucket(size: int, start: int) -> dict[str, Any] | None:
            if (size, start) not in cache:
                expired = self.plan.expired(size, start, now)
                cache[(size, start)] = None if expired else self.tables.get_bucket(
                    bucket_key(device_key, size, start)
                )
            return cache[(size, start)]

        return [
            render_window(w, (bucket(w.bucket_size_ms, s) for s in w.buckets))
            for w in self.plan.last_windows(kind, last, now)
        ]

    def devices(self) -> list[dict[str, Any]]:
        """Summaries of every device this worker owns."""
        out = []
        for key, row in self.tables.iter_stats():
            out.append({
                "device_id": row.get("device_id") or key.decode("utf-8", "replace"),
                "total": row.get("total", 0),
                "counts": row.get("counts", {}),
                "last_seq": row.get("last_seq"),
                "last_seen": row.get("last_seen"),
                "e2e_ewma_ms": (row.get("latency_ewma_ms") or {}).get("e2e"),
            })
        return out
