"""Reading one of our topics from a point to its end, then following it: what ``streamapp dlq
tail`` and ``streamapp results tail`` share.

A :class:`TopicReader` is a plain aiokafka consumer (no group, nothing committed). The end of a
partition is the high watermark of the first fetch response for it, not a ListOffsets answer:
Tansu answers ListOffsets "latest" with the start of the last stored batch + 1 (docs/broker.md),
and the fetch high watermark is right on every broker. Where to start comes from
:meth:`TopicReader.start_at_time` (the Kafka offsets-for-times lookup) or
:meth:`TopicReader.start_at_last`; by default a reader starts at the beginning.
"""

from __future__ import annotations

import abc
import re
import time
import unicodedata
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from typing import Any, Generic, Self, TypeVar

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from streamapp.exceptions import BrokerError, SecurityError
from streamapp.kafka import IsolationLevel, partitions_of, start_or_close

__all__ = ["TopicReader", "cell", "display_width", "iso_utc", "pad", "parse_since"]

_T = TypeVar("_T")

_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0, "w": 604_800.0}
_RELATIVE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")


#: 9999-12-31T23:59:59Z: the last time Python's datetime (and so the output) can show.
_LATEST_EPOCH_S = 253_402_300_799.0


def parse_since(text: str, *, now: float | None = None) -> float:
    """Parse a ``--since`` value into epoch seconds.

    Args:
        text: A duration before now (``"90s"``, ``"10m"``, ``"2h"``, ``"1d"``, ``"1h30m"``;
            units ms, s, m, h, d, w), epoch seconds (``"1796000000"``, ``"1796000000.5"``), or
            an ISO 8601 time (``"2026-05-01T12:00:00Z"``, ``"2026-05-01"``; without a zone it
            is local time).
        now: The clock for durations (default: ``time.time()``).

    Returns:
        Epoch seconds.

    Raises:
        ValueError: None of these forms; the message shows examples.
    """
    value = text.strip()
    if not value:
        raise ValueError("--since is empty; give e.g. 10m, 2h, 1796000000 or 2026-05-01T12:00Z")
    if re.fullmatch(rf"(?:{_RELATIVE.pattern})+", value):
        seconds = sum(float(n) * _UNITS_S[u] for n, u in _RELATIVE.findall(value))
        return (time.time() if now is None else now) - seconds
    try:
        epoch = float(value)
    except ValueError:
        pass
    else:
        if epoch < 0 or epoch != epoch or epoch == float("inf"):
            raise ValueError(f"--since {text!r} is not a time")
        if epoch > _LATEST_EPOCH_S:
            ms = epoch / 1000 <= _LATEST_EPOCH_S
            hint = " (epoch milliseconds? divide by 1000)" if ms else ""
            raise ValueError(f"--since {text!r} is after the year 9999: give epoch seconds{hint}")
        return epoch
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise ValueError(
            f"--since {text!r} is not a duration (10m, 2h, 1h30m), epoch seconds or an ISO 8601 "
            "time (2026-05-01T12:00:00Z)"
        ) from None


def iso_utc(ts: float) -> str:
    """Epoch seconds as ``2026-05-01T12:00:00.000Z``."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _char_width(char: str) -> int:
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def display_width(value: str) -> int:
    """Terminal columns ``value`` takes: 2 for East Asian wide and full-width characters
    (CJK, most emoji), 0 for combining and format characters, 1 for the rest (after
    :func:`cell` made control characters visible)."""
    if value.isascii():
        return len(value)
    return sum(_char_width(c) for c in value)


def _printable(value: str) -> str:
    """Characters that are not printable (tab, newline, NUL, U+202E, ...) as one space each,
    so that a cell stays on one line, in order, and its width is what the terminal shows."""
    if value.isprintable():
        return value
    return "".join(c if c.isprintable() else " " for c in value)


def cell(value: str, width: int) -> str:
    """``value`` on one line, cut to ``width`` terminal columns (:func:`display_width`) with a
    final "…" when wider; control characters become spaces."""
    value = _printable(value)
    if display_width(value) <= width:
        return value
    out, used = [], 0
    for char in value:
        w = _char_width(char)
        if used + w > width - 1:
            break
        out.append(char)
        used += w
    return "".join(out) + "…" if width > 0 else ""


def pad(value: str, width: int, *, right: bool = False) -> str:
    """:func:`cell` of ``value``, padded with spaces to exactly ``width`` columns (aligned
    left, or right with ``right``)."""
    text = cell(value, width)
    fill = " " * max(0, width - display_width(text))
    return fill + text if right else text + fill


class TopicReader(abc.ABC, Generic[_T]):
    """Reads a topic with no consumer group, from a start point to its end, then follows it.

    Use as ``async with Reader(...) as reader:``, optionally :meth:`start_at_time` or
    :meth:`start_at_last`, then :meth:`read_to_end` and, optionally, :meth:`follow`.
    Subclasses implement :meth:`decode`.

    Args:
        bootstrap_servers: ``host:port[,host:port]``.
        topic: The topic (``settings.dlq_topic``, ``settings.result_topic``).
        security: aiokafka security options (:func:`streamapp.kafka.kafka_security_options`).
        poll_ms: Longest wait of one poll.
        isolation_level: ``"read_committed"`` (default): records of committed transactions
            only, as an exactly_once worker's outcomes are meant to be read;
            ``"read_uncommitted"``: also those of open and aborted transactions.

    Attributes:
        skipped: Records that :meth:`decode` left out (subclasses count them).
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        *,
        security: Mapping[str, Any] | None = None,
        poll_ms: int = 200,
        isolation_level: IsolationLevel = "read_committed",
    ) -> None:
        self.topic = topic
        self.poll_ms = poll_ms
        self.skipped = 0
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap_servers,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level=isolation_level,
            **(security or {}),
        )
        self._user = str((security or {}).get("sasl_plain_username") or "")
        self._partitions: list[TopicPartition] = []
        self._end: dict[TopicPartition, int] = {}
        self._later: list[_T] = []
        self._min_timestamp_ms = 0

    @abc.abstractmethod
    def decode(self, tp: TopicPartition, record: ConsumerRecord[Any, Any]) -> _T | None:
        """The entry for one record, or None to leave it out."""

    async def __aenter__(self) -> Self:
        await start_or_close(self._consumer)
        try:
            try:
                partitions = await partitions_of(self._consumer, self.topic)
            except RuntimeError:
                user = self._user
                raise (SecurityError if user else BrokerError)(
                    f"topic {self.topic!r} does not exist; check --broker and the topic prefix "
                    "(STREAMAPP_TOPIC_PREFIX)" + (
                        f", or whether the broker denied user {user!r} access to the topic "
                        "(a topic the user may not describe looks absent): grant it the "
                        "ACLs docs/deployment.md lists" if user else "")
                ) from None
            self._partitions = [TopicPartition(self.topic, p) for p in sorted(partitions)]
            self._consumer.assign(self._partitions)
            await self._consumer.seek_to_beginning(*self._partitions)
        except BaseException:
            await self._consumer.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._consumer.stop()

    async def start_at_time(self, since_s: float) -> None:
        """Start each partition at its first record with a timestamp at or after ``since_s``
        (epoch s), found with the offsets-for-times lookup; records before it are left out.

        Tansu answers the lookup from the time it appended each batch (its own clock), at batch
        granularity, and for a time after its last batch with offset 0 and timestamp -1 where
        Apache Kafka answers "none" (docs/broker.md): a negative timestamp is read as "none",
        so the partition starts at its end, and records older than ``since_s`` that share a
        batch with newer ones are dropped by their own timestamps.
        """
        since_ms = int(since_s * 1000)
        self._min_timestamp_ms = since_ms
        found = await self._consumer.offsets_for_times({tp: since_ms for tp in self._partitions})
        past_end = []
        for tp in self._partitions:
            hit = found.get(tp)
            if hit is None or hit.timestamp < 0:
                past_end.append(tp)
            else:
                self._consumer.seek(tp, hit.offset)
        if past_end:
            # ListOffsets "latest" may be short of the end on Tansu: then a few older records
            # are read and dropped by their timestamps.
            await self._consumer.seek_to_end(*past_end)

    async def start_at_last(self, count: int) -> None:
        """Start each partition ``count`` records before its end (or at its beginning), so that
        :meth:`read_to_end` reads at least the last ``count`` records of every partition."""
        begin = await self._consumer.beginning_offsets(self._partitions)
        # On Tansu this end may be short of the real one (never beyond it): more is read.
        end = await self._consumer.end_offsets(self._partitions)
        for tp in self._partitions:
            self._consumer.seek(tp, max(begin[tp], end[tp] - count))

    async def read_to_end(self, *, timeout_s: float = 30.0) -> list[_T]:
        """Every entry from the start point up to the end of each partition as of the first
        fetch.

        Returns:
            Entries in topic order per partition, partitions in turn (so a device's entries,
            which share a partition, stay in the order they were written).

        Raises:
            BrokerError: The end was not reached within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        read: list[tuple[int, int, _T]] = []
        while True:
            for tp in self._partitions:
                if tp not in self._end:
                    high = self._consumer.highwater(tp)
                    if high is not None:  # known once a fetch response for tp arrived
                        self._end[tp] = high
            if len(self._end) == len(self._partitions) and all(
                [await self._consumer.position(tp) >= self._end[tp] for tp in self._partitions]
            ):
                break
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"could not read {self.topic!r} to its end within {timeout_s} s; is the "
                    "broker reachable?"
                )
            batches = await self._consumer.getmany(timeout_ms=self.poll_ms)
            for tp, records in batches.items():
                end = self._end.get(tp)
                for record in records:
                    entry = self._entry(tp, record)
                    if entry is None:
                        continue
                    if end is not None and record.offset >= end:
                        self._later.append(entry)  # written after the read began
                    else:
                        read.append((tp.partition, record.offset, entry))
        read.sort(key=lambda r: (r[0], r[1]))
        return [entry for _, _, entry in read]

    async def follow(self) -> AsyncIterator[_T]:
        """Entries written after :meth:`read_to_end`'s end, as they arrive; never ends by itself
        (cancel it, or break out of the loop)."""
        later, self._later = self._later, []
        for entry in later:
            yield entry
        while True:
            batches = await self._consumer.getmany(timeout_ms=self.poll_ms)
            for tp, records in sorted(batches.items()):
                for record in records:
                    decoded = self._entry(tp, record)
                    if decoded is not None:
                        yield decoded

    def _entry(self, tp: TopicPartition, record: ConsumerRecord[Any, Any]) -> _T | None:
        if record.timestamp < self._min_timestamp_ms:
            return None
        return self.decode(tp, record)
