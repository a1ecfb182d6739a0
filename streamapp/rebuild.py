"""``streamapp tables rebuild``: move the tables to the request topic's partition count.

A table row lives in the changelog partition its key's requests are read from, murmur2(key)
mod the partition count (Kafka's default partitioner, as producers key requests). When the
request topic grows from *n* to *m* partitions, a device's requests may move to another
partition while its rows stay where they were, so a worker refuses to start (or, running,
stops updating device state) until the tables are moved. This command, run with every worker of
the group stopped:

1. grows the retry topic and each changelog to *m* partitions (Kafka's CreatePartitions; the
   request topic too with ``--partitions``); Kafka cannot remove partitions, so a count below
   what a topic has is refused;
2. reads every changelog to its end and keeps each key's latest row (a row already in the
   key's new partition wins, so a rebuild that was interrupted can be run again);
3. writes each row whose partition changes to its new partition, waits for the broker's
   acknowledgements, then writes a tombstone for it in its old partition.

Rows are copied byte for byte (keys and values as the worker wrote them). Workers started
afterwards drop their local tables, kept for the old count, and restore them from the
changelogs (:func:`streamapp.datadir.check_data_dir`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.partitioner import DefaultPartitioner

from streamapp.exceptions import BrokerError
from streamapp.kafka import (
    add_partitions,
    cluster_facts,
    kafka_security_options,
    run_sync,
    start_or_close,
    with_admin,
)
from streamapp.partitions import TABLE_NAMES, TablePartitionsError, changelog_topic
from streamapp.settings import MAX_TOPIC_PARTITIONS, Settings
from streamapp.tables.base import split_bucket_key
from streamapp.tables.faust_tables import SEAL_KEY, WINDOWS_TABLE

__all__ = ["RebuildReport", "rebuild_tables"]

log = logging.getLogger(__name__)

_partitioner = DefaultPartitioner()
#: Seconds to wait for grown topics to show their new partitions in the metadata.
_GROW_WAIT_S = 30.0


@dataclass
class RebuildReport:
    """What a rebuild did.

    Attributes:
        partitions: The count the tables have now.
        grown: Topic -> (partitions before, after), of the topics that were grown.
        rows: Table name -> live rows read.
        moved: Table name -> rows moved to another partition.
    """

    partitions: int
    grown: dict[str, tuple[int, int]] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    moved: dict[str, int] = field(default_factory=dict)


def _owner_key(table: str) -> Callable[[bytes], bytes]:
    """The key whose partition a row of ``table`` lives in: a window bucket lives with its
    device (the bucket key starts with the device key), the other rows with their own key."""
    if table == WINDOWS_TABLE:
        return lambda key: split_bucket_key(key)[0]
    return lambda key: key


def _partition(key: bytes, n: int) -> int:
    every = list(range(n))
    return int(_partitioner(key, every, every))


def rebuild_tables(
    settings: Settings, partitions: int | None = None, *, timeout_s: float = 120.0
) -> RebuildReport:
    """Move the tables of ``settings.app_id`` to ``partitions`` partitions (default: the
    request topic's count). Run it with every worker of the group stopped.

    Args:
        settings: The broker, security settings, ``app_id`` and ``topic_prefix``.
        partitions: The count to move to; must not be below any topic's count.
        timeout_s: Seconds reading or writing one changelog may take.

    Returns:
        What was grown and moved.

    Raises:
        TablePartitionsError: The request topic or every changelog of the app does not exist,
            a topic has more partitions than asked for, ``partitions`` is above
            :data:`~streamapp.settings.MAX_TOPIC_PARTITIONS` (checked before the broker is
            asked anything), or workers of the group are still running.
        BrokerError: The broker refused to grow a topic or could not be reached.
    """
    if partitions is not None and partitions > MAX_TOPIC_PARTITIONS:
        # Kafka cannot remove partitions again, and the workers could not be started with
        # STREAMAPP_TOPIC_PARTITIONS set to this count (settings refuse it).
        raise TablePartitionsError(
            f"--partitions {partitions:,} is above {MAX_TOPIC_PARTITIONS:,}, the most "
            "STREAMAPP_TOPIC_PARTITIONS allows (the workers could not start with it, and Kafka "
            f"cannot remove partitions again); give at most {MAX_TOPIC_PARTITIONS:,}"
        )
    facts = cluster_facts(settings)
    have = facts.partitions
    request = have.get(settings.request_topic)
    if request is None:
        raise TablePartitionsError(
            f"the request topic {settings.request_topic} does not exist on "
            f"{settings.bootstrap_servers}: check --broker, --topic-prefix and --app-id"
        )
    target = partitions or request
    tables = {t: changelog_topic(settings.app_id, t) for t in TABLE_NAMES}
    if not any(topic in have for topic in tables.values()):
        raise TablePartitionsError(
            f"no changelog topic of app {settings.app_id!r} exists on "
            f"{settings.bootstrap_servers} (looked for {', '.join(sorted(tables.values()))}): "
            "nothing to rebuild; check --app-id (the workers' STREAMAPP_APP_ID) and --broker"
        )
    topics = [settings.request_topic, settings.retry_topic, *tables.values()]
    for topic in topics:
        if have.get(topic, 0) > target:
            raise TablePartitionsError(
                f"{topic} has {have[topic]} partitions, more than {target}: Kafka cannot remove "
                f"partitions; rebuild for {have[topic]} or more (--partitions)"
            )
    _require_no_members(settings)
    grow = {t: target for t in topics if t in have and have[t] < target}
    report = RebuildReport(target, grown={t: (have[t], target) for t in grow})
    if grow:
        add_partitions(settings, grow)
        _wait_grown(settings, grow)
    for table, topic in tables.items():
        if topic not in have:
            continue
        move = functools.partial(
            _move_rows, settings, topic, have[topic], target, _owner_key(table), timeout_s
        )
        rows, moved = run_sync(move)
        report.rows[table], report.moved[table] = rows, moved
        log.info("%s: %d rows, %d moved to their %d-partition place", table, rows, moved, target)
    return report


def _require_no_members(settings: Settings) -> None:
    """Refuse while the group has members (their tables would be written behind our back)."""

    async def members(admin: AIOKafkaAdminClient) -> int | None:
        described = await admin.describe_consumer_groups([settings.app_id])
        for response in described:
            for group in response.to_object().get("groups", []):
                if group.get("group") == settings.app_id:
                    return len(group.get("members") or [])
        return None

    try:
        n = run_sync(lambda: with_admin(settings, members))
    except (KafkaError, OSError, TimeoutError) as exc:  # not every broker describes groups
        log.warning("cannot tell whether workers of group %r run (%s); make sure none does",
                    settings.app_id, exc)
        return
    if n:
        raise TablePartitionsError(
            f"{n} worker(s) of group {settings.app_id!r} are still running: stop every worker "
            "of the group first (the tables must not change while they are moved)"
        )


def _wait_grown(settings: Settings, grow: dict[str, int]) -> None:
    deadline = time.monotonic() + _GROW_WAIT_S
    while True:
        have = cluster_facts(settings).partitions
        if all(have.get(t) == n for t, n in grow.items()):
            return
        if time.monotonic() > deadline:
            raise BrokerError(f"the grown topics {sorted(grow)} do not show their new partition "
                              f"counts after {_GROW_WAIT_S:.0f} s: run the command again")
        time.sleep(0.5)


async def _move_rows(
    settings: Settings, topic: str, old_n: int, new_n: int,
    owner: Callable[[bytes], bytes], timeout_s: float,
) -> tuple[int, int]:
    """Move the rows of one changelog; returns (live rows, rows moved)."""
    latest = await _read_changelog(settings, topic, new_n, timeout_s)
    live = moves = 0
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, acks="all",
                                linger_ms=5, **kafka_security_options(settings))
    await start_or_close(producer)
    try:
        copies, tombstones = [], []
        for key, by_partition in latest.items():
            home = _partition(owner(key), new_n)
            if home in by_partition:
                value = by_partition[home]
            else:
                old = _partition(owner(key), old_n)
                value = by_partition.get(old, next(iter(by_partition.values())))
                if value is not None:
                    copies.append(await producer.send(topic, value, key=key, partition=home))
            live += value is not None
            for partition, stale in by_partition.items():
                if partition != home and stale is not None:
                    tombstones.append((key, partition))
        await asyncio.gather(*copies)  # every row is in its new place before the old goes
        moves = len(copies)
        await asyncio.gather(*[
            await producer.send(topic, None, key=key, partition=partition)
            for key, partition in tombstones
        ])
    finally:
        await producer.stop()
    return live, moves


async def _read_changelog(
    settings: Settings, topic: str, partitions: int, timeout_s: float
) -> dict[bytes, dict[int, bytes | None]]:
    """Each key's latest value per partition (None: deleted), of every partition to its end."""
    consumer: Any = AIOKafkaConsumer(
        bootstrap_servers=settings.bootstrap_servers, group_id=None, enable_auto_commit=False,
        auto_offset_reset="earliest", isolation_level="read_committed",
        **kafka_security_options(settings),
    )
    await start_or_close(consumer)
    latest: dict[bytes, dict[int, bytes | None]] = {}
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        deadline = time.monotonic() + timeout_s
        while True:
            batch = await consumer.getmany(timeout_ms=300, max_records=10_000)
            for tp, records in batch.items():
                for record in records:
                    if record.key is None or record.key == SEAL_KEY:
                        continue
                    latest.setdefault(bytes(record.key), {})[tp.partition] = record.value
            # the fetch high watermark is right on the embedded broker too (docs/broker.md)
            positions = {tp: await consumer.position(tp) for tp in tps}
            if all(positions[tp] >= max(ends[tp], consumer.highwater(tp) or 0) for tp in tps):
                return latest
            if time.monotonic() > deadline:
                raise BrokerError(f"reading {topic} to its end took longer than {timeout_s} s; "
                                  "nothing was moved from it: run the command again")
    finally:
        await consumer.stop()
    return latest
