"""Table writes that survive a full disk: rows RocksDB refused are kept, served and written again.

A Faust table write (``table[key] = row``) first hands the changelog record to the producer and
then puts the row into the partition's RocksDB database. When the disk is full the put raises
(rocksdict: ``Exception("IO error: No space left on device: While appending to file:
…/000004.log: …")``) and, worse, RocksDB keeps that *background error*: every later write of
that database fails the same way even after space was freed, until the database is reopened
(or ``DB::Resume()`` is called, which rocksdict does not expose) — rocksdb issues #919 and
#9762; measured here on a 48 MiB tmpfs with rocksdict 0.3.29: 1,982 of 2,000 puts failed, the
put after freeing the space failed too, ``close()`` raised "Writer has previous error" and a
reopened database took writes again.

The changelog record was produced anyway, so the **changelog is the source of truth**; the
local database is only behind it. :class:`StoreWriteGuard` wraps one Faust RocksDB store:

* a row whose put (or delete) fails is kept in memory, per partition, and served from there
  (reads, ``in``, iteration), so the next update of the device merges into the latest row and
  a query sees the right totals while the disk is full;
* the partition's *persisted changelog offset* (Faust writes it into the same database after
  each changelog record is acknowledged, and a restart restores only the changelog past it)
  is held back while the partition has rows in memory: a worker stopped before the disk
  recovers restores those rows from the changelog at its next start;
* every :data:`RETRY_INTERVAL_S` (on the next write, or from a timer when idle) each such
  partition's database is closed and opened again and its rows, then the held-back offset,
  are written in one batch; the partition is then healthy again;
* opening a partition's database can fail too (RocksDB appends to its MANIFEST on every
  read-write open: measured on a full 8 MiB tmpfs, "IO error: No space left on device: While
  appending to file: …/MANIFEST-000013"), both for a partition first opened while the disk is
  full and for the reopen above. The partition then counts as refusing writes (its writes are
  kept, it is retried) and its rows on disk are served through a *read-only* handle, which
  needs no space (measured: it opened and read on the full tmpfs, the WAL replayed); a
  partition with no database on disk yet reads as empty. Only when even the read-only open
  fails do reads raise :class:`~streamapp.exceptions.TableUnavailableError` (retriable: the
  device observer keeps the device's update for its next flush);
* an ERROR is logged once per :data:`LOG_INTERVAL_S` while writes fail (with the count since
  the last one), one WARNING when a partition is writable again.

Memory: at most one row per key written while the disk was full (the latest), not one per
update. A revoked partition's rows are dropped: its changelog has them, and its next owner
restores from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from faust.streams import current_event

from streamapp.exceptions import TableUnavailableError
from streamapp.faust_compat import open_rdict

__all__ = ["LOG_INTERVAL_S", "RETRY_INTERVAL_S", "StoreWriteGuard", "TableWriteStatus"]

log = logging.getLogger(__name__)

#: Seconds between attempts to reopen a partition database that refused writes.
RETRY_INTERVAL_S = 2.0
#: Seconds between two ERROR lines about refused table writes (the count in between is given).
LOG_INTERVAL_S = 30.0


@dataclass
class TableWriteStatus:
    """What a guard has seen since the worker started (for ``/ready`` and ``/metrics``).

    Attributes:
        write_errors: Row writes (puts, deletes, persisted offsets) RocksDB refused.
        reopens: Partition databases reopened after refusing writes, whose kept rows were then
            written.
        rows_in_memory: Rows kept in memory now because their database refused them.
        partitions: Partitions whose database refuses writes now.
        error: The last error RocksDB gave ("" when none).
        since: Epoch seconds since when writes fail (None while healthy).
    """

    write_errors: int = 0
    reopens: int = 0
    rows_in_memory: int = 0
    partitions: tuple[int, ...] = ()
    error: str = ""
    since: float | None = None

    @property
    def degraded(self) -> bool:
        """True while some partition keeps rows in memory."""
        return bool(self.partitions)


class StoreWriteGuard:
    """Wraps a Faust RocksDB store (rocksdict driver) so that refused writes are kept and
    retried (see the module docstring).

    Uses the store's internals of faust-streaming 0.15.3 (``_set``, ``_del``, ``_get``,
    ``_contains``, ``_iteritems``, ``set_persisted_offset``, ``revoke_partitions``, ``_dbs``,
    ``_db_for_partition``, ``_open_for_partition``, ``_visible_items``, ``partition_path``,
    ``rocksdb_options``, ``offset_key``); they are replaced by instance attributes. Every
    database access of the store (Faust's own included) goes through :meth:`db_for_partition`.

    Args:
        store: The table's store (``table.data``).
        name: The table's name, for log lines.
        retry_interval_s: Seconds between reopen attempts of a refusing database.
        log_interval_s: Seconds between ERROR lines while writes fail.
        clock: Monotonic seconds (tests pass a fake).
    """

    def __init__(
        self, store: Any, name: str, *, retry_interval_s: float = RETRY_INTERVAL_S,
        log_interval_s: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.name = name
        self.retry_interval_s = retry_interval_s
        self.log_interval_s = log_interval_s
        self.clock = clock
        self.status = TableWriteStatus()
        #: partition -> key -> row bytes (None: deleted) that its database refused.
        self._pending: dict[int, dict[bytes, bytes | None]] = {}
        #: partition -> (tp, offset) of the persisted offset held back.
        self._offsets: dict[int, tuple[Any, int]] = {}
        self._key_partition: dict[bytes, int] = {}
        self._unlogged = 0
        self._last_log: float | None = None
        self._last_attempt = 0.0
        self._timer: asyncio.TimerHandle | None = None
        #: partition -> read-only handle serving its rows while its database cannot be opened.
        self._readers: dict[int, _ReadOnlyDB] = {}
        self._open = store._open_for_partition
        self._set, self._del, self._get = store._set, store._del, store._get
        self._contains, self._iteritems = store._contains, store._iteritems
        self._set_offset, self._revoke = store.set_persisted_offset, store.revoke_partitions
        store._set, store._del, store._get = self.set, self.delete, self.get
        store._contains, store._iteritems = self.contains, self.iteritems
        store.set_persisted_offset, store.revoke_partitions = self.set_offset, self.revoke
        store._db_for_partition = self.db_for_partition

    # -- the store's interface ---------------------------------------------------------------

    def set(self, key: bytes, value: bytes | None) -> None:
        partition = _partition()
        self._write(partition, key, value, lambda: self._set(key, value))

    def delete(self, key: bytes) -> None:
        partition = _partition()
        # (Faust's _del deletes in every open database when the key's is not open)
        self._write(partition, key, None, lambda: self.db_for_partition(partition).delete(key))

    def get(self, key: bytes) -> bytes | None:
        found, value = self._kept(key)
        if found:
            return value
        value = self._get(key)
        if value is None and current_event() is None:  # Faust looked in the open ones only
            for reader in self._readers.values():
                value = reader.get(key)
                if value is not None:
                    break
        return value

    def contains(self, key: bytes) -> bool:
        found, value = self._kept(key)
        if found:
            return value is not None
        if self._contains(key):
            return True
        if current_event() is None:
            return any(reader.get(key) is not None for reader in self._readers.values())
        return False

    def iteritems(self) -> Iterator[tuple[bytes, bytes]]:
        kept = {k: v for rows in self._pending.values() for k, v in rows.items()}
        for key, value in self._iteritems():
            if key not in kept:
                yield key, value
        for reader in list(self._readers.values()):
            for key, value in self.store._visible_items(reader):
                if key not in kept:
                    yield key, value
        for key, value in kept.items():
            if value is not None:
                yield key, value

    def db_for_partition(self, partition: int) -> Any:
        """The partition's database, opened when it is not open yet (replaces the store's
        ``_db_for_partition``).

        When the open fails (a full disk) the partition counts as refusing writes and a
        read-only handle is returned: it serves the rows on disk and raises the open's error
        on writes, so they are kept in memory.

        Raises:
            TableUnavailableError: Not even a read-only handle could be opened.
        """
        db = self.store._dbs.get(partition)
        if db is not None:
            return db
        reader = self._readers.get(partition)
        if reader is not None:
            return reader
        try:
            db = self.store._dbs[partition] = self._open(partition)
        except Exception as exc:  # rocksdict raises plain Exception for RocksDB errors
            self._pending.setdefault(partition, {})
            self._refused(partition, exc, count=False)
            return self._read_only(partition, exc)
        return db

    def set_offset(self, tp: Any, offset: int) -> None:
        partition = int(tp.partition)
        if partition in self._pending:
            self._offsets[partition] = (tp, offset)  # written after the rows it covers
            return
        try:
            self._set_offset(tp, offset)
        except Exception as exc:  # rocksdict raises plain Exception for RocksDB errors
            self._pending.setdefault(partition, {})
            self._offsets[partition] = (tp, offset)
            self._refused(partition, exc)

    def revoke(self, table: Any, tps: Any) -> None:
        for tp in tps:
            rows = self._pending.pop(int(tp.partition), None)
            self._offsets.pop(int(tp.partition), None)
            reader = self._readers.pop(int(tp.partition), None)
            if reader is not None:
                reader.close()
            if rows:
                log.warning(
                    "table %s partition %d revoked with %d row(s) its database refused; the "
                    "changelog has them and the partition's next owner restores them",
                    self.name, tp.partition, len(rows),
                )
        self._update_status()
        self._revoke(table, tps)

    # -- recovery ------------------------------------------------------------------------------

    def recover(self) -> bool:
        """Reopen every database that refused writes and write its kept rows and held-back
        offset (one batch per partition).

        Returns:
            True when no partition keeps rows in memory any more.
        """
        self._last_attempt = self.clock()
        recovered: list[int] = []
        written = 0
        for partition in sorted(self._pending):
            rows = self._pending[partition]
            store = self.store
            old = store._dbs.pop(partition, None)
            if old is not None:
                with contextlib.suppress(Exception):  # "Writer has previous error"
                    old.close()
            try:
                db = store._dbs[partition] = self._open(partition)
            except Exception as exc:  # still full: serve the rows on disk read-only
                self._refused(partition, exc, count=False)
                with contextlib.suppress(TableUnavailableError):  # reads retry the open
                    self._read_only(partition, exc)
                continue
            reader = self._readers.pop(partition, None)
            if reader is not None:
                reader.close()
            try:
                db.write(self._batch(rows, self._offsets.get(partition)))
            except Exception as exc:
                self._refused(partition, exc, count=False)
                continue
            del self._pending[partition]
            self._offsets.pop(partition, None)
            for key in rows:
                self._key_partition.pop(key, None)
            self.status.reopens += 1
            recovered.append(partition)
            written += len(rows)
        if recovered:
            log.warning(
                "table %s takes writes again (partition(s) %s reopened): the %d row(s) kept in "
                "memory are written", self.name, ", ".join(map(str, recovered)), written,
            )
        self._update_status()
        return not self._pending

    def _batch(self, rows: dict[bytes, bytes | None], offset: tuple[Any, int] | None) -> Any:
        from rocksdict import WriteBatch

        batch = WriteBatch(raw_mode=True)
        for key, value in rows.items():
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
        if offset is not None:
            batch.put(self.store.offset_key, str(offset[1]).encode())
        return batch

    # -- internals -----------------------------------------------------------------------------

    def _read_only(self, partition: int, error: BaseException) -> _ReadOnlyDB:
        """A read-only handle on the partition's database (kept in ``_readers``), or an empty
        one when nothing was ever written there; ``error`` is what its writes raise."""
        reader = self._readers.get(partition)
        if reader is not None:
            return reader
        path = self.store.partition_path(partition)
        db = None
        if (path / "CURRENT").exists():  # (a failed first open may leave a bare directory)
            from rocksdict import AccessType

            try:  # with the configured options, as the read-write stores
                db = open_rdict(path, self.store.rocksdb_options.as_options(),
                                AccessType.read_only())
            except Exception as exc:  # rocksdict raises plain Exception for RocksDB errors
                raise TableUnavailableError(
                    f"table {self.name} partition {partition}: its database {path} cannot be "
                    f"opened ({error}) nor read ({exc}); free disk space under the data dir"
                ) from exc
        reader = self._readers[partition] = _ReadOnlyDB(db, error)
        return reader

    def _kept(self, key: bytes) -> tuple[bool, bytes | None]:
        partition = self._key_partition.get(key)
        if partition is None:
            return False, None
        rows = self._pending.get(partition)
        if rows is None or key not in rows:
            return False, None
        return True, rows[key]

    def _write(
        self, partition: int, key: bytes, value: bytes | None, write: Callable[[], None]
    ) -> None:
        if self._pending and self.clock() - self._last_attempt >= self.retry_interval_s:
            self.recover()
        rows = self._pending.get(partition)
        if rows is not None:  # its database refuses writes: keep the row with the others
            rows[key] = value
            self._key_partition[key] = partition
            self._update_status()
            return
        try:
            write()
        except Exception as exc:  # rocksdict raises plain Exception for RocksDB errors
            self._pending.setdefault(partition, {})[key] = value
            self._key_partition[key] = partition
            self._refused(partition, exc)

    def _refused(self, partition: int, exc: BaseException, *, count: bool = True) -> None:
        status = self.status
        if count:
            status.write_errors += 1
        status.error = str(exc)
        if status.since is None:  # the first retry comes one interval after the first refusal
            status.since = time.time()
            self._last_attempt = self.clock()
        self._update_status()
        self._unlogged += 1
        now = self.clock()
        if self._last_log is None or now - self._last_log >= self.log_interval_s:
            log.error(
                "cannot write table %s partition %d (%s); %d row(s) of %d partition(s) are kept "
                "in memory and served from there, the changelog has them, and the database is "
                "reopened every %.0f s until it takes them (%d refused write(s) since the last "
                "message; free disk space under the data dir)",
                self.name, partition, exc, status.rows_in_memory, len(status.partitions),
                self.retry_interval_s, self._unlogged,
            )
            self._last_log, self._unlogged = now, 0
        self._arm_timer()

    def _arm_timer(self) -> None:
        if self._timer is not None:
            return
        with contextlib.suppress(RuntimeError):  # no running loop (a synchronous caller)
            self._timer = asyncio.get_running_loop().call_later(
                self.retry_interval_s, self._on_timer
            )

    def _on_timer(self) -> None:
        self._timer = None
        if self._pending and not self.recover():
            self._arm_timer()

    def _update_status(self) -> None:
        status = self.status
        status.rows_in_memory = sum(len(rows) for rows in self._pending.values())
        status.partitions = tuple(sorted(self._pending))
        if not self._pending:
            status.since = None


class _ReadOnlyDB:
    """Serves a partition's rows while its database cannot be opened for writing.

    Args:
        db: A read-only rocksdict ``Rdict``, or None: nothing on disk (reads find nothing).
        error: What writes raise (the error of the failed read-write open).
    """

    def __init__(self, db: Any, error: BaseException) -> None:
        self._db = db
        self._error = error

    def get(self, key: bytes, *args: Any) -> bytes | None:
        return None if self._db is None else self._db.get(key, *args)

    def key_may_exist(self, key: bytes, *args: Any) -> bool:
        return self._db is not None and bool(self._db.key_may_exist(key, *args))

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        return iter(()) if self._db is None else self._db.items()

    def keys(self) -> Iterator[bytes]:
        return iter(()) if self._db is None else self._db.keys()

    def put(self, *args: Any) -> None:
        raise Exception(str(self._error))  # the type rocksdict raises; callers catch it

    delete = write = put

    def close(self) -> None:
        if self._db is not None:
            with contextlib.suppress(Exception):
                self._db.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def _partition() -> int:
    """The partition of the current write (Faust selects it from the current event)."""
    event = current_event()
    assert event is not None, "table writes happen inside FaustDeviceTables.writing"
    return int(event.message.partition)
