"""The tables' partition count against the request and retry topics' partition counts.

Faust tables are co-partitioned with the topics their rows come from: a device's rows live in
changelog partition *p* because its requests are read from request-topic partition *p*. Faust
checks that the counts agree on each table write (``PartitionsMismatch``) and its producer
asserts that the partition exists (``AssertionError('Unrecognized partition')``, which stops
the worker). So the counts must agree, and a worker has to notice when they stop agreeing:

* **At start** (:func:`plan_partitions`): the tables take the count of the request topic that
  exists (a gateway may have published first and the broker auto-created the topic with its
  default); the configured ``topic_partitions`` only sizes topics that do not exist yet. When
  existing changelogs have another count the worker refuses with one line naming both counts
  and ``streamapp tables rebuild``.
* **While starting** (:func:`wait_for_metadata`): Faust's consumer must know every changelog
  before a table write, or Faust reads it as 0 partitions and every write fails until the next
  metadata refresh (Apache Kafka, a fresh app id and a backlog: 13 of 24 starts on 2 cores).
* **While running** (:class:`PartitionCheck`): a topic that grew (Kafka's CreatePartitions) is
  seen within ``metadata_refresh_interval_s``, Faust's consumer refresh interval; from then on
  table updates are skipped (counted, one ERROR line), ``/ready`` answers 503 and
  ``streamapp_state_degraded`` is 1, until ``streamapp tables rebuild`` moved the tables to the
  new count (:mod:`streamapp.rebuild`) and the workers restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from streamapp.agents.observer import Outcome
from streamapp.batching import BatchInfo
from streamapp.exceptions import StreamAppError
from streamapp.settings import Settings

__all__ = [
    "RETRY_TABLE",
    "TABLE_NAMES",
    "GatedStateObserver",
    "PartitionCheck",
    "PartitionPlan",
    "TablePartitionsError",
    "changelog_topic",
    "plan_partitions",
    "rebuild_command",
    "wait_for_metadata",
]

log = logging.getLogger(__name__)

#: The attempt-counter table (keyed by request id, co-partitioned with the retry topic).
RETRY_TABLE = "retry_counts"
#: Every changelogged table of a worker: the device tables (co-partitioned with the request
#: topic) and the retry counters (with the retry topic).
TABLE_NAMES = ("device_stats", "device_windows", RETRY_TABLE)
#: Seconds a starting worker waits for its consumer to know every changelog topic.
METADATA_WAIT_S = 30.0


class TablePartitionsError(StreamAppError):
    """The tables' changelogs and the topics they are co-partitioned with disagree on the
    partition count (not retriable: stop the workers and run ``streamapp tables rebuild``)."""

    reason = "partitions_mismatch"


def changelog_topic(app_id: str, table: str) -> str:
    """Faust's name for a table's changelog topic: ``<app id>-<table>-changelog``."""
    return f"{app_id}-{table}-changelog"


def rebuild_command(settings: Settings, partitions: int | None = None) -> str:
    """The ``streamapp tables rebuild`` command line for this worker's broker and app."""
    parts = [f"streamapp tables rebuild --broker {settings.broker} --app-id {settings.app_id}"]
    if settings.topic_prefix:
        parts.append(f"--topic-prefix {settings.topic_prefix}")
    if partitions is not None:
        parts.append(f"--partitions {partitions}")
    return " ".join(parts)


@dataclass(frozen=True)
class PartitionPlan:
    """The partition count a worker runs with.

    Attributes:
        partitions: Of the request and retry topics and every table changelog.
        notes: WARNING lines to log (a configured count that an existing topic overrides).
    """

    partitions: int
    notes: list[str] = field(default_factory=list)


def plan_partitions(settings: Settings, existing: Mapping[str, int]) -> PartitionPlan:
    """Decide the worker's partition count from the topics that exist.

    The request topic's count wins (then the retry topic's, then the changelogs'); the
    configured ``topic_partitions`` is used only when none exists.

    Args:
        settings: ``topic_partitions``, the topic names and ``app_id``.
        existing: Topic name -> partition count of the topics on the broker.

    Returns:
        The count and the notes to log.

    Raises:
        TablePartitionsError: The request and retry topics, or a changelog and those topics,
            have different counts; the message names both counts and the command to run.
    """
    sources = {t: existing[t] for t in (settings.request_topic, settings.retry_topic)
               if t in existing}
    changelogs = {
        name: existing[name]
        for name in (changelog_topic(settings.app_id, t) for t in TABLE_NAMES) if name in existing
    }
    if len(set(sources.values())) > 1:
        (a, na), (b, nb) = sources.items()
        high = max(na, nb)
        raise TablePartitionsError(
            f"the request topic {a} has {na} partitions and the retry topic {b} has {nb}: they "
            f"must be equal (the tables are co-partitioned with both); stop the workers of group "
            f"{settings.app_id!r} and run `{rebuild_command(settings, high)}`"
        )
    counts = list(sources.values()) or list(changelogs.values())
    chosen = counts[0] if counts else settings.topic_partitions
    for name, n in changelogs.items():
        if n != chosen:
            source = next(iter(sources), settings.request_topic)
            raise TablePartitionsError(
                f"the topic {source} has {chosen} partitions but the table changelog {name} "
                f"has {n}: device state is kept for {n}; stop every worker of group "
                f"{settings.app_id!r} and run `{rebuild_command(settings)}` to move the tables "
                f"to {chosen} partitions (docs/tables.md)"
            )
    notes = []
    if chosen != settings.topic_partitions:
        which = next(iter(sources), None) or next(iter(changelogs))
        notes.append(
            f"topic_partitions={settings.topic_partitions} is not used: {which} already has "
            f"{chosen} partitions, so the tables use {chosen}; set "
            f"STREAMAPP_TOPIC_PARTITIONS={chosen} (or --topic-partitions {chosen}) to match "
            f"the topics and silence this warning, e.g. after `streamapp tables rebuild` (to "
            f"change the topics' count, see `streamapp tables rebuild` in docs/tables.md)"
        )
    return PartitionPlan(chosen, notes)


def _consumer_counts(app: Any, topics: Sequence[str]) -> dict[str, int | None]:
    """Partition counts Faust's consumer knows (its group coordinator's metadata snapshot, which
    Faust's table checks read); None for a topic it does not follow."""
    out: dict[str, int | None] = {}
    for topic in topics:
        n = None
        with contextlib.suppress(Exception):  # consumer not started yet
            n = app.consumer.topic_partitions(topic)
        out[topic] = n
    return out


async def refresh_consumer_metadata(app: Any) -> None:
    """Ask Faust's consumer (in its own thread) to refresh its metadata now: its group
    coordinator then sees new partitions and changelogs (and rebalances for them)."""
    thread = app.consumer._thread
    consumer = thread._ensure_consumer()

    async def refresh() -> None:
        await consumer._client.force_metadata_update()

    await thread.call_thread(refresh)


async def wait_for_metadata(
    app: Any, expected: Mapping[str, int], timeout_s: float = METADATA_WAIT_S,
    *, poll_s: float = 0.2,
) -> None:
    """Wait until Faust's consumer knows ``expected`` partition counts (the changelogs), forcing
    metadata refreshes meanwhile.

    Args:
        app: The worker's Faust app (started consumer).
        expected: Topic -> partition count.
        timeout_s: Seconds to wait at most.
        poll_s: Seconds between refreshes.

    Raises:
        TablePartitionsError: Not known after ``timeout_s``; the message names each topic, the
            count known and the count expected.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        known = _consumer_counts(app, list(expected))
        wrong = {t: n for t, n in known.items() if n is not None and n != expected[t]}
        if not wrong:
            return
        if time.monotonic() >= deadline:
            listed = ", ".join(f"{t} ({n} known, {expected[t]} expected)"
                               for t, n in wrong.items())
            raise TablePartitionsError(
                f"the worker's consumer still does not know the partitions of {listed} after "
                f"{timeout_s:.0f} s; check that the topics exist (kafka-topics --describe) and "
                "that the broker answers metadata requests"
            )
        with contextlib.suppress(Exception):
            await refresh_consumer_metadata(app)
        await asyncio.sleep(poll_s)


class PartitionCheck:
    """Whether the tables' partition count still matches the topics they are co-partitioned
    with, as Faust's consumer sees them (refreshed every ``metadata_refresh_interval_s``).

    Args:
        app: The worker's Faust app.
        settings: ``topic_partitions`` (the tables' count, from :func:`plan_partitions`), the
            topic names and the command to name.

    Attributes:
        skipped: Device flushes and retry-counter writes not done because the counts differ.
    """

    def __init__(self, app: Any, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.table_partitions = settings.topic_partitions
        self.sources = (settings.request_topic, settings.retry_topic)
        self.skipped = 0
        self._reported: dict[str, int] = {}

    def counts(self) -> dict[str, int | None]:
        """The request and retry topics' partition counts as the consumer knows them (None
        before it started)."""
        return _consumer_counts(self.app, self.sources)

    def mismatch(self) -> dict[str, int]:
        """Source topics whose partition count differs from the tables': topic -> count."""
        return {t: n for t, n in self.counts().items() if n and n != self.table_partitions}

    @property
    def degraded(self) -> bool:
        """True while device state cannot be kept; logs one ERROR line when that starts (and
        one INFO line when it ends)."""
        wrong = self.mismatch()
        if wrong and wrong != self._reported:
            topic, n = next(iter(wrong.items()))
            log.error(
                "%s now has %d partitions, the tables %d: device state is no longer updated "
                "(requests are still answered; /ready is 503). Stop every worker of group %r "
                "and run `%s`, then start them again (docs/tables.md)",
                topic, n, self.table_partitions, self.settings.app_id,
                rebuild_command(self.settings),
            )
        elif not wrong and self._reported:
            log.info("the topics have %d partitions again, like the tables: device state is "
                     "updated again", self.table_partitions)
        self._reported = wrong
        return bool(wrong)

    def gate(self) -> bool:
        """True when a table write may go ahead; else counts it as skipped."""
        if self.degraded:
            self.skipped += 1
            return False
        return True


class GatedStateObserver:
    """A state-writing pipeline observer whose flushes are skipped (and counted) while
    :class:`PartitionCheck` says the tables cannot be written (a write to a partition the
    changelog lacks would stop Faust's producer)."""

    writes_state = True

    def __init__(self, inner: Any, check: PartitionCheck) -> None:
        self.inner = inner
        self.check = check

    def on_outcome(self, outcome: Outcome) -> None:
        self.inner.on_outcome(outcome)

    def on_batch(self, model: str, info: BatchInfo) -> None:
        self.inner.on_batch(model, info)

    async def flush(self) -> None:
        if self.check.gate():
            await self.inner.flush()
        else:
            self.inner.discard_pending()
