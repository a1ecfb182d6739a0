"""Per-device aggregates: what one batch adds to a device, and how rows are merged (no Faust).

Two kinds of rows, both JSON objects:

* a **stats row** per device (table ``device_stats``)::

    {"device_id": "cam17", "total": 42,
     "counts": {"result": 40, "dead_letter": 2, "retry": 1},
     "dead_letters_by_reason": {"bad_shape": 2}, "retries_by_reason": {"engine_oom": 1},
     "last_seq": 41,
     "last_result": {"request_id": "...", "seq": 41, "model": "digits", "label": "3",
                     "score": 0.998, "e2e_ms": 12.5, "ts": 1796000000.2},
     "latency_ewma_ms": {"e2e": 12.1, "queue": 3.0, "infer": 0.9},
     "clock_skew": {"count": 1, "last_ms": 82800012.5, "last_ts": 1796000000.1},
     "first_seen": 1796000000.0, "last_seen": 1796000000.2,
     "_buckets": {"10000": [1796000000000, ...]},
     "_windows": {"tumbling_ms": 10000, "hopping_ms": 60000, "step_ms": 10000}}

  ``total`` counts finished requests (results, dead letters, and the ``expired`` and
  ``superseded`` requests of a queue policy, which appear in ``counts`` once a device has one;
  a retry is not finished).
  ``state_reset`` (``{"reason", "detail", "at", "source"}``) is there only when the device's
  stored row could not be read and its counts started afresh at ``at``
  (:mod:`streamapp.tables.rows`); every later row keeps it. ``_buckets`` indexes the
  device's window buckets so that expired ones can be deleted, ``_windows`` the window sizes
  (ms) they were written with; both are internal and not served.

* a **bucket row** per device, bucket size and bucket start (table ``device_windows``)::

    {"count": 12, "results": 11, "dead_letters": 1, "retries": 0, "skipped": 0,
     "e2e_sum_ms": 130.2, "e2e_n": 11, "e2e_max_ms": 20.1, "labels": {"3": 6, "8": 5}}

  (plus ``state_reset`` when the stored bucket could not be read and was started empty).

The EWMA of a latency ``x`` is ``ewma = alpha * x + (1 - alpha) * ewma``, seeded with the first
value, applied in the order outcomes were produced. Latencies are never negative: the pipeline
measures ``e2e`` from the record's Kafka timestamp when the device clock is off
(``clock_skew``: how many results of the device had a skewed clock, and the latest skew, ms;
docs/faults.md); a negative or non-finite value (a row written before that rule) is ignored, and
an EWMA that is negative is seeded again.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from streamapp.agents.observer import FINAL_KINDS, Outcome
from streamapp.tables.windows import WindowPlan, WindowRange

__all__ = [
    "DeviceDelta",
    "empty_stats",
    "merge_bucket",
    "public_stats",
    "render_window",
    "update_stats",
]

_COUNT_KINDS = ("result", "dead_letter", "retry")
_LATENCIES = ("e2e", "queue", "infer")


def empty_stats(device_id: str) -> dict[str, Any]:
    """The stats row of a device with nothing counted yet: every field ``GET /devices/{id}``
    documents, counts 0, the by-reason objects empty, the rest null (what a row started
    afresh after an unreadable one answers, :mod:`streamapp.tables.rows`)."""
    return {
        "device_id": device_id,
        "total": 0,
        "counts": {k: 0 for k in _COUNT_KINDS},
        "dead_letters_by_reason": {},
        "retries_by_reason": {},
        "last_seq": None,
        "last_result": None,
        "latency_ewma_ms": {name: None for name in _LATENCIES},
        "clock_skew": {"count": 0, "last_ms": None, "last_ts": None},
        "first_seen": None,
        "last_seen": None,
    }


def _empty_bucket() -> dict[str, Any]:
    return {"count": 0, "results": 0, "dead_letters": 0, "retries": 0, "skipped": 0,
            "e2e_sum_ms": 0.0, "e2e_n": 0, "e2e_max_ms": None, "labels": {}}


@dataclass
class DeviceDelta:
    """What the outcomes since the last flush add to one device (in memory, cheap to update).

    Attributes:
        device_id: The device (the record key as text).
        counts: Outcomes by kind.
        dead_letters_by_reason / retries_by_reason: Reason code → count.
        latencies: ``(e2e_ms, queue_ms, infer_ms)`` of each result, in order.
        last_seq: From the newest finished request that had one.
        last_outcome: The newest result (:attr:`last_result` is made of it when it is read,
            once per flush, rather than for every result).
        first_ts / last_ts: Epoch seconds of the first and last outcome.
        buckets: ``{(bucket size ms, bucket start ms): bucket row}``.
    """

    device_id: str
    counts: dict[str, int] = field(default_factory=dict)
    dead_letters_by_reason: dict[str, int] = field(default_factory=dict)
    retries_by_reason: dict[str, int] = field(default_factory=dict)
    latencies: list[tuple[float | None, float | None, float | None]] = field(
        default_factory=list
    )
    clock_skews: int = 0
    last_clock_skew: tuple[float, float] | None = None
    last_seq: int | None = None
    last_outcome: Outcome | None = None
    first_ts: float | None = None
    last_ts: float | None = None
    buckets: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)

    @property
    def last_result(self) -> dict[str, Any] | None:
        """The ``last_result`` of the stats row: the newest result, or None when none."""
        outcome = self.last_outcome
        if outcome is None:
            return None
        return {
            "request_id": outcome.request_id, "seq": outcome.seq, "model": outcome.model,
            "label": outcome.label, "score": outcome.score, "e2e_ms": outcome.e2e_ms,
            "attempt": outcome.attempt, "ts": outcome.ts,
        }

    def add(self, outcome: Outcome, plan: WindowPlan) -> None:
        """Count one outcome."""
        kind = outcome.kind
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if kind == "dead_letter":
            reason = outcome.reason or "unknown"
            self.dead_letters_by_reason[reason] = self.dead_letters_by_reason.get(reason, 0) + 1
        elif kind == "retry":
            reason = outcome.reason or "unknown"
            self.retries_by_reason[reason] = self.retries_by_reason.get(reason, 0) + 1
        if kind in FINAL_KINDS and outcome.seq is not None:
            self.last_seq = outcome.seq
        if kind == "result":
            self.latencies.append((outcome.e2e_ms, outcome.queue_ms, outcome.infer_ms))
            if outcome.clock_skew_ms is not None:
                self.clock_skews += 1
                self.last_clock_skew = (outcome.clock_skew_ms, outcome.ts)
            self.last_outcome = outcome
        ts = outcome.ts
        if self.first_ts is None:
            self.first_ts = ts
        self.last_ts = ts
        buckets = self.buckets
        ms = math.floor(ts * 1000)  # WindowPlan.bucket_starts, inlined (once per outcome)
        for size in plan.bucket_sizes_ms:
            where = (size, (ms // size) * size)
            bucket = buckets.get(where)
            if bucket is None:
                bucket = buckets[where] = _empty_bucket()
            _add_to_bucket(bucket, outcome)


def _add_to_bucket(bucket: dict[str, Any], outcome: Outcome) -> None:
    if outcome.kind == "retry":
        bucket["retries"] += 1
        return
    bucket["count"] += 1
    if outcome.kind == "dead_letter":
        bucket["dead_letters"] += 1
        return
    if outcome.kind != "result":  # expired or superseded: a queue policy skipped it
        bucket["skipped"] += 1
        return
    bucket["results"] += 1
    if _usable(outcome.e2e_ms):
        assert outcome.e2e_ms is not None
        bucket["e2e_sum_ms"] += outcome.e2e_ms
        bucket["e2e_n"] += 1
        top = bucket["e2e_max_ms"]
        bucket["e2e_max_ms"] = outcome.e2e_ms if top is None else max(top, outcome.e2e_ms)
    if outcome.label is not None:
        labels = bucket["labels"]
        labels[outcome.label] = labels.get(outcome.label, 0) + 1


def _usable(ms: float | None) -> bool:
    """A latency that can enter a mean or an EWMA: a finite number >= 0."""
    return ms is not None and math.isfinite(ms) and ms >= 0.0


_BUCKET_COUNTS = ("count", "results", "dead_letters", "retries", "skipped", "e2e_n")


def merge_bucket(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """The sum of two bucket rows (counts and sums add, maxima take the larger; a
    ``state_reset`` note of either is kept). A new row: neither argument is modified."""
    out = _empty_bucket()
    labels: dict[str, int] = out["labels"]
    for row in (old, new):
        if not row:
            continue
        get = row.get
        reset = get("state_reset")
        if reset:
            out["state_reset"] = reset
        for name in _BUCKET_COUNTS:
            n = get(name)
            if n:  # (a missing, null or 0 count adds nothing)
                out[name] += int(n)
        total = get("e2e_sum_ms")
        if total:  # (adding 0.0 to the sum, which starts at +0.0, changes nothing)
            out["e2e_sum_ms"] += float(total)
        top = get("e2e_max_ms")
        if top is not None:
            out["e2e_max_ms"] = top if out["e2e_max_ms"] is None else max(out["e2e_max_ms"], top)
        more = get("labels")
        if more:
            for label, n in more.items():
                labels[label] = labels.get(label, 0) + int(n)
    return out


def _add_counts(target: Mapping[str, int] | None, more: Mapping[str, int]) -> dict[str, int]:
    """A new ``target + more`` by name (``target`` None: empty); neither is modified."""
    out = dict(target) if target else {}
    for name, n in more.items():
        out[name] = out.get(name, 0) + n
    return out


def update_stats(
    row: Mapping[str, Any] | None,
    delta: DeviceDelta,
    plan: WindowPlan,
    *,
    alpha: float,
    now_s: float,
) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """Apply a delta to a device's stats row.

    Args:
        row: The stored row, or None for a new device.
        delta: What happened since the last flush.
        plan: Window sizes and expiry.
        alpha: EWMA weight of the newest value, in (0, 1].
        now_s: Epoch seconds, for expiry.

    Returns:
        ``(new row, expired buckets)``: the buckets ``(size ms, start ms)`` to delete from the
        bucket table. Neither ``row`` nor ``delta`` is modified; the new row shares
        ``last_result`` and ``state_reset`` with them (rows are never modified in place).
    """
    old: Mapping[str, Any] = row or {}
    get = old.get
    counts = {k: 0 for k in _COUNT_KINDS}
    stored_counts = get("counts")
    if stored_counts:
        counts.update(stored_counts)
    for name, n in delta.counts.items():
        counts[name] = counts.get(name, 0) + n
    total = 0
    for name in FINAL_KINDS:
        total += counts.get(name, 0)
    ewma = dict(get("latency_ewma_ms") or {name: None for name in _LATENCIES})
    if delta.latencies:
        # one latency at a time, each in the order of the outcomes: the same arithmetic as
        # one outcome at a time (the three EWMAs are independent)
        beta = 1.0 - alpha
        isfinite = math.isfinite
        for i, name in enumerate(_LATENCIES):
            value: Any = ewma.get(name)
            seeded = _usable(value)
            changed = False
            for values in delta.latencies:
                x = values[i]
                if x is None or not isfinite(x) or x < 0.0:  # not _usable(x)
                    continue
                value = alpha * x + beta * value if seeded else x
                seeded = isfinite(value) and value >= 0.0
                changed = True
            if changed:
                ewma[name] = value
    index: dict[str, list[int]] = {
        str(size): list(starts) for size, starts in (get("_buckets") or {}).items()
    }
    for size, start in delta.buckets:
        starts = index.setdefault(str(size), [])
        if start not in starts:
            starts.append(start)
    expired: list[tuple[int, int]] = []
    kept: dict[str, list[int]] = {}
    limit_ms = math.floor(now_s * 1000) - plan.expires_ms  # WindowPlan.expired, inlined
    for size_text, starts in index.items():
        size = int(size_text)
        starts.sort()
        cut = bisect.bisect_right(starts, limit_ms - size)  # start + size <= limit: expired
        if cut:
            expired.extend((size, start) for start in starts[:cut])
            del starts[:cut]
        if starts:
            kept[size_text] = starts
    new = {
        "device_id": delta.device_id,
        "total": total,
        "counts": counts,
        "dead_letters_by_reason": _add_counts(
            get("dead_letters_by_reason"), delta.dead_letters_by_reason
        ),
        "retries_by_reason": _add_counts(get("retries_by_reason"), delta.retries_by_reason),
        "last_seq": delta.last_seq if delta.last_seq is not None else get("last_seq"),
        "last_result": delta.last_result or get("last_result"),
        "latency_ewma_ms": {k: (None if v is None else round(v, 3)) for k, v in ewma.items()},
        "clock_skew": _clock_skew(get("clock_skew"), delta),
        "first_seen": (old["first_seen"] if get("first_seen") is not None
                       else delta.first_ts),
        "last_seen": delta.last_ts if delta.last_ts is not None else get("last_seen"),
        "_buckets": kept,
        # what the buckets were written with: a worker started with other window sizes
        # refuses to (streamapp.tables.stored_windows)
        "_windows": {"tumbling_ms": plan.tumbling_ms, "hopping_ms": plan.hopping_ms,
                     "step_ms": plan.step_ms},
    }
    if get("state_reset"):
        new["state_reset"] = old["state_reset"]
    return new, expired


def _clock_skew(old: Mapping[str, Any] | None, delta: DeviceDelta) -> dict[str, Any]:
    out = {"count": 0, "last_ms": None, "last_ts": None, **(old or {})}
    out["count"] = int(out["count"] or 0) + delta.clock_skews
    if delta.last_clock_skew is not None:
        out["last_ms"], out["last_ts"] = delta.last_clock_skew
    return out


#: Fields of a stats row that ``GET /devices/{id}`` serves, in this order (``state_reset`` only
#: when present). Other keys a stored row may hold (internal ``_buckets``, or fields no worker of
#: this version writes) are not served.
PUBLIC_STATS_FIELDS = (
    "device_id", "total", "counts", "dead_letters_by_reason", "retries_by_reason", "last_seq",
    "last_result", "latency_ewma_ms", "clock_skew", "first_seen", "last_seen", "state_reset",
)


def public_stats(row: Mapping[str, Any]) -> dict[str, Any]:
    """A stats row as served by ``GET /devices/{id}``: the :data:`PUBLIC_STATS_FIELDS` it has."""
    return {k: row[k] for k in PUBLIC_STATS_FIELDS if k in row}


def render_window(
    window: WindowRange, buckets: Iterable[Mapping[str, Any] | None]
) -> dict[str, Any]:
    """One window as served by ``GET /devices/{id}/windows``: the merge of its buckets."""
    total: dict[str, Any] = _empty_bucket()
    for bucket in buckets:
        if bucket:
            total = merge_bucket(total, bucket)
    n = total.pop("e2e_n")
    e2e_sum = total.pop("e2e_sum_ms")
    out = {
        "start": window.start_ms / 1000.0,
        "end": window.end_ms / 1000.0,
        **{k: total[k] for k in ("count", "results", "dead_letters", "retries", "skipped")},
        "e2e_mean_ms": round(e2e_sum / n, 3) if n else None,
        "e2e_max_ms": total["e2e_max_ms"],
        "labels": dict(sorted(total["labels"].items())),
    }
    if total.get("state_reset"):
        out["state_reset"] = total["state_reset"]
    return out
