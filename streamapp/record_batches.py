"""Record batches the worker cannot decode: never a stopped partition, never a silent loss.

aiokafka raises out of its fetcher when a fetched record batch cannot be decoded: a CRC mismatch
(``CorruptRecordException``), a compression codec it has no library for
(``UnsupportedCodecError``), or any other decompression or parse error. The consumer's position
stays at that batch, so a worker crashed there again after every restart and no other device of
the partition was ever answered.

:func:`guard_record_batches` patches aiokafka (0.14, pinned) in one place: the object that
unpacks one partition's fetched batches (``aiokafka.consumer.fetcher.PartitionRecords``), which
every consumer of the process uses (Faust's, and the direct reads of
:func:`streamapp.kafka.read_partition_range`). A v2 batch header (base offset, last offset
delta, record count, attributes) is readable without decompressing, so the offsets a bad batch
covers are known:

* **Request and retry topics** (the *guarded* topics): each offset from the first one not yet
  handed out to ``base offset + last offset delta`` comes out as a stand-in record (key and
  value None, the batch's first timestamp), and the batch is registered here;
  :func:`take_undecodable` finds it by offset, and the pipeline turns each stand-in into an
  ``undecodable_record_batch`` dead letter. The stand-ins are ordinary offsets to delivery, so
  their acknowledged dead letters move the committed offset past the batch.
* **Any other topic** (table changelogs, read by Faust's table recovery): one ERROR naming
  ``topic[partition]@first..last`` and the error, and the batch is skipped. One stand-in, for
  the batch's last offset, still comes out: Faust's recovery waits until it was handed the
  offset before a changelog partition's end, so a skipped batch at the end would keep a worker
  from ever becoming ready. :func:`is_skipped_stand_in` tells it apart, and
  :func:`streamapp.faust_compat.guard_undecodable_batches` keeps it out of the tables (a None
  value would delete a row). A worker that stopped instead would stop again on every restart,
  and so would every worker the changelog partition moved to; the rows of a changelog are
  derived state (statistics, windows, attempt counters) that later updates rewrite.

Both are counted (:func:`undecodable_counts`, exported in ``/metrics``). Not handled (aiokafka
raises as before): control batches (written by the broker, no data records) and legacy v0/v1
message sets (no last offset delta in their header).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from aiokafka.errors import CorruptRecordException

from streamapp.exceptions import InvalidRequestError

__all__ = [
    "MAX_KEPT_BATCH_BYTES",
    "UndecodableBatch",
    "UndecodableBatchError",
    "guard_record_batches",
    "is_skipped_stand_in",
    "take_undecodable",
    "undecodable_counts",
]

log = logging.getLogger(__name__)

#: Codec names by the low three bits of a batch's attributes (Kafka's record batch format).
CODECS = {0: "none", 1: "gzip", 2: "snappy", 3: "lz4", 4: "zstd"}

#: Raw bytes of undecodable batches kept for their dead letters until taken, all batches
#: together (bytes). Beyond it a batch is registered without its bytes (size and sha256 kept).
MAX_KEPT_BATCH_BYTES = 64 << 20

#: Undecodable batches registered and not yet taken, at most (the oldest is dropped beyond it).
MAX_PENDING_BATCHES = 10_000

#: Distinct batches remembered for counting (a batch fetched again is not counted again).
_MAX_SEEN = 10_000

#: Batch framing, v0 to v2: base offset (int64), then the length of the rest (int32).
_FRAME_BYTES = 12
#: A v2 batch's stored CRC-32C (uint32) is at bytes 17-20; it covers byte 21 (attributes) to
#: the end of the batch (Kafka's protocol guide, "Record Batch").
_CRC_AT, _CRC_FROM = 17, 21
#: Batches from this many bytes have their CRC computed by google-crc32c; smaller ones by
#: aiokafka, whose C call costs less than the Python around google-crc32c's
#: (``python -m bench.record_batches``: a 171 B record alone, 4.6 against 5.3 µs).
_CRC_OWN_FROM_BYTES = 4096


def _hardware_crc32c() -> Any:
    """google-crc32c's ``value`` when it runs the C extension (the CPU's CRC instruction where
    there is one), else None: its pure-Python fallback is far slower than aiokafka's C code."""
    try:
        import google_crc32c
    except ImportError:
        return None
    return google_crc32c.value if google_crc32c.implementation == "c" else None


#: CRC-32C of bytes, or None to leave the check to aiokafka (:meth:`_GuardedBatch.validate_crc`).
_crc32c = _hardware_crc32c()


@dataclass(frozen=True, slots=True)
class UndecodableBatch:
    """A fetched record batch that could not be decoded.

    Attributes:
        topic / partition: Where it is.
        first_offset / last_offset: The offsets it covers (base offset, base offset + last
            offset delta), from its header.
        undecoded_from: The first offset without a decoded record (``first_offset`` unless
            decoding failed part way).
        record_count: Records the header claims (fewer than the offsets after compaction);
            None when the fetched bytes were not available.
        attributes: The header's attributes (codec in the low three bits).
        codec: ``none``, ``gzip``, ``snappy``, ``lz4``, ``zstd`` or ``codec-N``.
        error_type / error_message: The decoding error.
        size_bytes / sha256: Of the whole batch as fetched (header included); None when the
            fetched bytes were not available.
        data: The batch's bytes as fetched, or None (not available, or over
            :data:`MAX_KEPT_BATCH_BYTES`).
    """

    topic: str
    partition: int
    first_offset: int
    last_offset: int
    undecoded_from: int
    record_count: int | None
    attributes: int
    codec: str
    error_type: str
    error_message: str
    size_bytes: int | None = None
    sha256: str | None = None
    data: bytes | None = field(default=None, repr=False)

    def where(self) -> str:
        """``topic[partition]@first..last``."""
        return f"{self.topic}[{self.partition}]@{self.first_offset}..{self.last_offset}"

    def describe(self) -> dict[str, Any]:
        """The batch for a dead letter's ``extra.record_batch`` (JSON-ready, no bytes)."""
        return {
            "first_offset": self.first_offset,
            "last_offset": self.last_offset,
            "undecoded_from": self.undecoded_from,
            "record_count": self.record_count,
            "attributes": self.attributes,
            "codec": self.codec,
            "size_bytes": self.size_bytes,
            "sha256": self.sha256,
            "error": {"type": self.error_type, "message": self.error_message},
        }


class UndecodableBatchError(InvalidRequestError):
    """The record at ``offset`` lies in a batch the worker cannot decode (reason
    ``undecodable_record_batch``; not retriable: the same bytes fail the same way).

    Args:
        batch: The batch.
        offset: The record's offset (within the batch).
    """

    def __init__(self, batch: UndecodableBatch, offset: int) -> None:
        super().__init__(
            "undecodable_record_batch",
            f"offset {offset} lies in record batch {batch.where()} ({batch.codec}, "
            f"{batch.size_bytes if batch.size_bytes is not None else '?'} bytes), which the "
            f"worker cannot decode: {batch.error_type}: {batch.error_message}. Every offset of "
            f"the batch from {batch.undecoded_from} has a dead letter; the one of offset "
            f"{batch.undecoded_from} holds the batch's bytes when they fit. Install the codec's "
            "library (cramjam for snappy/lz4/zstd) or have the producer use one the worker has, "
            "then send the requests again",
        )
        self.batch = batch
        self.offset = offset
        #: The decoding error's type, shown as the dead letter's ``error.type``.
        self.error_type = batch.error_type

    def batch_value(self) -> bytes | None:
        """The batch's bytes for this offset's dead letter: only for the batch's first undecoded
        offset, and only when they were kept; else None."""
        return self.batch.data if self.offset == self.batch.undecoded_from else None


# -- the registry ---------------------------------------------------------------------------------


class _Registry:
    """Process-wide: guarded topics, batches pending their dead letters, counters.

    The fetcher runs in Faust's consumer thread and the pipeline in the worker's event loop, so
    every access holds the lock.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.guarded: set[str] = set()
        self.pending: OrderedDict[tuple[str, int, int], UndecodableBatch] = OrderedDict()
        self.kept_bytes = 0
        self.seen: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        #: ``(topic, partition, offset)`` of the stand-ins of skipped batches.
        self.skipped: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        #: ``(topic, handling) -> [batches, offsets]``; handling ``dead_lettered`` / ``skipped``.
        self.counts: dict[tuple[str, str], list[int]] = {}

    def register(self, batch: UndecodableBatch, handling: str) -> UndecodableBatch:
        """Count a batch (once per batch) and, for a guarded topic, keep it until taken."""
        key = (batch.topic, batch.partition, batch.first_offset)
        with self.lock:
            if key not in self.seen:
                self.seen[key] = None
                if len(self.seen) > _MAX_SEEN:
                    self.seen.popitem(last=False)
                counts = self.counts.setdefault((batch.topic, handling), [0, 0])
                counts[0] += 1
                counts[1] += batch.last_offset - batch.first_offset + 1
            if handling != "dead_lettered":
                self.skipped[(batch.topic, batch.partition, batch.last_offset)] = None
                if len(self.skipped) > _MAX_SEEN:
                    self.skipped.popitem(last=False)
                return batch
            self._drop(key)
            if batch.data is not None and self.kept_bytes + len(batch.data) > MAX_KEPT_BATCH_BYTES:
                batch = replace(batch, data=None)
            self.pending[key] = batch
            self.kept_bytes += len(batch.data or b"")
            while len(self.pending) > MAX_PENDING_BATCHES:
                self._drop(next(iter(self.pending)))
            return batch

    def take(self, topic: str, partition: int, offset: int) -> UndecodableBatch | None:
        with self.lock:
            for key, batch in self.pending.items():
                if key[:2] == (topic, partition) and batch.first_offset <= offset \
                        <= batch.last_offset:
                    if offset == batch.last_offset:
                        self._drop(key)
                    return batch
        return None

    def _drop(self, key: tuple[str, int, int]) -> None:
        batch = self.pending.pop(key, None)
        if batch is not None:
            self.kept_bytes -= len(batch.data or b"")


_REGISTRY = _Registry()


def take_undecodable(topic: str, partition: int, offset: int) -> UndecodableBatch | None:
    """The undecodable batch that holds ``offset`` of a guarded topic, or None.

    Call it for a record whose value is None; the batch is forgotten once its last offset was
    taken (a batch fetched again is registered again).
    """
    return _REGISTRY.take(topic, partition, offset)


def is_skipped_stand_in(topic: str, partition: int, offset: int) -> bool:
    """Whether the record at ``offset`` (key and value None) is the stand-in of a skipped batch
    of a topic that is not guarded (see the module docstring)."""
    with _REGISTRY.lock:
        return (topic, partition, offset) in _REGISTRY.skipped


def undecodable_counts(
    topics: Iterable[str] | None = None,
) -> dict[tuple[str, str], tuple[int, int]]:
    """``{(topic, handling): (batches, offsets)}`` of undecodable batches met by this process,
    each batch counted once. ``handling``: ``dead_lettered`` (guarded topics) or ``skipped``.

    Args:
        topics: Only these topics (one worker's; several apps may share a test process).
    """
    wanted = None if topics is None else set(topics)
    with _REGISTRY.lock:
        return {
            key: (counts[0], counts[1]) for key, counts in _REGISTRY.counts.items()
            if wanted is None or key[0] in wanted
        }


# -- the aiokafka patch ---------------------------------------------------------------------------


@dataclass(slots=True)
class _StandIn:
    """What aiokafka's ``PartitionRecords._consumer_record`` reads of a record."""

    offset: int
    timestamp: int
    timestamp_type: int
    key: None = None
    value: None = None
    checksum: None = None
    headers: tuple[()] = ()


class _GuardedBatch:
    """One fetched v2 batch as aiokafka's unpacking loop sees it.

    Hides a CRC mismatch from ``validate_crc`` and turns any error while iterating its records
    into stand-ins or a logged skip (:func:`_undecodable`). Everything else is the batch's own.
    """

    def __init__(self, tp: Any, batch: Any, buffer: bytes | None, start: int,
                 end: int | None) -> None:
        self._tp = tp
        self._batch = batch
        self._buffer = buffer
        self._start = start
        self._end = end  # where its frame says it ends in buffer (may be past a short fetch)
        self._error: BaseException | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    def __next__(self) -> Any:  # aiokafka reads a control batch's marker with next(batch)
        return next(self._batch)

    def validate_crc(self) -> bool:
        if self._crc_matches():
            return True
        if self._batch.is_control_batch:
            return False  # aiokafka raises, as before (see the module docstring)
        self._error = CorruptRecordException(
            f"Invalid CRC of the record batch at {self._tp.topic}[{self._tp.partition}]@"
            f"{self._batch.base_offset} (stored checksum {self._batch.crc})"
        )
        return True  # aiokafka goes on to iterate it: stand-ins or a skip

    def _crc_matches(self) -> bool:
        """Whether the batch's CRC-32C matches its bytes: computed with :data:`_crc32c` over
        the fetched buffer (unpacking a 301 kB record with aiokafka's table-driven C code
        took 166 µs on the 2-core machine, with google-crc32c 30, copy included:
        ``python -m bench.record_batches``), or by aiokafka where that is not available, for
        a batch under :data:`_CRC_OWN_FROM_BYTES`, or where the buffer does not hold this
        batch where expected."""
        buffer, start, end = self._buffer, self._start, self._end
        if _crc32c is None or buffer is None or end is None:
            return bool(self._batch.validate_crc())
        if end > len(buffer) or end - start < _CRC_OWN_FROM_BYTES \
                or int.from_bytes(buffer[start:start + 8], "big", signed=True) \
                != self._batch.base_offset:
            return bool(self._batch.validate_crc())
        covered = buffer[start + _CRC_FROM:end]
        if not isinstance(covered, bytes):  # google-crc32c takes read-only bytes only
            covered = bytes(covered)
        stored = int.from_bytes(buffer[start + _CRC_AT:start + _CRC_FROM], "big")
        return bool(_crc32c(covered) == stored)

    def __iter__(self) -> Iterator[Any]:
        base = int(self._batch.base_offset)
        undecoded_from = base
        if self._error is None:
            try:
                records = iter(self._batch)  # decompresses
                while True:
                    try:
                        record = next(records)
                    except StopIteration:
                        return
                    undecoded_from = int(record.offset) + 1
                    yield record
            except Exception as exc:  # any decoding error: the batch's, not the worker's
                self._error = exc
        assert self._error is not None
        yield from _undecodable(self, self._error, undecoded_from)

    def raw(self) -> bytes | None:
        """The batch's bytes as fetched, or None when unknown."""
        buffer, end = self._buffer, self._end
        if buffer is None or end is None or end > len(buffer):
            return None
        return bytes(buffer[self._start:end])


def _undecodable(
    guarded: _GuardedBatch, error: BaseException, undecoded_from: int
) -> Iterator[_StandIn]:
    """Stand-ins for the offsets of a batch from ``undecoded_from`` (guarded topic), or a
    logged skip with one stand-in for the last offset (any other topic)."""
    batch = guarded._batch
    tp = guarded._tp
    base = int(batch.base_offset)
    last = base + int(batch.last_offset_delta)
    if undecoded_from > last:
        return
    raw = guarded.raw()
    attributes = int(batch.attributes)
    info = UndecodableBatch(
        topic=tp.topic, partition=tp.partition, first_offset=base, last_offset=last,
        undecoded_from=undecoded_from, record_count=_record_count(raw), attributes=attributes,
        codec=CODECS.get(attributes & 0x07, f"codec-{attributes & 0x07}"),
        error_type=type(error).__name__, error_message=_message(error),
        size_bytes=None if raw is None else len(raw),
        sha256=None if raw is None else hashlib.sha256(raw).hexdigest(), data=raw,
    )
    timestamp = int(getattr(batch, "first_timestamp", -1) or -1)
    timestamp_type = int(getattr(batch, "timestamp_type", 0) or 0)
    if tp.topic not in _REGISTRY.guarded:
        _REGISTRY.register(info, "skipped")
        log.error(
            "%s[%d]@%d..%d: the record batch cannot be decoded (%s: %s; %s, %s bytes); skipped: "
            "this topic is not a request topic, its records are not dead-lettered (a table "
            "changelog loses these rows until they are written again). Install the codec's "
            "library if it is missing.", tp.topic, tp.partition, undecoded_from, last,
            info.error_type, info.error_message, info.codec, info.size_bytes,
        )
        yield _StandIn(last, timestamp, timestamp_type)  # recovery must reach the end
        return
    _REGISTRY.register(info, "dead_lettered")
    log.warning(
        "%s[%d]@%d..%d: the record batch cannot be decoded (%s: %s; %s, %s bytes); its offsets "
        "go to the DLQ as undecodable_record_batch", tp.topic, tp.partition, undecoded_from,
        last, info.error_type, info.error_message, info.codec, info.size_bytes,
    )
    for offset in range(undecoded_from, last + 1):
        yield _StandIn(offset, timestamp, timestamp_type)


def _message(error: BaseException) -> str:
    """The error's own message (aiokafka's errors prefix their ``str`` with code and name)."""
    first = error.args[0] if len(error.args) == 1 else None
    return first if isinstance(first, str) and first else str(error)


def _record_count(raw: bytes | None) -> int | None:
    """The v2 header's record count (int32 at byte 57), or None when the bytes are unknown."""
    if raw is None or len(raw) < 61:
        return None
    return int.from_bytes(raw[57:61], "big", signed=True)


class _GuardedRecords:
    """Stands in for aiokafka's ``MemoryRecords`` (one partition's fetched bytes) inside
    ``PartitionRecords``: hands out each v2 batch wrapped in :class:`_GuardedBatch`."""

    def __init__(self, tp: Any, records: Any) -> None:
        self._tp = tp
        self._records = records
        self._buffer: bytes | None = getattr(records, "streamapp_buffer", None)
        self._position = 0

    def has_next(self) -> bool:
        return bool(self._records.has_next())

    def size_in_bytes(self) -> int:
        return int(self._records.size_in_bytes())

    def next_batch(self) -> Any:
        batch = self._records.next_batch()
        start, end = self._position, None
        if self._buffer is not None and start + _FRAME_BYTES <= len(self._buffer):
            length = int.from_bytes(self._buffer[start + 8:start + 12], "big", signed=True)
            end = self._position = start + _FRAME_BYTES + max(0, length)
        if batch is None or not hasattr(batch, "last_offset_delta"):
            return batch  # a legacy v0/v1 message set: not guarded
        return _GuardedBatch(self._tp, batch, self._buffer, start, end)


_install_lock = threading.Lock()
_installed = False


def guard_record_batches(topics: Iterable[str]) -> None:
    """Install the patch (once per process) and guard ``topics`` (request and retry topics):
    their undecodable batches become stand-in records; other topics' are skipped with an ERROR.

    Relies on aiokafka 0.14 internals: ``aiokafka.consumer.fetcher`` builds
    ``MemoryRecords(data)`` of each partition's fetched bytes and hands it, positionally second,
    to ``PartitionRecords(tp, records, ...)``, whose ``_unpack_records`` calls
    ``records.has_next()`` / ``next_batch()``, ``batch.validate_crc()``, reads the batch header's
    attributes and iterates the batch's records. aiokafka has no hook for undecodable batches.
    """
    global _installed
    with _REGISTRY.lock:
        _REGISTRY.guarded.update(topics)
    with _install_lock:
        if _installed:
            return
        from aiokafka.consumer import fetcher

        memory_records = fetcher.MemoryRecords

        class KeptMemoryRecords(memory_records):  # type: ignore[misc, valid-type]
            """aiokafka's ``MemoryRecords`` that keeps the fetched bytes (to slice out a bad
            batch for its dead letter)."""

            def __init__(self, buffer: bytes) -> None:
                super().__init__(buffer)
                self.streamapp_buffer = buffer

        original_init = fetcher.PartitionRecords.__init__

        def guarded_init(self: Any, tp: Any, records: Any, *args: Any, **kwargs: Any) -> None:
            original_init(self, tp, _GuardedRecords(tp, records), *args, **kwargs)

        fetcher.MemoryRecords = KeptMemoryRecords
        fetcher.PartitionRecords.__init__ = guarded_init
        _installed = True
