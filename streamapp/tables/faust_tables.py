"""Device tables as Faust tables: RocksDB (through rocksdict) plus a compacted changelog topic.

``device_stats`` and ``device_windows`` are co-partitioned with the request topic: a device's
rows live in the partition its requests are read from, so the worker that processes a device
owns its rows, and Faust's ``key_store`` (which hashes the *serialized* table key) finds that
worker because the table key is the record key itself — the device id as raw UTF-8 bytes, the
same bytes producers key requests with (``key_type=bytes`` → Faust's ``raw`` serializer).

Faust decides the partition of a table write from its *current event*, which it only sets while
an agent iterates its stream. Our writes happen after a batch finished, so :meth:`writing`
makes an event of the device current: the request record's own event when the outcome came from
the request topic, else (a retried request arrives from the retry topic, keyed by request id) a
stand-in that names the request-topic partition the device's key hashes to with Kafka's
default partitioner (murmur2), which is where its requests are read from.

**Sealing the changelog (embedded broker).** Tansu answers "latest offset" (ListOffsets) with the
start of the last stored *batch* + 1 (``docs/broker.md``). Faust reads that as the end
of a changelog partition, so after a multi-record batch it (a) stops restoring a table too early,
losing the rest of that batch, and (b) can refuse to start with ``ConsistencyError`` because
the local offset is past that "end". Both are harmless when the last batch of each partition
holds one record. So when the tables have been idle for :data:`SEAL_IDLE_S`, the
:class:`ChangelogSealer` waits until every buffered record is delivered and then appends one
tombstone for the reserved key ``b""`` (no device has an empty key: the pipeline dead-letters
such records) to each changelog partition written since the last seal: a one-record batch that
the broker reports correctly. Restarts after traffic stopped are then exact; a crash in the
middle of traffic can still lose the tail of the last batch when a table is restored from the
changelog (not when the worker keeps its data dir). Apache Kafka answers ListOffsets correctly
and needs none of this: the sealer runs only with ``broker_kind="embedded"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import faust
from aiokafka.partitioner import DefaultPartitioner

from streamapp.faust_compat import (
    StandInEvent,
    event_context,
    flush_producer,
    open_rocksdict_with_given_options,
    screen_changelog,
)
from streamapp.settings import Settings
from streamapp.tables.rows import DEVICE_ROWS_CACHED, RowScreen
from streamapp.tables.store_guard import StoreWriteGuard, TableWriteStatus

__all__ = [
    "MAX_WRITE_BUFFERS", "SEAL_KEY", "ChangelogSealer", "FaustDeviceTables", "define_tables",
    "store_options",
]

log = logging.getLogger(__name__)

STATS_TABLE = "device_stats"
WINDOWS_TABLE = "device_windows"
#: Key of the seal tombstones (see the module docstring).
SEAL_KEY = b""
#: Seconds without table writes after which written changelog partitions are sealed.
SEAL_IDLE_S = 0.25

#: Write buffers (memtables) a table database keeps: one taking writes and one being flushed
#: to disk. RocksDB's ``max_write_buffer_number``; Faust 0.15.3 sets 3.
MAX_WRITE_BUFFERS = 2
_MIB = 1024 * 1024

_partitioner = DefaultPartitioner()


def store_options(settings: Settings) -> dict[str, Any]:
    """The ``options`` of a device table's RocksDB store: the rocksdict driver and bounded memory.

    Faust 0.15.3 opens one RocksDB database per table and partition
    (``faust.stores.rocksdb.Store._db_for_partition``) and, unless told otherwise, gives each
    a 64 MiB write buffer (3 of them) and its own 2 GiB block cache
    (``faust.stores.rocksdb.RocksDBOptions``). A device row is rewritten at every state flush,
    and a memtable keeps every version until it reaches its size, so at 400 results/s from
    300 devices across 16 partitions no memtable filled in 270 s and the worker's memory grew
    with every byte written (``python -m bench.table_memory``; docs/tables.md, "Memory").

    Faust reads only ``write_buffer_size``, ``max_write_buffer_number``,
    ``target_file_size_base``, ``block_cache_size``, ``bloom_filter_size``,
    ``max_open_files`` and ``ttl`` from these options for rocksdict (other keys are ignored
    silently), and pops ``driver`` out of the dict it is given: one dict per table.

    Args:
        settings: ``table_write_buffer_mib`` and ``table_block_cache_mib`` (MiB each).

    Returns:
        A new dict for ``app.Table(..., options=...)``; sizes in bytes.
    """
    return {
        "driver": "rocksdict",
        "write_buffer_size": round(settings.table_write_buffer_mib * _MIB),
        "max_write_buffer_number": MAX_WRITE_BUFFERS,
        "block_cache_size": round(settings.table_block_cache_mib * _MIB),
    }


class ChangelogSealer:
    """Ends each written changelog partition with a one-record batch when writes pause.

    Sealing happens (1) after :data:`SEAL_IDLE_S` without table writes, off the pipeline's path;
    (2) when the worker starts stopping (Faust's ``on_before_shutdown``, before its producer
    stops) and inline after every later flush (the pipeline's final drain waits for it); (3)
    when partitions are revoked, before their new owner reads the changelog end.

    Args:
        app: The Faust app (its producer and assignment).
        tables: The tables whose changelogs are sealed.
        idle_s: Seconds without a flush before sealing.
        enabled: False: write no seals (Apache Kafka reports changelog ends correctly); the
            producer is still flushed on revoke and shutdown, so a partition's next owner reads
            every changelog record its last owner wrote.

    Attributes:
        seals: Partition seals written so far (one tombstone per table each).
    """

    def __init__(
        self, app: faust.App, tables: Sequence[Any], idle_s: float = SEAL_IDLE_S,
        *, enabled: bool = True,
    ) -> None:
        self.app = app
        self.enabled = enabled
        self.tables = list(tables)
        self.idle_s = idle_s
        self.seals = 0
        self._dirty: set[int] = set()
        self._generation = 0
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[int] | None = None

    def touched(self, partition: int) -> None:
        """A row of ``partition`` is being written."""
        if not self.enabled:
            return
        self._dirty.add(partition)
        self._generation += 1

    async def flushed(self) -> None:
        """A flush ended: seal now when the worker is stopping, else (re)start the idle timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if getattr(self.app, "should_stop", False):
            await self.seal(wait=True)
            return
        if not self.enabled:
            return
        self._timer = asyncio.get_running_loop().call_later(self.idle_s, self._on_idle)

    def _on_idle(self) -> None:
        self._timer = None
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self.seal())

    async def seal(self, *, wait: bool = False) -> int:
        """Seal the partitions written since the last seal.

        First waits until every record already handed to the producer is delivered; if rows are
        written meanwhile, gives up (the next idle period or flush seals). The tombstones are then
        queued with no await in between, so nothing else of ours can join their batches.

        Args:
            wait: Also wait until the tombstones are delivered.

        Returns:
            How many partitions were sealed.
        """
        generation = self._generation
        if not await flush_producer(self.app):  # the producer is stopped
            return 0
        if generation != self._generation or not self._dirty:
            return 0
        owned = self._owned()
        partitions = sorted(self._dirty if owned is None else self._dirty & owned)
        self._dirty.clear()
        for table in self.tables:
            for partition in partitions:
                table.send_changelog(partition, SEAL_KEY, None, value_serializer="raw")
        self.seals += len(partitions)
        if wait:
            with contextlib.suppress(Exception):
                await self.app.producer.flush()
        return len(partitions)

    def _owned(self) -> set[int] | None:
        try:
            actives = self.app.assignor.assigned_actives()
        except Exception:
            return None
        topic = self.tables[0].changelog_topic.get_topic_name()
        return {tp.partition for tp in actives if tp.topic == topic}


class FaustDeviceTables:
    """:class:`~streamapp.tables.base.DeviceTables` over two Faust tables.

    Args:
        app: The worker's Faust app (the tables are defined on it by :func:`define_tables`).
        stats / windows: The tables.
        request_topic: Name of the request topic (the tables' source topic).
        partitions: Its partition count, for stand-in events when the app cannot tell.
        seal_changelogs: Seal the changelogs (:class:`ChangelogSealer`; embedded broker only).

    Rows RocksDB refuses (a full disk) are kept in memory, served and written again when the
    database takes writes (:class:`~streamapp.tables.store_guard.StoreWriteGuard`, one per
    table, installed at the first write); :meth:`write_status` says how that stands.
    """

    def __init__(
        self, app: faust.App, stats: Any, windows: Any, *, request_topic: str, partitions: int,
        seal_changelogs: bool = True,
    ) -> None:
        self.app = app
        self.stats = stats
        self.windows = windows
        self.request_topic = request_topic
        self.partitions = partitions
        self.sealer = ChangelogSealer(app, [stats, windows], enabled=seal_changelogs)
        self.guards: list[StoreWriteGuard] = []
        self._guarded = False
        #: Row readers of the two tables (:mod:`streamapp.tables.rows`): a restored record or
        #: a stored row that cannot be read is logged, counted and reset, never raised; rows
        #: read back with the bytes this worker wrote are not decoded again (decode cache).
        self.screens = {
            STATS_TABLE: RowScreen(STATS_TABLE, "stats", cache_rows=DEVICE_ROWS_CACHED),
            WINDOWS_TABLE: RowScreen(WINDOWS_TABLE, "bucket", cache_rows=DEVICE_ROWS_CACHED),
        }
        screen_changelog(stats, self.screens[STATS_TABLE])
        screen_changelog(windows, self.screens[WINDOWS_TABLE])

        @app.on_partitions_revoked.connect  # type: ignore[arg-type]
        async def _seal_on_revoke(app_: Any, revoked: Any, **kwargs: Any) -> None:
            await self.sealer.seal(wait=True)

        @app.on_before_shutdown.connect  # type: ignore[arg-type]
        async def _seal_on_shutdown(app_: Any, **kwargs: Any) -> None:
            await self.sealer.seal(wait=True)

    def partition_of(self, device_key: bytes) -> int:
        """The request-topic partition Kafka's default partitioner gives ``device_key``."""
        n = None
        with contextlib.suppress(Exception):  # the consumer may not know the topic yet
            n = self.app.consumer.topic_partitions(self.request_topic)
        n = n or self.partitions
        return int(_partitioner(device_key, list(range(n)), list(range(n))))

    @contextlib.contextmanager
    def writing(self, device_key: bytes, event: Any) -> Iterator[None]:
        message = getattr(event, "message", None)
        if (
            message is None
            or message.topic != self.request_topic
            or bytes(message.key or b"") != device_key
        ):
            event = StandInEvent(
                self.request_topic, self.partition_of(device_key), device_key
            )
        self.sealer.touched(event.message.partition)
        if not self._guarded:
            self._guarded = True  # memory stores (exactly_once) have no database to guard
            self.guards = [_guard(table) for table in (self.stats, self.windows)
                           if hasattr(table.data, "_open_for_partition")]
        with event_context(event):
            yield

    def write_status(self) -> dict[str, TableWriteStatus]:
        """Refused writes, reopens and rows kept in memory, by table name (empty before the
        first write)."""
        return {guard.name: guard.status for guard in self.guards}

    async def flushed(self) -> None:
        await self.sealer.flushed()

    def get_stats(self, device_key: bytes) -> dict[str, Any] | None:
        return self.screens[STATS_TABLE].read(device_key, self.stats.get(device_key))

    def set_stats(self, device_key: bytes, row: dict[str, Any]) -> None:
        raw = self.stats[device_key] = _encode(row)
        self.screens[STATS_TABLE].written(device_key, raw, row)

    def get_bucket(self, key: bytes) -> dict[str, Any] | None:
        return self.screens[WINDOWS_TABLE].read(key, self.windows.get(key))

    def set_bucket(self, key: bytes, row: dict[str, Any]) -> None:
        raw = self.windows[key] = _encode(row)
        self.screens[WINDOWS_TABLE].written(key, raw, row)

    def delete_bucket(self, key: bytes) -> None:
        self.screens[WINDOWS_TABLE].forget(key)
        if key in self.windows:
            del self.windows[key]

    def iter_stats(self) -> Iterator[tuple[bytes, dict[str, Any]]]:
        screen = self.screens[STATS_TABLE]
        for key, raw in self.stats.items():
            row = screen.read(key, raw, remember=False) if key != SEAL_KEY else None
            if row is not None:
                yield key, row


def _guard(table: Any) -> StoreWriteGuard:
    from streamapp.tables.faults import install_disk_faults

    store = table.data
    install_disk_faults(store)  # test-only; a no-op without TABLES_FAULTS
    return StoreWriteGuard(store, table.name)


#: ``json.dumps(row, separators=...)`` builds an encoder per call; this one is reused.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _encode(row: dict[str, Any]) -> bytes:
    return _ENCODER.encode(row).encode()


def define_tables(app: faust.App, settings: Settings) -> FaustDeviceTables:
    """Define ``device_stats`` and ``device_windows`` on ``app`` (before the worker starts).

    Both use the RocksDB store through rocksdict (faust-streaming 0.15.3 picks rocksdict when
    ``options={"driver": "rocksdict"}``) with bounded write buffers and block cache
    (:func:`store_options`), raw byte keys, and as many partitions as the request topic.
    Values are JSON objects that :class:`FaustDeviceTables` encodes and decodes itself
    (Faust's raw serializer): Faust's JSON codec raised inside its changelog recovery on a
    value that was not UTF-8 JSON and stopped every table of the worker
    (:mod:`streamapp.tables.rows`). The bytes are the same JSON as before, so existing data
    dirs and changelogs read as they are.
    """
    common: dict[str, Any] = {
        "default": None,
        "key_type": bytes,  # → Faust's "raw" key serializer: the record key's exact bytes
        "value_type": bytes,  # → raw value bytes: JSON decoded by RowScreen, never raising
        "partitions": settings.topic_partitions,
        "extra_topic_configs": settings.changelog_topic_configs,
    }
    # store: a table's own ``store="rocksdb://"`` is an empty, falsy yarl URL that Faust 0.15.3
    # replaces by the app's default (memory); ``rocksdb:<table name>`` is what the app-level
    # default expands to (files ``<datadir>/v1/tables/<name>-<partition>.db``).
    # options: Faust pops "driver" out of the mapping it is given, so one dict per table;
    # the sizes bound each partition's database (store_options).
    # exactly_once: a memory store, restored from the changelog (read_committed) on every
    # start. A RocksDB store would keep the writes of a transaction that a crash aborted, and
    # count those requests twice when they are processed again.
    eos = settings.processing_guarantee == "exactly_once"

    def store(name: str) -> dict[str, Any]:
        if eos:
            return {"store": "memory://"}
        return {"store": f"rocksdb:{name}", "options": store_options(settings)}

    if not eos:  # an existing database too opens with these options, not its OPTIONS file's
        open_rocksdict_with_given_options()

    stats = app.Table(
        STATS_TABLE, **store(STATS_TABLE),
        help="Per-device counters, last result and latency EWMA (key: device id bytes).",
        **common,
    )
    windows = app.Table(
        WINDOWS_TABLE, **store(WINDOWS_TABLE),
        help="Per-device window buckets (key: device id bytes + NUL + size + start).",
        **common,
    )
    return FaustDeviceTables(
        app, stats, windows,
        request_topic=settings.request_topic, partitions=settings.topic_partitions,
        seal_changelogs=settings.broker_kind == "embedded",
    )
