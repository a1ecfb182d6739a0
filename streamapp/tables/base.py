"""The storage interface the device-state observer writes to and the views read from.

Two key → JSON-object tables: ``stats`` (key: the device's record key) and ``buckets`` (key:
:func:`bucket_key`). Backends: :mod:`streamapp.tables.faust_tables` (Faust tables in RocksDB
with a changelog topic, what workers use) and :mod:`streamapp.tables.memory` (dicts, for tests).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

__all__ = ["DeviceTables", "bucket_key", "split_bucket_key"]

_SUFFIX = struct.Struct(">IQ")


def bucket_key(device_key: bytes, size_ms: int, start_ms: int) -> bytes:
    """Key of a device's window bucket: ``device key + NUL + uint32 size + uint64 start``
    (big-endian), so a device's buckets sort by size then time and the key parses from the
    end whatever bytes the device key holds."""
    return device_key + b"\x00" + _SUFFIX.pack(size_ms, start_ms)


def split_bucket_key(key: bytes) -> tuple[bytes, int, int]:
    """Inverse of :func:`bucket_key`: ``(device key, size ms, start ms)``."""
    size_ms, start_ms = _SUFFIX.unpack(key[-_SUFFIX.size:])
    return key[: -_SUFFIX.size - 1], size_ms, start_ms


class DeviceTables(Protocol):
    """Rows of devices this worker owns.

    Writes must happen inside :meth:`writing` for the device the row belongs to: with Faust it
    selects the partition (RocksDB database and changelog partition) of the write.

    Rows are shared with a decode cache (:class:`~streamapp.tables.rows.RowScreen`): a row
    ``get_*``/``iter_stats`` return, and a row given to ``set_*``, must not be modified
    afterwards; build a new one (as :mod:`streamapp.tables.aggregates` does).
    """

    def writing(self, device_key: bytes, event: Any) -> AbstractContextManager[None]:
        """Context for writes of ``device_key``'s rows; ``event`` is a source event of that
        device (its Kafka record), or None when there is none at hand."""
        ...

    def get_stats(self, device_key: bytes) -> dict[str, Any] | None: ...

    def set_stats(self, device_key: bytes, row: dict[str, Any]) -> None: ...

    def get_bucket(self, key: bytes) -> dict[str, Any] | None: ...

    def set_bucket(self, key: bytes, row: dict[str, Any]) -> None: ...

    def delete_bucket(self, key: bytes) -> None: ...

    async def flushed(self) -> None:
        """Called after each flush (once per batch) when the writes of that flush are done."""
        ...

    def iter_stats(self) -> Iterator[tuple[bytes, dict[str, Any]]]:
        """Every stats row this worker owns (active partitions), in no particular order."""
        ...
