"""Test-only: a full disk under the device tables, without root or a small filesystem.

A worker started with ``TABLES_FAULTS=<control file>`` in its environment opens its table
databases through :class:`DiskFullDB`: while the control file exists ("the disk is full"),
every write raises exactly what rocksdict raises on a full disk, and the database then keeps
failing — also after the file is removed ("space freed") — until it is closed and opened again,
as RocksDB's background error does (measured on a 48 MiB tmpfs: see
:mod:`streamapp.tables.store_guard`). Opening a partition database (first open or reopen) fails
too while the file exists, as RocksDB's read-write open does on a full disk (it appends to the
MANIFEST); a read-only open, which needs no space, is not intercepted. Production sets no
``TABLES_FAULTS``; nothing here runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["FAULTS_ENV", "DiskFullDB", "install_disk_faults"]

#: Environment variable naming the control file (test-only).
FAULTS_ENV = "TABLES_FAULTS"


class DiskFullDB:
    """A rocksdict ``Rdict`` whose writes fail like RocksDB's on a full disk.

    Args:
        db: The real database.
        path: Its directory (named in the error, as RocksDB names its WAL file).
        control: While this file exists, writes fail.
    """

    def __init__(self, db: Any, path: Path, control: Path) -> None:
        self._db = db
        self._path = path
        self._control = control
        self._broken = False

    def _check(self) -> None:
        if self._broken or self._control.exists():
            self._broken = True  # RocksDB's background error: sticky until reopened
            raise Exception(  # rocksdict raises plain Exception for RocksDB errors
                f"IO error: No space left on device: While appending to file: "
                f"{self._path}/000004.log: No space left on device"
            )

    def put(self, key: Any, value: Any, *args: Any) -> None:
        self._check()
        self._db.put(key, value, *args)

    def delete(self, key: Any, *args: Any) -> None:
        self._check()
        self._db.delete(key, *args)

    def write(self, batch: Any, *args: Any) -> None:
        self._check()
        self._db.write(batch, *args)

    def close(self) -> None:
        self._db.close()
        if self._broken:
            raise Exception("IO error: Writer has previous error.")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


def install_disk_faults(store: Any) -> bool:
    """Open ``store``'s partition databases (those open now and those opened later) through
    :class:`DiskFullDB` when ``TABLES_FAULTS`` names a control file.

    Returns:
        True when installed.
    """
    control = os.environ.get(FAULTS_ENV)
    if not control:
        return False
    open_for_partition = store._open_for_partition

    def faulty_open(partition: int) -> DiskFullDB:
        path = store.partition_path(partition)
        if Path(control).exists():
            raise Exception(  # what rocksdict raises when a read-write open finds no space
                f"IO error: No space left on device: While appending to file: "
                f"{path}/MANIFEST-000013: No space left on device"
            )
        return DiskFullDB(
            open_for_partition(partition), store.partition_path(partition), Path(control)
        )

    store._open_for_partition = faulty_open
    for partition, db in list(store._dbs.items()):  # those opened at assignment
        if not isinstance(db, DiskFullDB):
            store._dbs[partition] = DiskFullDB(db, store.partition_path(partition), Path(control))
    return True
