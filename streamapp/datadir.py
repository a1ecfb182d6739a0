"""One worker per data directory: an OS file lock held for the life of the process.

Faust keeps RocksDB tables under the data directory; a second worker on the same directory used
to fail deep inside Faust ("DB for partition 3 is locked!", once per partition) after joining the
group. :func:`lock_data_dir` takes an exclusive ``fcntl.flock`` on ``<data_dir>/streamapp.lock``
before the app is created, so the second worker stops at once with one line naming the setting
to change. The kernel drops a flock when its last file descriptor closes, including on SIGKILL,
so a crashed worker never leaves a stale lock behind (the file itself stays; it is harmless).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from streamapp.exceptions import ConfigError

__all__ = ["LOCK_NAME", "DataDirInUseError", "lock_data_dir"]

#: The lock file's name inside the data directory.
LOCK_NAME = "streamapp.lock"

# Locks held by this process, by resolved directory: kept referenced so that they are never
# closed (closing the descriptor would release the lock) and taken only once per process.
_HELD: dict[Path, IO[str]] = {}


class DataDirInUseError(ConfigError):
    """Another live process holds the data directory's lock (not retriable: change the setting)."""


def lock_data_dir(data_dir: Path, *, holder: str = "worker") -> Path:
    """Take the data directory's lock for the rest of this process's life.

    Args:
        data_dir: The worker's data directory (created when missing).
        holder: What holds it, written into the lock file for the next one's error message
            (e.g. ``worker`` or ``supervisor``).

    Returns:
        The lock file's path. Taking it again in the same process is a no-op.

    Raises:
        DataDirInUseError: Another process holds it; the message names the holder's pid and
            the setting to change (``--data-dir`` / ``STREAMAPP_DATA_DIR``).
    """
    data_dir = Path(data_dir).resolve()
    path = data_dir / LOCK_NAME
    if data_dir in _HELD:
        return path
    data_dir.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")  # stays open: closing it would release the lock
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise DataDirInUseError(
            f"data directory {data_dir} is already used by a running {owner}; give this worker "
            "its own with --data-dir or STREAMAPP_DATA_DIR (or run several with "
            "`streamapp worker --processes N`)"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{holder} (pid {os.getpid()})\n")
    handle.flush()
    _HELD[data_dir] = handle
    return path
