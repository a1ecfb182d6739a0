"""Window sizes are fixed for a deployment: refuse to start with others than the stored state's.

Window buckets are stored by size (:mod:`streamapp.tables.windows`): a worker started with
another ``tumbling_window_s`` or ``hopping_step_s`` looks for buckets that were never written
and answers ``"count": 0`` for every window of every device (issue 18, item 6), while it
writes buckets of its own size next to the old ones. ``hopping_window_s`` may change: a hopping
window is summed from step buckets when it is read.

Each stats row records the sizes its buckets were written with (``_windows``, ms). Before the
worker starts, :func:`check_stored_windows` reads the tail of the ``device_stats`` changelog
(:func:`streamapp.kafka.read_partition_tails`: it holds the newest row of the devices written
last, and survives a removed data dir) and compares the newest stamped row's sizes with the
settings. Refusing is the default because the damage is silent and spreads: one worker of a
group started with other sizes writes buckets no other worker reads, for every device whose
partition it takes over; the fix is one setting. A deliberate change sets
``STREAMAPP_ACCEPT_WINDOW_CHANGE=1`` (a WARNING at the top of the worker's log instead): the
totals are kept, windows start empty at the new sizes, and the old buckets expire after
``window_expires_s``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import KafkaError

from streamapp.exceptions import ConfigError
from streamapp.kafka import (
    describe_error,
    kafka_security_options,
    read_partition_tails,
    run_sync,
)
from streamapp.settings import Settings
from streamapp.tables.rows import decode_row
from streamapp.tables.windows import WindowPlan

__all__ = ["StoredWindows", "check_stored_windows", "newest_stored_windows", "window_changes"]

#: Records read from the end of each changelog partition (seals and tombstones among them).
TAIL_RECORDS = 64
#: ``(setting, key of the stamp and of WindowPlan)`` of the sizes fixed for a deployment.
FIXED_SIZES = (("tumbling_window_s", "tumbling_ms"), ("hopping_step_s", "step_ms"))


@dataclass(frozen=True)
class StoredWindows:
    """The window sizes (ms) of the newest stamped stats row, and where it was read."""

    sizes_ms: Mapping[str, int]
    device: str
    partition: int
    offset: int


def newest_stored_windows(
    tails: Mapping[int, Iterable[tuple[int, bytes | None, bytes | None]]],
) -> StoredWindows | None:
    """The stamp of the most recently seen device among ``{partition: [(offset, key, value)]}``
    (``last_seen`` decides across partitions); None when no readable row has one."""
    best: tuple[float, StoredWindows] | None = None
    for partition, records in tails.items():
        for offset, key, value in records:
            if not key or value is None:
                continue
            row, _, _ = decode_row(value, "stats")
            stamp: Any = (row or {}).get("_windows")
            if row is None or not stamp:
                continue
            seen = float(row.get("last_seen") or 0.0)
            if best is None or seen >= best[0]:
                best = (seen, StoredWindows(
                    {name: int(stamp[name]) for _, name in FIXED_SIZES},
                    key.decode("utf-8", "replace"), partition, offset))
    return None if best is None else best[1]


def window_changes(stored: StoredWindows, plan: WindowPlan) -> list[tuple[str, float, float]]:
    """``(setting, stored s, configured s)`` of each fixed size that differs."""
    return [
        (setting, stored.sizes_ms[name] / 1000, getattr(plan, name) / 1000)
        for setting, name in FIXED_SIZES if stored.sizes_ms[name] != getattr(plan, name)
    ]


def check_stored_windows(settings: Settings, *, changelog: str | None = None) -> str | None:
    """Refuse to start when the stored device state was written with other window sizes.

    Args:
        settings: The worker's settings (broker, app id, window sizes,
            ``accept_window_change``).
        changelog: The ``device_stats`` changelog topic (default: Faust's name for it,
            ``<app_id>-device_stats-changelog``).

    Returns:
        None, or the WARNING to log (returned, not logged: the worker's log is not set up yet
        when this runs) when the sizes differ and ``accept_window_change`` is on, or when the
        broker could not be read (the worker then starts and waits for it, as before).

    Raises:
        ConfigError: The sizes differ and ``accept_window_change`` is off; one line naming each
            setting, its stored and configured value, and what to do.
    """
    topic = changelog or f"{settings.app_id}-device_stats-changelog"
    try:
        tails = run_sync(lambda: read_partition_tails(
            settings.bootstrap_servers, topic, TAIL_RECORDS,
            security=kafka_security_options(settings),
        ))
    except (KafkaError, OSError, TimeoutError) as exc:  # the worker waits for its broker
        return (f"the window sizes of the stored state could not be read from {topic} "
                f"({describe_error(exc)}): not checked")
    stored = newest_stored_windows(tails)
    if stored is None:
        return None
    changes = window_changes(stored, WindowPlan.from_settings(settings))
    if not changes:
        return None
    diff = "; ".join(
        f"STREAMAPP_{name.upper()} is {new:g} here, {old:g} in the stored state"
        for name, old, new in changes
    )
    keep = " ".join(f"STREAMAPP_{name.upper()}={old:g}" for name, old, _ in changes)
    where = (f"(device {stored.device!r}, {topic} partition {stored.partition} offset "
             f"{stored.offset})")
    if settings.accept_window_change:
        return (f"window sizes changed: {diff} {where}; STREAMAPP_ACCEPT_WINDOW_CHANGE is set: "
                f"windows start empty at the new sizes, those written before are no longer "
                f"served (totals are kept)")
    raise ConfigError(
        f"window sizes are fixed for a deployment: {diff} {where}. Start with {keep}, or set "
        f"STREAMAPP_ACCEPT_WINDOW_CHANGE=1 to start the windows afresh (totals are kept; "
        f"windows written before are no longer served)"
    )
