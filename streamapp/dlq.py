"""Dead-letter tooling: read, filter, show and replay the records of ``inference-dlq``.

Used by ``streamapp dlq tail`` and ``streamapp dlq replay``, and by tests. The topic is read with a
plain aiokafka consumer (no group, nothing committed) from the beginning up to its end *as of the
start of the read*. That end is the high watermark of the first fetch response of each partition,
not a ListOffsets answer: Tansu answers ListOffsets "latest" wrongly after multi-record batches
(docs/broker.md), and the fetch high watermark is right on every broker.

A replay re-publishes each matching dead letter's *original* key and value, byte for byte, to the
request topic. The worker sees a brand-new request (attempt 0, no retry history), so a replay
should follow a fix of whatever made the requests fail; replaying twice sends them twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.structs import ConsumerRecord

from streamapp.codecs import dead_letter_to_dict, decode_dead_letter
from streamapp.exceptions import BrokerError
from streamapp.kafka import partitions_of, start_or_close
from streamapp.records import DeadLetter

__all__ = [
    "DeadLetterEntry",
    "DeadLetterFilter",
    "DeadLetterReader",
    "ReplayReport",
    "format_entries",
    "format_json_lines",
    "parse_since",
    "read_dead_letters",
    "replay_dead_letters",
    "replayable",
]

log = logging.getLogger(__name__)

_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0, "w": 604_800.0}
_RELATIVE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")


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
        return epoch
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise ValueError(
            f"--since {text!r} is not a duration (10m, 2h, 1h30m), epoch seconds or an ISO 8601 "
            "time (2026-05-01T12:00:00Z)"
        ) from None


@dataclass(frozen=True, slots=True)
class DeadLetterEntry:
    """One dead letter and where it is in the DLQ topic.

    Attributes:
        letter: The decoded dead letter (original key and value in ``letter.key/value``).
        partition / offset: Its position in the DLQ topic.
        timestamp_ms: The DLQ record's Kafka timestamp (epoch milliseconds).
    """

    letter: DeadLetter
    partition: int
    offset: int
    timestamp_ms: int

    @property
    def failed_at(self) -> float:
        """When it was dead-lettered (epoch s): ``last_failed_ts``, else the record time."""
        return float(self.letter.last_failed_ts or self.timestamp_ms / 1000.0)

    @property
    def reason(self) -> str:
        return str(self.letter.error.get("reason", ""))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every dead-letter field (key and value base64) plus ``dlq`` position."""
        return {
            **dead_letter_to_dict(self.letter),
            "dlq": {"partition": self.partition, "offset": self.offset,
                    "timestamp_ms": self.timestamp_ms},
        }


@dataclass(frozen=True, slots=True)
class DeadLetterFilter:
    """Which dead letters to keep; every given criterion must hold.

    Attributes:
        reason: ``error.reason`` equals this.
        device: ``device_id`` equals this, or — for letters whose value could not be decoded —
            the record key (UTF-8) does.
        since: Dead-lettered at or after this time (epoch s, :attr:`DeadLetterEntry.failed_at`).
    """

    reason: str | None = None
    device: str | None = None
    since: float | None = None

    def matches(self, entry: DeadLetterEntry) -> bool:
        letter = entry.letter
        if self.reason is not None and entry.reason != self.reason:
            return False
        if self.device is not None:
            device = letter.device_id
            if device is None and letter.key is not None:
                device = letter.key.decode("utf-8", "replace")
            if device != self.device:
                return False
        return self.since is None or entry.failed_at >= self.since

    def describe(self) -> str:
        """``reason=R device=D since=ISO`` for messages, or ``all``."""
        parts = []
        if self.reason is not None:
            parts.append(f"reason={self.reason}")
        if self.device is not None:
            parts.append(f"device={self.device}")
        if self.since is not None:
            parts.append(f"since={_iso(self.since)}")
        return " ".join(parts) or "all"


class DeadLetterReader:
    """Reads a DLQ topic from the beginning, with no consumer group (nothing is committed).

    Use as ``async with DeadLetterReader(...) as reader:`` then :meth:`read_to_end` and,
    optionally, :meth:`follow`.

    Args:
        bootstrap_servers: ``host:port[,host:port]``.
        topic: The DLQ topic (``settings.dlq_topic``).
        security: aiokafka security options (:func:`streamapp.client.kafka_security_options`).
        poll_ms: Longest wait of one poll.

    Attributes:
        skipped: Records that were not dead letters streamapp wrote (not decodable); logged
            and left out.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        *,
        security: Mapping[str, Any] | None = None,
        poll_ms: int = 200,
    ) -> None:
        self.topic = topic
        self.poll_ms = poll_ms
        self.skipped = 0
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap_servers,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **(security or {}),
        )
        self._partitions: list[TopicPartition] = []
        self._end: dict[TopicPartition, int] = {}
        self._later: list[DeadLetterEntry] = []

    async def __aenter__(self) -> DeadLetterReader:
        await start_or_close(self._consumer)
        try:
            try:
                partitions = await partitions_of(self._consumer, self.topic)
            except RuntimeError:
                raise BrokerError(
                    f"topic {self.topic!r} does not exist; check --broker and the topic prefix "
                    "(STREAMAPP_TOPIC_PREFIX)"
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

    async def read_to_end(self, *, timeout_s: float = 30.0) -> list[DeadLetterEntry]:
        """Every dead letter up to the end of each partition as of the first fetch.

        Returns:
            Entries in topic order per partition, partitions in turn (so a device's letters,
            which share a partition, stay in the order they were written).

        Raises:
            BrokerError: The end was not reached within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        entries: list[DeadLetterEntry] = []
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
                    entry = self._decode(tp, record)
                    if entry is None:
                        continue
                    if end is not None and record.offset >= end:
                        self._later.append(entry)  # written after the read began
                    else:
                        entries.append(entry)
        entries.sort(key=lambda e: (e.partition, e.offset))
        return entries

    async def follow(self) -> AsyncIterator[DeadLetterEntry]:
        """Dead letters written after :meth:`read_to_end`'s end, as they arrive; never ends
        by itself (cancel it, or break out of the loop)."""
        later, self._later = self._later, []
        for entry in later:
            yield entry
        while True:
            batches = await self._consumer.getmany(timeout_ms=self.poll_ms)
            for tp, records in sorted(batches.items()):
                for record in records:
                    decoded = self._decode(tp, record)
                    if decoded is not None:
                        yield decoded

    def _decode(
        self, tp: TopicPartition, record: ConsumerRecord[Any, Any]
    ) -> DeadLetterEntry | None:
        try:
            letter = decode_dead_letter(record.value)
        except Exception as exc:  # anything else someone wrote to the topic
            self.skipped += 1
            log.warning(
                "%s[%d]@%d is not a streamapp dead letter (%s: %s); skipped",
                tp.topic, tp.partition, record.offset, type(exc).__name__, exc,
            )
            return None
        return DeadLetterEntry(letter, tp.partition, record.offset, record.timestamp)


async def read_dead_letters(
    bootstrap_servers: str,
    topic: str,
    *,
    where: DeadLetterFilter | None = None,
    security: Mapping[str, Any] | None = None,
    timeout_s: float = 30.0,
) -> list[DeadLetterEntry]:
    """The dead letters in ``topic`` up to its current end that match ``where``.

    Returns:
        Matching entries, in topic order per partition (see
        :meth:`DeadLetterReader.read_to_end`).

    Raises:
        BrokerError: The topic does not exist, or its end was not reached in ``timeout_s``.
    """
    where = where or DeadLetterFilter()
    async with DeadLetterReader(bootstrap_servers, topic, security=security) as reader:
        entries = await reader.read_to_end(timeout_s=timeout_s)
    return [e for e in entries if where.matches(e)]


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What a replay did.

    Attributes:
        matched: Dead letters that matched the filter.
        replayed: Requests re-published (0 on a dry run).
        request_topic: Where they went.
        dry_run: Nothing was published.
        skipped: Matched dead letters that cannot be replayed because their original value or
            key was left out (too large to keep: ``extra.value_omitted`` / ``key_omitted``,
            e.g. ``unproducible_outcome``), or that stand for an offset of a record batch the
            worker could not decode (``extra.record_batch``); re-publishing them would send an
            empty value or a whole batch as one value.
    """

    matched: int
    replayed: int
    request_topic: str
    dry_run: bool
    skipped: int = 0


def replayable(letter: DeadLetter) -> bool:
    """Whether a dead letter still holds its original key and value byte for byte (never one
    of an undecodable record batch: its value is the batch, or empty)."""
    return not ({"value_omitted", "key_omitted", "record_batch"} & set(letter.extra or {}))


async def replay_dead_letters(
    bootstrap_servers: str,
    dlq_topic: str,
    request_topic: str,
    *,
    where: DeadLetterFilter,
    dry_run: bool = False,
    security: Mapping[str, Any] | None = None,
    timeout_s: float = 30.0,
) -> ReplayReport:
    """Re-publish the original key and value of every matching dead letter to the request topic.

    The values are sent unchanged, so the worker treats each as a new request: attempt 0 and no
    retry history. Within a DLQ partition (so for each device) the original order is kept.

    Args:
        where: Which dead letters; give at least a reason (the CLI requires one).
        dry_run: Count, publish nothing.

    Returns:
        The counts, after the broker acknowledged every record (``acks=all``).

    Raises:
        BrokerError: See :func:`read_dead_letters`.
    """
    matched = await read_dead_letters(
        bootstrap_servers, dlq_topic, where=where, security=security, timeout_s=timeout_s
    )
    entries = [e for e in matched if replayable(e.letter)]
    skipped = len(matched) - len(entries)
    if skipped:
        log.warning("%d matching dead letters cannot be replayed: their original value or key "
                    "was too large to keep (extra.value_omitted / key_omitted), or they stand "
                    "for an undecodable record batch (extra.record_batch)", skipped)
    if dry_run or not entries:
        return ReplayReport(len(matched), 0, request_topic, dry_run, skipped)
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap_servers, acks="all", linger_ms=5, **(security or {})
    )
    await start_or_close(producer)
    try:
        # One send at a time per partition keeps order; the futures resolve on acknowledgement.
        futures = [
            await producer.send(request_topic, e.letter.value, key=e.letter.key) for e in entries
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    log.info("replayed %d dead letters (%s) to %s", len(entries), where.describe(), request_topic)
    return ReplayReport(len(matched), len(entries), request_topic, dry_run, skipped)


# -- presentation -------------------------------------------------------------------------------

_COLUMNS = ("time", "device", "request_id", "reason", "stage", "message", "source")
_MAX = {"time": 24, "device": 20, "request_id": 28, "reason": 20, "stage": 10,
        "source": 36}


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _cell(value: str, width: int) -> str:
    value = value.replace("\n", " ")
    return value if len(value) <= width else value[: max(width - 1, 0)] + "…"


def _row(entry: DeadLetterEntry) -> dict[str, str]:
    letter = entry.letter
    source = letter.source or {}
    device = letter.device_id
    if device is None:
        device = "-" if letter.key is None else letter.key.decode("utf-8", "replace")
    return {
        "time": _iso(entry.failed_at),
        "device": device,
        "request_id": letter.request_id or "-",
        "reason": entry.reason,
        "stage": str(letter.error.get("stage", "")),
        "message": str(letter.error.get("message", "")),
        "source": f"{source.get('topic', '?')}[{source.get('partition', '?')}]"
        f"@{source.get('offset', '?')}",
    }


def format_entries(
    entries: Sequence[DeadLetterEntry],
    *,
    width: int | None = None,
    header: bool = True,
    fixed: bool = False,
) -> str:
    """An aligned text table: time (UTC), device, request_id, reason, stage, message, source.

    Args:
        entries: What to show, in order.
        width: Line width to fit (default: the terminal's); the message column takes what the
            other columns leave, at least 20 characters. Long cells end with "…".
        header: Start with the column names.
        fixed: Column widths from fixed caps instead of the data, so that tables printed one
            after the other (``tail --follow``) line up.

    Returns:
        The lines, no trailing newline; ``""`` when there is nothing to print.
    """
    rows = [_row(e) for e in entries]
    if not rows and not header:
        return ""
    widths = {
        c: _MAX.get(c, 24) if fixed else min(
            _MAX.get(c, 10**6), max(len(c), *(len(r[c]) for r in rows), 0)
        )
        for c in _COLUMNS
    }
    total = width or shutil.get_terminal_size((160, 24)).columns
    others = sum(w for c, w in widths.items() if c != "message") + 2 * (len(_COLUMNS) - 1)
    widths["message"] = max(20, total - others if fixed else min(widths["message"], total - others))
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in _COLUMNS).rstrip()] if header else []
    for row in rows:
        lines.append(
            "  ".join(_cell(row[c], widths[c]).ljust(widths[c]) for c in _COLUMNS).rstrip()
        )
    return "\n".join(lines)


def format_json_lines(entries: Iterable[DeadLetterEntry]) -> str:
    """One JSON object per entry and line (:meth:`DeadLetterEntry.to_dict`)."""
    return "\n".join(json.dumps(e.to_dict(), separators=(",", ":")) for e in entries)
