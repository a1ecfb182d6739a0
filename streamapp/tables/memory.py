"""Device tables in plain dicts: for tests of the observer and the views without Kafka."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from streamapp.tables.rows import DEVICE_ROWS_CACHED, RowScreen

__all__ = ["MemoryDeviceTables"]


class MemoryDeviceTables:
    """:class:`~streamapp.tables.base.DeviceTables` in memory.

    Rows are stored JSON-encoded, as Faust stores them, so a test catches values that would not
    survive the changelog. ``writes`` and ``deletes`` count calls; ``written_by`` records the
    device key given to :meth:`writing` for every write, to check rows are written in their own
    device's context. Rows are read through the same :class:`~streamapp.tables.rows.RowScreen`
    as the Faust tables (``screens``), with the same decode cache: bytes put in
    ``stats``/``buckets`` that are not a row come back as the reset row, and bytes put there
    behind the cache's back are read as they are.

    Args:
        cache_rows: Bound of each table's decode cache in keys (0: none).
    """

    def __init__(self, *, cache_rows: int = DEVICE_ROWS_CACHED) -> None:
        self.stats: dict[bytes, bytes] = {}
        self.buckets: dict[bytes, bytes] = {}
        self.writes = 0
        self.deletes = 0
        self.written_by: list[tuple[bytes | None, bytes]] = []
        self.flushes = 0
        self._current: bytes | None = None
        self.screens = {
            "device_stats": RowScreen("device_stats", "stats", cache_rows=cache_rows),
            "device_windows": RowScreen("device_windows", "bucket", cache_rows=cache_rows),
        }

    async def flushed(self) -> None:
        self.flushes += 1

    @contextlib.contextmanager
    def writing(self, device_key: bytes, event: Any) -> Iterator[None]:
        previous, self._current = self._current, device_key
        try:
            yield
        finally:
            self._current = previous

    def get_stats(self, device_key: bytes) -> dict[str, Any] | None:
        return self.screens["device_stats"].read(device_key, self.stats.get(device_key))

    def set_stats(self, device_key: bytes, row: dict[str, Any]) -> None:
        self._write(device_key)
        raw = self.stats[device_key] = json.dumps(row).encode()
        self.screens["device_stats"].written(device_key, raw, row)

    def get_bucket(self, key: bytes) -> dict[str, Any] | None:
        return self.screens["device_windows"].read(key, self.buckets.get(key))

    def set_bucket(self, key: bytes, row: dict[str, Any]) -> None:
        self._write(key)
        raw = self.buckets[key] = json.dumps(row).encode()
        self.screens["device_windows"].written(key, raw, row)

    def delete_bucket(self, key: bytes) -> None:
        self.deletes += 1
        self.screens["device_windows"].forget(key)
        self.buckets.pop(key, None)

    def iter_stats(self) -> Iterator[tuple[bytes, dict[str, Any]]]:
        for key, raw in list(self.stats.items()):
            row = self.screens["device_stats"].read(key, raw, remember=False)
            if row is not None:
                yield key, row

    def _write(self, key: bytes) -> None:
        self.writes += 1
        self.written_by.append((self._current, key))
