"""Queryable per-device state: ``device_stats`` and windowed per-device aggregates.

* :mod:`~streamapp.tables.windows` — window and bucket arithmetic;
* :mod:`~streamapp.tables.aggregates` — row formats and how deltas merge into them;
* :mod:`~streamapp.tables.base` — the storage interface; :mod:`~streamapp.tables.faust_tables`
  (Faust + RocksDB + changelog, what workers use) and :mod:`~streamapp.tables.memory` (tests);
* :mod:`~streamapp.tables.device_state` — the pipeline observer that writes rows once per batch
  per device, and the reader the web views answer from.
"""

from __future__ import annotations

from streamapp.tables.base import DeviceTables
from streamapp.tables.device_state import DeviceStateObserver, DeviceStateReader
from streamapp.tables.memory import MemoryDeviceTables
from streamapp.tables.windows import WINDOW_KINDS, WindowKind, WindowPlan

__all__ = [
    "WINDOW_KINDS",
    "DeviceStateObserver",
    "DeviceStateReader",
    "DeviceTables",
    "MemoryDeviceTables",
    "WindowKind",
    "WindowPlan",
]
