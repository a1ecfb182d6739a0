"""One worker per data directory, and a data directory for one cluster and app.

**Lock.** An OS file lock held for the life of the process.

Faust keeps RocksDB tables under the data directory; a second worker on the same directory used
to fail deep inside Faust ("DB for partition 3 is locked!", once per partition) after joining the
group. :func:`lock_data_dir` takes an exclusive ``fcntl.flock`` on ``<data_dir>/streamapp.lock``
before the app is created, so the second worker stops at once with one line naming the setting
to change. The kernel drops a flock when its last file descriptor closes, including on SIGKILL,
so a crashed worker never leaves a stale lock behind (the file itself stays; it is harmless).

**Marker.** The tables in a data directory hold offsets of one cluster's changelogs. Pointed at
another cluster (the README's embedded broker, then its Apache Kafka, both with ``./data``),
Faust stopped after 8 s with 287 log lines and ``ConsistencyError`` ("persisted offset ... is
higher than the last offset"), or, with the check off, served another cluster's counts.
:func:`check_data_dir` keeps ``<data_dir>/streamapp-data.json`` (cluster id, app id, table
partitions) and refuses a directory of another cluster or app with one line; tables kept for
another partition count (before ``streamapp tables rebuild``) are dropped, to be restored from
the rebuilt changelogs.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from pathlib import Path
from typing import IO

from streamapp.exceptions import ConfigError

__all__ = [
    "LOCK_NAME",
    "MARKER_NAME",
    "DataDirInUseError",
    "DataDirMismatchError",
    "check_data_dir",
    "lock_data_dir",
    "make_data_dir",
]

#: The lock file's name inside the data directory.
LOCK_NAME = "streamapp.lock"
#: The marker file's name inside the data directory (JSON: cluster_id, app_id, partitions).
MARKER_NAME = "streamapp-data.json"
#: Faust's per-version directories (``v1/tables/<table>-<partition>.db``).
_FAUST_DIR = re.compile(r"v\d+")

# Locks held by this process, by resolved directory: kept referenced so that they are never
# closed (closing the descriptor would release the lock) and taken only once per process.
_HELD: dict[Path, IO[str]] = {}


class DataDirInUseError(ConfigError):
    """Another live process holds the data directory's lock (not retriable: change the setting)."""


def make_data_dir(data_dir: Path, option: str = "--data-dir / STREAMAPP_DATA_DIR") -> Path:
    """Create ``data_dir`` (and its parents) when missing.

    Args:
        data_dir: The directory.
        option: The setting that names it, for the error message.

    Returns:
        ``data_dir``.

    Raises:
        ConfigError: It, or one of its parents, exists and is not a directory, or it cannot be
            created (permissions); the message names the path and ``option``.
    """
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(
            f"data directory {data_dir} is a file, not a directory: give {option} a directory "
            "(it is created when missing)"
        ) from None
    except NotADirectoryError:
        raise ConfigError(
            f"data directory {data_dir} cannot be created: a parent of it is a file; give "
            f"{option} a directory path"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"data directory {data_dir} cannot be created ({exc.strerror or exc}): give {option} "
            "a directory you can write"
        ) from None
    return data_dir


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
    make_data_dir(data_dir)
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


class DataDirMismatchError(ConfigError):
    """The data directory holds the tables of another cluster or app (not retriable: give the
    worker another directory, or start afresh with ``--reset-data-dir``)."""


def _drop_tables(data_dir: Path) -> bool:
    """Remove Faust's table stores under ``data_dir``; True when there were some."""
    found = False
    for child in data_dir.iterdir():
        if child.is_dir() and _FAUST_DIR.fullmatch(child.name):
            shutil.rmtree(child)
            found = True
    return found


def check_data_dir(
    data_dir: Path, *, cluster_id: str, app_id: str, partitions: int, reset: bool = False
) -> str | None:
    """Check that ``data_dir`` belongs to this cluster and app, and record that it does.

    Args:
        data_dir: The worker's data directory (created when missing).
        cluster_id: The id the broker reports (:func:`streamapp.kafka.cluster_facts`).
        app_id: The worker's app id (consumer group).
        partitions: The tables' partition count.
        reset: Drop the local tables of another cluster or app instead of refusing.

    Returns:
        A WARNING line when local tables were dropped (another partition count, or ``reset``),
        else None.

    Raises:
        DataDirMismatchError: The directory's tables belong to another cluster or app; the
            message names both and the options ``--data-dir`` and ``--reset-data-dir``.
    """
    data_dir = Path(data_dir)
    make_data_dir(data_dir)
    path = data_dir / MARKER_NAME
    mine = {"cluster_id": cluster_id, "app_id": app_id, "partitions": partitions}
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = None  # a new directory, or one from before the marker: adopt it
    note = None
    if isinstance(kept, dict):
        theirs = (kept.get("cluster_id"), kept.get("app_id"))
        if theirs != (cluster_id, app_id):
            if not reset:
                raise DataDirMismatchError(
                    f"data directory {data_dir.resolve()} holds the tables of app {theirs[1]!r} "
                    f"on cluster {theirs[0]!r}, not of app {app_id!r} on this cluster "
                    f"{cluster_id!r}: give this worker its own --data-dir (STREAMAPP_DATA_DIR), "
                    "or start afresh with --reset-data-dir (drops these tables; this "
                    "cluster's are restored from its changelogs)"
                )
            if _drop_tables(data_dir):
                note = (f"dropped the tables of app {theirs[1]!r} on cluster {theirs[0]!r} "
                        f"from {data_dir} (--reset-data-dir)")
        elif kept.get("partitions") != partitions and _drop_tables(data_dir):
            note = (f"dropped the local tables of {data_dir}: they were kept for "
                    f"{kept.get('partitions')} partitions, the tables now have {partitions} "
                    "(streamapp tables rebuild); restoring them from the changelogs")
    if kept != mine:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(mine) + "\n")
        tmp.replace(path)
    return note
