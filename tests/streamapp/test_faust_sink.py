"""``FaustSink.send_many`` against a real broker: each record lands in the partition aiokafka's
own ``send`` picks for its key, in the given order, with one acknowledgement per record batch."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import TopicPartition

from streamapp.broker import EmbeddedBroker
from streamapp.faust_compat import FaustSink
from streamapp.kafka import create_topics

pytestmark = [pytest.mark.kafka]


class _App:
    """The two attributes of a Faust app that ``send_many`` reads."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = self

        def ensure() -> AIOKafkaProducer:
            return producer

        self._ensure_producer = ensure


async def _read_all(bootstrap: str, topic: str, partitions: int, expected: int) -> dict[int, Any]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out: dict[int, list[tuple[bytes, bytes]]] = {}
        async with asyncio.timeout(30):
            while sum(map(len, out.values())) < expected:
                for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                    out.setdefault(tp.partition, []).extend((r.key, r.value) for r in records)
        return out
    finally:
        await consumer.stop()


async def test_send_many_keeps_the_partition_and_order_of_send(
    kafka_broker: EmbeddedBroker, app_id: str
) -> None:
    bootstrap, partitions = kafka_broker.bootstrap_servers, 4
    results, dlq = f"{app_id}.results", f"{app_id}.dlq"
    create_topics(bootstrap, {results: partitions, dlq: partitions})
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=1,
                                max_batch_size=1024)
    await producer.start()
    try:
        sink = FaustSink({}, _App(producer))
        records = [(results if i % 5 else dlq, f"dev-{i % 7}".encode(), f"v{i:04d}".encode() * 40)
                   for i in range(120)]
        handed = await sink.send_many(records)
        assert not [h for h in handed if isinstance(h, BaseException)]
        # 160-byte values in 1 kB batches: several record batches per partition
        assert 2 * partitions < len({id(h) for h in handed}) < len(records)
        await asyncio.wait_for(asyncio.gather(*{id(h): h for h in handed}.values()), 30)
    finally:
        await producer.stop()

    pick = DefaultPartitioner()
    for topic in (results, dlq):
        mine = [(k, v) for t, k, v in records if t == topic]
        stored = await _read_all(bootstrap, topic, partitions, len(mine))
        expected: dict[int, list[tuple[bytes, bytes]]] = {}
        for key, value in mine:
            partition = pick(key, list(range(partitions)), list(range(partitions)))
            expected.setdefault(partition, []).append((key, value))
        assert stored == expected


async def test_results_are_delivered_after_a_new_topic_joins_the_producers_metadata(
    kafka_broker: EmbeddedBroker, app_id: str
) -> None:
    # The result topic exists when the producer starts (it learns it from the all-topics
    # metadata answer). While a batch of results waits in the producer, a changelog topic that
    # did not exist is produced to, as Faust does for a table's first write. aiokafka then
    # refreshes only the topics it tracks: without track_metadata the result topic's partitions
    # are forgotten and the waiting batch never finds its leader (the sender asks for metadata
    # in a tight loop) until it expires.
    bootstrap = kafka_broker.bootstrap_servers
    results, changelog = f"{app_id}.results", f"{app_id}-device_stats-changelog"
    create_topics(bootstrap, {results: 2})
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=1_000,
                                request_timeout_ms=120_000)
    await producer.start()
    try:
        sink = FaustSink({results: None}, _App(producer))
        handed = await sink.send_many([(results, b"dev-1", b"result")])  # lingers 1 s
        create_topics(bootstrap, {changelog: 2})
        await asyncio.wait_for(producer.send_and_wait(changelog, b"row", key=b"dev-1"), 30)
        await asyncio.wait_for(asyncio.gather(*handed), 15)  # type: ignore[arg-type]
    finally:
        await producer.stop()
    stored = await _read_all(bootstrap, results, 2, 1)
    assert [v for records in stored.values() for _, v in records] == [b"result"]
