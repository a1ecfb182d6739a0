"""Dead-letter tooling: read, filter, show and replay the records of ``inference-dlq``.

Used by ``streamapp dlq tail`` and ``streamapp dlq replay``, and by tests. The topic is read with a
plain aiokafka consumer (no group, nothing committed) from the beginning up to its end *as of the
start of the read* (:class:`streamapp.tail.TopicReader`: the end is the fetch high watermark,
right on every broker, not Tansu's wrong ListOffsets answer).

A replay re-publishes each matching dead letter's *original* key and value, byte for byte, to the
request topic. The worker sees a brand-new request (attempt 0, no retry history), so a replay
should follow a fix of whatever made the requests fail; replaying twice sends them twice.

Not every dead letter holds a request (:func:`replay_record`): an ``invalid_retry_record``
letter holds the retry-topic record the worker could not use (a retry envelope keyed by
request_id), so the request it carries (its ``key`` and ``value`` fields) is re-created and
replayed when it can be read, and the letter is skipped otherwise; letters whose value was left
out, or that stand for an undecodable record batch, are skipped. Nothing but a request's own
key and value ever reaches the request topic.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import shutil
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.structs import ConsumerRecord

from streamapp.codecs import dead_letter_to_dict, decode_dead_letter
from streamapp.kafka import start_or_close
from streamapp.records import DeadLetter
from streamapp.tail import TopicReader, display_width, iso_utc, pad, parse_since

__all__ = [
    "NOT_KEPT",
    "RECORD_BATCH",
    "UNREADABLE_RETRY_RECORD",
    "DeadLetterEntry",
    "DeadLetterFilter",
    "DeadLetterReader",
    "ReplayRecord",
    "ReplayReport",
    "describe_causes",
    "format_entries",
    "format_json_lines",
    "letter_device",
    "letter_request_id",
    "parse_since",
    "read_dead_letters",
    "replay_dead_letters",
    "replay_record",
    "replayable",
]

log = logging.getLogger(__name__)

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
        device: The device the letter's request holds (:func:`letter_device`) equals this:
            its ``device_id``, or — for letters whose value could not be decoded — the record
            key (UTF-8), never the request_id that keys a retry record.
        since: Dead-lettered at or after this time (epoch s, :attr:`DeadLetterEntry.failed_at`).
        retry_topic: The retry topic (``settings.retry_topic``): letters read from it hold a
            retry record (:func:`letter_device`).
    """

    reason: str | None = None
    device: str | None = None
    since: float | None = None
    retry_topic: str | None = None

    def matches(self, entry: DeadLetterEntry) -> bool:
        if self.reason is not None and entry.reason != self.reason:
            return False
        if self.device is not None:
            if letter_device(entry.letter, retry_topic=self.retry_topic) != self.device:
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
            parts.append(f"since={iso_utc(self.since)}")
        return " ".join(parts) or "all"


class DeadLetterReader(TopicReader[DeadLetterEntry]):
    """Reads a DLQ topic from the beginning, with no consumer group (nothing is committed).

    Use as ``async with DeadLetterReader(...) as reader:`` then :meth:`read_to_end` and,
    optionally, :meth:`follow` (:class:`streamapp.tail.TopicReader`).

    ``topic`` is ``settings.dlq_topic``; ``skipped`` counts the records that were not dead
    letters streamapp wrote (not decodable): logged and left out.
    """

    def decode(
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


#: Why a matching dead letter is not replayed (the keys of :attr:`ReplayReport.not_replayed`).
NOT_KEPT = "original value or key not kept"
RECORD_BATCH = "an undecodable record batch, not a request"
UNREADABLE_RETRY_RECORD = "a retry-topic record whose original request cannot be read"

#: The reason of a dead letter that holds a retry-topic record as it was read (not a request).
_RETRY_RECORD_REASON = "invalid_retry_record"


@dataclass(frozen=True, slots=True)
class ReplayRecord:
    """What a replay sends to the request topic for one dead letter.

    Attributes:
        key / value: The original request record's key and value.
        recreated: They were read from the retry record the dead letter holds (an
            ``invalid_retry_record`` letter), not taken from the letter's own key and value.
    """

    key: bytes | None
    value: bytes
    recreated: bool = False


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What a replay did.

    Attributes:
        matched: Dead letters that matched the filter.
        replayed: Requests re-published (0 on a dry run).
        request_topic: Where they went.
        dry_run: Nothing was published.
        skipped: Matched dead letters that were not replayed because they hold no request
            (:func:`replay_record`): their original value or key was left out (too large to
            keep: ``extra.value_omitted`` / ``key_omitted``, e.g. ``unproducible_outcome``), they
            stand for an offset of a record batch the worker could not decode
            (``extra.record_batch``), or they hold a retry-topic record whose original request
            cannot be read (``invalid_retry_record``). Re-publishing them would send an empty
            value, a whole batch or a retry envelope as a request.
        recreated: Of the dead letters replayed (on a dry run: that would be), those whose
            request was re-created from the retry record they hold (``invalid_retry_record``).
        not_replayed: ``skipped`` by cause (:data:`NOT_KEPT`, :data:`RECORD_BATCH`,
            :data:`UNREADABLE_RETRY_RECORD`).
    """

    matched: int
    replayed: int
    request_topic: str
    dry_run: bool
    skipped: int = 0
    recreated: int = 0
    not_replayed: Mapping[str, int] = field(default_factory=dict)


def _holds_retry_record(letter: DeadLetter, retry_topic: str | None) -> bool:
    """Whether the letter's value is a record of the retry topic as it was read: the worker
    keeps the original request (and its source) of every retry record it decoded, so only a
    retry record it could not decode (``invalid_retry_record``) is dead-lettered as is."""
    if letter.error.get("reason") == _RETRY_RECORD_REASON:
        return True
    return retry_topic is not None and (letter.source or {}).get("topic") == retry_topic


def _json_object(value: bytes) -> dict[str, Any] | None:
    """``value`` as a JSON object (a retry record's encoding), or None when it is not one."""
    try:
        body = json.loads(value.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def _request_in_retry_record(value: bytes) -> tuple[bytes, bytes] | None:
    """The original request's ``(key, value)`` a retry record carries (base64 in its ``key``
    and ``value`` fields), or None when they cannot be read or cannot be a retried request: a
    request is retried only once decoded, so its key and value are not empty and the key is its
    ``device_id`` (the record's ``device_id`` field)."""
    body = _json_object(value)
    if body is None:
        return None
    key, original, device = body.get("key"), body.get("value"), body.get("device_id")
    if not (isinstance(key, str) and isinstance(original, str) and isinstance(device, str)):
        return None
    try:
        key_bytes = base64.b64decode(key, validate=True)
        value_bytes = base64.b64decode(original, validate=True)
    except (binascii.Error, ValueError):
        return None
    if not value_bytes or not key_bytes or key_bytes != device.encode("utf-8"):
        return None
    return key_bytes, value_bytes


def _device_in_retry_record(value: bytes) -> str | None:
    """The device of the request a retry record carries: its ``device_id`` field, else its
    ``key`` field (base64 of the request's key, which is the device_id in UTF-8), else None."""
    body = _json_object(value)
    if body is None:
        return None
    device, key = body.get("device_id"), body.get("key")
    if isinstance(device, str) and device:
        return device
    if not isinstance(key, str):
        return None
    try:
        return base64.b64decode(key, validate=True).decode("utf-8") or None
    except (binascii.Error, ValueError):  # UnicodeDecodeError is a ValueError
        return None


def letter_device(letter: DeadLetter, *, retry_topic: str | None = None) -> str | None:
    """The device whose request a dead letter holds, as ``dlq tail`` shows it and ``--device``
    matches it.

    Args:
        letter: A dead letter.
        retry_topic: The retry topic's name (see :func:`replay_record`).

    Returns:
        Its ``device_id``; else, for a letter that holds a retry record (whose key is the
        request_id, not the device), the device of the request that record carries, or None;
        else its key decoded as UTF-8 (requests are keyed by device_id), or None without one.
    """
    if letter.device_id is not None:
        return letter.device_id
    if _holds_retry_record(letter, retry_topic):
        return _device_in_retry_record(letter.value)
    return None if letter.key is None else letter.key.decode("utf-8", "replace")


def letter_request_id(letter: DeadLetter, *, retry_topic: str | None = None) -> str | None:
    """The request_id of a dead letter's request: its ``request_id``, else, for a letter that
    holds a retry record, that record's key (a retry record is keyed by request_id), else
    None."""
    if letter.request_id is not None:
        return letter.request_id
    if letter.key and _holds_retry_record(letter, retry_topic):
        return letter.key.decode("utf-8", "replace")
    return None


def replay_record(letter: DeadLetter, *, retry_topic: str | None = None) -> ReplayRecord | str:
    """What replaying ``letter`` sends to the request topic, or why nothing.

    Args:
        letter: A dead letter.
        retry_topic: The retry topic's name; a letter whose ``source`` is that topic holds a
            retry record as it was read (so does every ``invalid_retry_record`` letter).

    Returns:
        The original key and value, byte for byte: the letter's own, or, for a letter that holds
        a retry record, the request that record carries (``recreated``). Else why the letter
        cannot be replayed: :data:`RECORD_BATCH` (its value is a batch or empty),
        :data:`NOT_KEPT` (its value or key was left out), :data:`UNREADABLE_RETRY_RECORD` (a
        retry record whose ``key``/``value`` fields are not base64 of a non-empty request keyed
        by its ``device_id``).
    """
    extra = set(letter.extra or {})
    if "record_batch" in extra:
        return RECORD_BATCH
    if {"value_omitted", "key_omitted"} & extra:
        return NOT_KEPT
    if _holds_retry_record(letter, retry_topic):
        request = _request_in_retry_record(letter.value)
        if request is None:
            return UNREADABLE_RETRY_RECORD
        return ReplayRecord(*request, recreated=True)
    return ReplayRecord(letter.key, letter.value)


def replayable(letter: DeadLetter) -> bool:
    """Whether replaying a dead letter sends a request (:func:`replay_record`): never one whose
    original value or key was left out, nor one of an undecodable record batch (its value is
    the batch, or empty), nor a retry record whose original request cannot be read."""
    return isinstance(replay_record(letter), ReplayRecord)


async def replay_dead_letters(
    bootstrap_servers: str,
    dlq_topic: str,
    request_topic: str,
    *,
    where: DeadLetterFilter,
    dry_run: bool = False,
    security: Mapping[str, Any] | None = None,
    timeout_s: float = 30.0,
    retry_topic: str | None = None,
) -> ReplayReport:
    """Re-publish the original request of every matching dead letter to the request topic.

    The values are sent unchanged, so the worker treats each as a new request: attempt 0 and no
    retry history. Within a DLQ partition (so for each device) the original order is kept.
    Dead letters that hold no request are skipped and counted by cause; one that holds a retry
    record is replayed as the request that record carries (:func:`replay_record`).

    Args:
        where: Which dead letters; give at least a reason (the CLI requires one).
        dry_run: Count, publish nothing.
        retry_topic: The retry topic (``settings.retry_topic``): letters read from it hold
            retry records, not requests.

    Returns:
        The counts, after the broker acknowledged every record (``acks=all``).

    Raises:
        BrokerError: See :func:`read_dead_letters`.
    """
    matched = await read_dead_letters(
        bootstrap_servers, dlq_topic, where=where, security=security, timeout_s=timeout_s
    )
    plans = [replay_record(e.letter, retry_topic=retry_topic) for e in matched]
    records = [plan for plan in plans if isinstance(plan, ReplayRecord)]
    not_replayed = dict(Counter(plan for plan in plans if isinstance(plan, str)))
    skipped = len(matched) - len(records)
    recreated = sum(r.recreated for r in records)
    if skipped:  # INFO: the report has the counts, and `dlq replay` prints them once
        log.info("%d matching dead letters are not replayed: they hold no request (%s)",
                 skipped, describe_causes(not_replayed))
    if dry_run or not records:
        return ReplayReport(len(matched), 0, request_topic, dry_run, skipped, recreated,
                            not_replayed)
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap_servers, acks="all", linger_ms=5, **(security or {})
    )
    await start_or_close(producer)
    try:
        # One send at a time per partition keeps order; the futures resolve on acknowledgement.
        futures = [await producer.send(request_topic, r.value, key=r.key) for r in records]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    log.info("replayed %d dead letters (%s) to %s", len(records), where.describe(), request_topic)
    return ReplayReport(len(matched), len(records), request_topic, dry_run, skipped, recreated,
                        not_replayed)


def describe_causes(not_replayed: Mapping[str, int]) -> str:
    """``cause: count, ...`` of :attr:`ReplayReport.not_replayed`, most frequent first."""
    return ", ".join(f"{cause}: {count}" for cause, count in
                     sorted(not_replayed.items(), key=lambda item: (-item[1], item[0])))


# -- presentation -------------------------------------------------------------------------------

_COLUMNS = ("time", "device", "request_id", "reason", "stage", "message", "source")
_MAX = {"time": 24, "device": 20, "request_id": 28, "reason": 20, "stage": 10,
        "source": 36}
#: Narrowest each column is cut to before columns are left out to fit the width.
_MIN = {"time": 24, "device": 8, "request_id": 10, "reason": 12, "stage": 8, "message": 16,
        "source": 16}
#: Left out in this order when even the narrowest columns do not fit (``--json`` has them).
_DROP = ("stage", "source")


def _fit(widths: dict[str, int], total: int) -> dict[str, int]:
    """Column widths whose line (two-space gaps) is at most ``total`` columns: the widest
    column above its :data:`_MIN` is narrowed first; while even the minimums are too wide,
    the columns of :data:`_DROP` are left out."""
    widths = dict(widths)
    for column in _DROP:
        if sum(min(w, _MIN[c]) for c, w in widths.items()) + 2 * (len(widths) - 1) <= total:
            break
        del widths[column]
    while sum(widths.values()) + 2 * (len(widths) - 1) > total:
        column = max(widths, key=lambda c: widths[c] - _MIN[c])
        if widths[column] <= _MIN[column]:
            break
        widths[column] -= 1
    return widths


def _row(entry: DeadLetterEntry, retry_topic: str | None) -> dict[str, str]:
    letter = entry.letter
    source = letter.source or {}
    return {
        "time": iso_utc(entry.failed_at),
        "device": letter_device(letter, retry_topic=retry_topic) or "-",
        "request_id": letter_request_id(letter, retry_topic=retry_topic) or "-",
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
    retry_topic: str | None = None,
) -> str:
    """An aligned text table: time (UTC), device, request_id, reason, stage, message, source.

    The device is the one the letter's request holds (:func:`letter_device`; ``-`` when it
    cannot be read), never the request_id that keys a retry record.

    Args:
        entries: What to show, in order.
        width: Terminal width (default: the terminal's); lines are at most one column
            narrower, so that none wraps. The message column takes what the other columns
            leave; where that is too little, the widest columns are cut (cells end with "…")
            and then stage and source are left out (80 columns: time, device, request_id,
            reason, message). Widths are terminal columns: CJK characters count 2.
        header: Start with the column names.
        fixed: Column widths from fixed caps instead of the data, so that tables printed one
            after the other (``tail --follow``) line up.
        retry_topic: The retry topic (``settings.retry_topic``): letters read from it hold a
            retry record (every ``invalid_retry_record`` letter does).

    Returns:
        The lines, no trailing newline; ``""`` when there is nothing to print.
    """
    rows = [_row(e, retry_topic) for e in entries]
    if not rows and not header:
        return ""
    widths = {
        c: _MAX.get(c, 24) if fixed else min(
            _MAX.get(c, 10**6), max(len(c), *(display_width(r[c]) for r in rows), 0)
        )
        for c in _COLUMNS
    }
    total = (width or shutil.get_terminal_size((160, 24)).columns) - 1  # no wrap in the last
    others = sum(w for c, w in widths.items() if c != "message") + 2 * (len(_COLUMNS) - 1)
    if fixed:
        widths["message"] = max(_MIN["message"], total - others)
    else:
        widths["message"] = max(_MIN["message"], min(widths["message"], total - others))
    widths = _fit(widths, total)
    lines = ["  ".join(pad(c.upper(), w) for c, w in widths.items()).rstrip()] if header else []
    for row in rows:
        lines.append("  ".join(pad(row[c], w) for c, w in widths.items()).rstrip())
    return "\n".join(lines)


def format_json_lines(entries: Iterable[DeadLetterEntry]) -> str:
    """One JSON object per entry and line (:meth:`DeadLetterEntry.to_dict`)."""
    return "\n".join(json.dumps(e.to_dict(), separators=(",", ":")) for e in entries)
