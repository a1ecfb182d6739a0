"""Reading table rows that may be bad: decode, check the shape, reject, never raise (no Faust).

Every table the worker restores (``device_stats``, ``device_windows``, ``retry_counts``) keeps
JSON objects as raw bytes. A row comes from the table's changelog topic (recovery) or from the
local store (queries and updates), and either may hold something no worker wrote: bytes that
are not UTF-8 JSON, or JSON of the wrong shape (``"x"``, ``[1, 2]``, ``{"total": "many"}``).
Faust's JSON codec raised on the first while restoring, its recovery loop then never passed the
record and the whole worker stayed not ready (issue 18, item 1); the second answered 500 or
silently reset a device's totals.

:class:`RowScreen` is the one place a table's rows are read. A row that cannot be read is
*rejected*: logged once at ERROR (table, and for a changelog record its topic, partition,
offset and key), counted (``streamapp_state_rows_rejected_total``), and replaced by

* ``device_stats``: a fresh row for the device (zero counts) that says so,
  ``"state_reset": {"reason", "detail", "at", "source"}``; the next update starts from it and
  keeps the note, so the device's answer says its counts start at that moment;
* ``device_windows``: an empty bucket with the same note (windows made of it carry it);
* ``retry_counts``: nothing (the attempt row is dropped; the retry record in the retry topic
  carries the attempt count the retry agent uses).

Keys and fields a row does not need are accepted (a newer version may add some) and left out
of what is served; a field that is there with the wrong type is a wrong shape.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from streamapp.tables.aggregates import empty_stats
from streamapp.tables.base import split_bucket_key

__all__ = [
    "DEVICE_ROWS_CACHED",
    "REJECT_REASONS",
    "RowKind",
    "RowScreen",
    "check_bucket_row",
    "check_retry_row",
    "check_stats_row",
    "decode_row",
]

log = logging.getLogger(__name__)

RowKind = Literal["stats", "bucket", "retry"]
#: Why a row was rejected: ``undecodable`` (not UTF-8 JSON), ``bad_shape`` (JSON, not a row of
#: the table), ``no_key`` (a changelog record without a key).
REJECT_REASONS = ("undecodable", "bad_shape", "no_key")
#: Bad stored rows remembered (bounded, so a flood of bad rows cannot grow the memory).
_REPORTED_MAX = 10_000
#: Bound of each device table's decode cache (:class:`RowScreen`), in keys: the rows of about
#: this many devices written or read last (a device's flush reads its stats row and one bucket
#: per series). Memory, stored bytes plus decoded objects: a bucket ~1.5 KiB; a stats row
#: ~2 KiB plus ~70 bytes per bucket start in its ``_buckets`` (up to 360 per series with the
#: default windows: ~30 KiB). At most ~32 MiB for ``device_stats``, ~1.5 MiB for
#: ``device_windows``. A worker writing more devices than this in turn misses the cache and
#: decodes, as without it.
DEVICE_ROWS_CACHED = 1024
#: Ints the fast ``last_seq`` check accepts as they are (``float()`` of them does not overflow;
#: larger ones go through :func:`check_stats_row`'s own test).
_FLOAT_INT_MAX = 2**1023


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _optional(row: Mapping[str, Any], name: str, ok: Callable[[Any], bool], what: str
              ) -> str | None:
    if name in row and row[name] is not None and not ok(row[name]):
        return f"{name} is {_short(row[name])}, not {what}"
    return None


def _counts(value: Any) -> bool:
    return isinstance(value, dict) and all(_count(n) for n in value.values())


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p is not None), None)


def _all_counts(values: dict[Any, Any]) -> bool:
    for n in values.values():
        if type(n) is not int or n < 0:
            return False
    return True


def _stats_row_ok(row: Any) -> bool:
    """Fast path of :func:`check_stats_row`: True only for rows it accepts (exact built-in
    types, the common case); False means "ask :func:`check_stats_row`", which also says why.
    Every condition here is at least as strict as the one it stands for there."""
    if type(row) is not dict:
        return False
    get = row.get
    total = get("total")
    counts = get("counts")
    if (type(total) is not int or total < 0 or type(counts) is not dict
            or not _all_counts(counts)):
        return False
    buckets = get("_buckets")
    if buckets is not None:
        if type(buckets) is not dict:
            return False
        for size, starts in buckets.items():
            if type(size) is not str or not size.isdigit() or type(starts) is not list:
                return False
            for start in starts:
                if type(start) is not int:
                    return False
    windows = get("_windows")
    if windows is not None:
        if type(windows) is not dict:
            return False
        for name in ("tumbling_ms", "step_ms"):
            size = windows.get(name)
            if type(size) is not int or size <= 0:
                return False
    value = get("device_id")
    if value is not None and type(value) is not str:
        return False
    for name in ("dead_letters_by_reason", "retries_by_reason"):
        value = get(name)
        if value is not None and (type(value) is not dict or not _all_counts(value)):
            return False
    value = get("last_seq")
    if value is not None and not (
            (type(value) is int and -_FLOAT_INT_MAX <= value <= _FLOAT_INT_MAX)
            or (type(value) is float and value.is_integer())):
        return False
    ewma = get("latency_ewma_ms")
    if ewma is not None:
        if type(ewma) is not dict:
            return False
        for value in ewma.values():
            if value is not None and type(value) is not float and type(value) is not int:
                return False
    skew = get("clock_skew")
    if skew is not None:
        if type(skew) is not dict:
            return False
        value = skew.get("count")
        if value is not None and (type(value) is not int or value < 0):
            return False
    for name in ("first_seen", "last_seen"):
        value = get(name)
        if value is not None and type(value) is not float and type(value) is not int:
            return False
    for name in ("last_result", "state_reset"):
        value = get(name)
        if value is not None and type(value) is not dict:
            return False
    return True


def check_stats_row(row: Any) -> str | None:
    """What is wrong with a ``device_stats`` row (the format in
    :mod:`streamapp.tables.aggregates`), or None when it can be served and updated.

    Required: ``total`` and ``counts`` (outcome → count); counts are ints >= 0.
    """
    return None if _stats_row_ok(row) else _stats_row_problem(row)


def _stats_row_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__} is not a stats row (an object)"
    if not _count(row.get("total")):
        return f"total is {_short(row.get('total'))}, not an int >= 0"
    if not _counts(row.get("counts")):
        return f"counts is {_short(row.get('counts'))}, not an object of ints >= 0"
    buckets = row.get("_buckets")
    if buckets is not None and not (
        isinstance(buckets, dict) and all(
            size.isdigit() and isinstance(starts, list)
            and all(type(s) is int for s in starts)  # (not bool; the hot path of a flush)
            for size, starts in buckets.items())
    ):
        return f"_buckets is {_short(buckets)}, not an object of size -> bucket starts"
    windows = row.get("_windows")
    if windows is not None and not (isinstance(windows, dict) and all(
            _count(windows.get(name)) and windows[name] > 0
            for name in ("tumbling_ms", "step_ms"))):
        return f"_windows is {_short(windows)}, not the window sizes in ms"
    skew = row.get("clock_skew")
    return _first(
        _optional(row, "device_id", lambda v: isinstance(v, str), "a string"),
        _optional(row, "dead_letters_by_reason", _counts, "an object of ints >= 0"),
        _optional(row, "retries_by_reason", _counts, "an object of ints >= 0"),
        _optional(row, "last_seq", lambda v: _number(v) and float(v).is_integer(), "an int"),
        _optional(row, "last_result", lambda v: isinstance(v, dict), "an object"),
        _optional(row, "latency_ewma_ms", lambda v: isinstance(v, dict) and all(
            x is None or _number(x) for x in v.values()), "an object of numbers"),
        _optional(row, "clock_skew", lambda v: isinstance(v, dict), "an object"),
        _optional(skew, "count", _count, "an int >= 0") if isinstance(skew, dict) else None,
        _optional(row, "first_seen", _number, "a number"),
        _optional(row, "last_seen", _number, "a number"),
        _optional(row, "state_reset", lambda v: isinstance(v, dict), "an object"),
    )


_BUCKET_COUNTS = ("results", "dead_letters", "retries", "skipped", "e2e_n")


def _bucket_row_ok(row: Any) -> bool:
    """Fast path of :func:`check_bucket_row`, as :func:`_stats_row_ok` is of the stats check."""
    if type(row) is not dict:
        return False
    get = row.get
    value = get("count")
    if type(value) is not int or value < 0:
        return False
    for name in _BUCKET_COUNTS:
        value = get(name)
        if value is not None and (type(value) is not int or value < 0):
            return False
    for name in ("e2e_sum_ms", "e2e_max_ms"):
        value = get(name)
        if value is not None and type(value) is not float and type(value) is not int:
            return False
    labels = get("labels")
    if labels is not None and (type(labels) is not dict or not _all_counts(labels)):
        return False
    value = get("state_reset")
    return value is None or type(value) is dict


def check_bucket_row(row: Any) -> str | None:
    """What is wrong with a ``device_windows`` bucket row, or None. Required: ``count``."""
    return None if _bucket_row_ok(row) else _bucket_row_problem(row)


def _bucket_row_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__} is not a window bucket (an object)"
    if not _count(row.get("count")):
        return f"count is {_short(row.get('count'))}, not an int >= 0"
    return _first(
        *(_optional(row, name, _count, "an int >= 0")
          for name in _BUCKET_COUNTS),
        _optional(row, "e2e_sum_ms", _number, "a number"),
        _optional(row, "e2e_max_ms", _number, "a number"),
        _optional(row, "labels", _counts, "an object of ints >= 0"),
        _optional(row, "state_reset", lambda v: isinstance(v, dict), "an object"),
    )


def check_retry_row(row: Any) -> str | None:
    """What is wrong with a ``retry_counts`` row (:meth:`streamapp.retry.RetryRecord.row`), or
    None. Required: ``attempts``."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__} is not an attempt row (an object)"
    if not _count(row.get("attempts")):
        return f"attempts is {_short(row.get('attempts'))}, not an int >= 0"
    return _first(
        _optional(row, "last_error", lambda v: isinstance(v, dict), "an object"),
        _optional(row, "errors", lambda v: isinstance(v, list), "a list"),
        _optional(row, "device_id", lambda v: isinstance(v, str), "a string"),
    )


_CHECKS: dict[RowKind, Callable[[Any], str | None]] = {
    "stats": check_stats_row, "bucket": check_bucket_row, "retry": check_retry_row,
}


def decode_row(raw: bytes, kind: RowKind) -> tuple[dict[str, Any] | None, str, str]:
    """Decode one stored row.

    Args:
        raw: The value bytes (UTF-8 JSON when a worker wrote them).
        kind: Which table's format to check.

    Returns:
        ``(row, "", "")`` for a good row, else ``(None, reason, detail)`` with ``reason``
        ``undecodable`` or ``bad_shape`` and what was wrong. Never raises.
    """
    try:
        value = json.loads(bytes(raw).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        return None, "undecodable", f"not UTF-8 JSON: {exc}"
    problem = _CHECKS[kind](value)
    if problem is not None:
        return None, "bad_shape", problem
    assert isinstance(value, dict)
    return value, "", ""


@dataclass(frozen=True)
class Verdict:
    """What to do with a changelog record: ``keep`` it, ``replace`` its value by ``value``
    (None: a tombstone), or ``drop`` it."""

    action: Literal["keep", "replace", "drop"]
    value: bytes | None = None


KEEP = Verdict("keep")


class RowScreen:
    """Reads one table's rows: checks changelog records before they reach the store, and
    decodes stored rows for queries and updates, rejecting those that cannot be read.

    Args:
        table: The table's name (``device_stats`` ...), for logs and metrics.
        kind: The row format.
        clock: Epoch seconds (tests pass a fake).
        cache_rows: Bound of the decode cache, in keys (0: none; the device tables use
            :data:`DEVICE_ROWS_CACHED`). A flush reads back the rows the flush before wrote:
            with the cache, bytes equal to those this screen last wrote or decoded for a key
            answer the row it kept instead of being decoded and checked again, and anything
            else (a restored changelog record, a reset, a row written by another worker
            before a rebalance, a deleted row) is read as without it. Least recently used keys
            leave first.

    Raises:
        ValueError: ``cache_rows`` < 0.

    Attributes:
        rejected: ``{(reason, source): rows}``; ``source`` is ``changelog`` (at restore) or
            ``store`` (read from the local store).
    """

    def __init__(self, table: str, kind: RowKind, clock: Callable[[], float] = time.time,
                 *, cache_rows: int = 0) -> None:
        if cache_rows < 0:
            raise ValueError(f"cache_rows is {cache_rows}: give a number of rows >= 0 "
                             "(0: no decode cache)")
        self.table = table
        self.kind = kind
        self.clock = clock
        self.rejected: Counter[tuple[str, str]] = Counter()
        #: key -> (bad stored bytes, the reset row answered for them), so that every read of
        #: one bad row logs once and answers the same ``at``
        self._reported: dict[bytes, tuple[bytes, dict[str, Any] | None]] = {}
        self.cache_rows = cache_rows
        #: The decode cache: key -> (stored bytes, the good row they decode to), least
        #: recently used first, at most ``cache_rows`` keys. An entry is a pure function of
        #: its bytes (``row == decode_row(raw)``), so it can only be used for the same bytes
        #: and is never wrong, only unused, when the stored value changes behind it.
        self._rows: OrderedDict[bytes, tuple[bytes, dict[str, Any]]] = OrderedDict()
        #: the web API reads rows from its query thread while the event loop writes them
        self._lock = threading.Lock()
        self._check = _CHECKS[kind]
        #: Reads answered from the decode cache (tests and benchmarks read it).
        self.cache_hits = 0

    def changelog(self, topic: str, partition: int, offset: int, key: bytes | None,
                  value: bytes | None) -> Verdict:
        """Check one changelog record before it is applied to the store.

        A tombstone (value None) is kept; a record without a key is dropped; a value that is
        not a row of this table is replaced by the table's reset row (see the module doc) and
        logged with its topic, partition, offset and key.
        """
        if key is None:
            self._reject("no_key", "changelog")
            log.error(
                "%s changelog record %s[%d]@%d has no key: skipped", self.table, topic,
                partition, offset,
            )
            return Verdict("drop")
        if value is None:
            return KEEP
        row, reason, detail = decode_row(value, self.kind)
        if row is not None:
            return KEEP
        self._reject(reason, "changelog")
        source = {"topic": topic, "partition": partition, "offset": offset}
        log.error(
            "%s changelog record %s[%d]@%d, key %s, cannot be read (%s): %s", self.table,
            topic, partition, offset, self._describe(key), detail, self._consequence(key),
        )
        reset = self._reset_row(key, reason, detail, source)
        return Verdict("replace", None if reset is None else json.dumps(reset).encode())

    def read(self, key: bytes, raw: bytes | None, *, remember: bool = True
             ) -> dict[str, Any] | None:
        """The stored row of ``key``: None when there is none; the reset row (``retry``: None)
        when the stored bytes cannot be read, logged once per key. Never raises.

        With a decode cache (``cache_rows > 0``), bytes equal to those last decoded or written
        for ``key`` answer the row decoded (or written) then, without decoding again: the
        caller must not modify it (build a new row instead, as
        :func:`~streamapp.tables.aggregates.update_stats` does). ``remember=False`` uses the
        cache but adds nothing to it (a scan of every row would push out the rows a flush
        needs).
        """
        if raw is None:
            return None
        if self.cache_rows:
            with self._lock:
                entry = self._rows.get(key)
                if entry is not None and entry[0] == raw:  # equal bytes, not the same object
                    self._rows.move_to_end(key)
                    self.cache_hits += 1
                    return entry[1]
        row, reason, detail = decode_row(raw, self.kind)
        if row is not None:
            if remember and self.cache_rows:
                self._remember(key, bytes(raw), row)
            return row
        reported = self._reported.get(key)
        if reported is not None and reported[0] == raw:  # the same bad row: the same reset
            return reported[1]
        self._reject(reason, "store")
        log.error("%s: the stored row of key %s cannot be read (%s): %s", self.table,
                  self._describe(key), detail, self._consequence(key))
        reset = self._reset_row(key, reason, detail, {"store": self.table})
        if len(self._reported) < _REPORTED_MAX:
            self._reported[key] = (bytes(raw), reset)
        return reset

    def written(self, key: bytes, raw: bytes, row: dict[str, Any]) -> None:
        """Note that ``key``'s stored value is now ``raw``, the encoding of ``row``, so that the
        next read of those bytes answers ``row`` without decoding them.

        ``row`` must be what decoding ``raw`` gives (JSON types: str keys, lists, no tuples)
        and is kept as it is: the caller must not modify it afterwards. A row this table's
        check rejects is not kept (reading its bytes rejects it, as without a cache). Costs
        the check, not a decode: O(fields of the row). No-op without a decode cache.
        """
        if not self.cache_rows:
            return
        if self._check(row) is None:
            self._remember(key, bytes(raw), row)
        else:
            self.forget(key)

    def forget(self, key: bytes) -> None:
        """Drop ``key`` from the decode cache (its row was deleted): frees its memory."""
        if self.cache_rows:
            with self._lock:
                self._rows.pop(key, None)

    def cached_rows(self) -> int:
        """Keys in the decode cache now (at most ``cache_rows``)."""
        return len(self._rows)

    def _remember(self, key: bytes, raw: bytes, row: dict[str, Any]) -> None:
        with self._lock:
            rows = self._rows
            rows[key] = (raw, row)
            rows.move_to_end(key)
            while len(rows) > self.cache_rows:
                rows.popitem(last=False)

    def _reject(self, reason: str, source: str) -> None:
        self.rejected[(reason, source)] += 1

    def _reset_row(self, key: bytes, reason: str, detail: str, source: dict[str, Any]
                   ) -> dict[str, Any] | None:
        reset = {"reason": reason, "detail": detail, "at": round(self.clock(), 3),
                 "source": source}
        if self.kind == "stats":
            return {**empty_stats(key.decode("utf-8", "replace")), "state_reset": reset}
        if self.kind == "bucket":
            return {"count": 0, "results": 0, "dead_letters": 0, "retries": 0,
                    "e2e_sum_ms": 0.0, "e2e_n": 0, "e2e_max_ms": None, "labels": {},
                    "state_reset": reset}
        return None

    def _describe(self, key: bytes) -> str:
        if self.kind == "bucket" and len(key) > 13:
            device, size_ms, start_ms = split_bucket_key(key)
            return (f"{device.decode('utf-8', 'replace')!r} (bucket of {size_ms / 1000:g} s "
                    f"starting {start_ms / 1000:.0f})")
        return repr(key.decode("utf-8", "replace"))

    def _consequence(self, key: bytes) -> str:
        if self.kind == "stats":
            return ("the device's stats start afresh from its next request (its /devices "
                    "answer says so in state_reset)")
        if self.kind == "bucket":
            return "this window bucket starts empty (windows made of it carry state_reset)"
        return ("the request's attempt row is dropped (its retry record still carries the "
                "attempt count)")

