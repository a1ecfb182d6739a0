"""Tests for the embedded Tansu broker (:mod:`streamapp.broker`)."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.structs import TopicPartition

import streamapp.broker as broker_module
from streamapp.broker import EmbeddedBroker
from streamapp.exceptions import BrokerError
from streamapp.kafka import create_topics

pytestmark = pytest.mark.kafka


async def _partition_counts(bootstrap_servers: str, topics: list[str]) -> dict[str, int]:
    """Partition count per topic as the broker's metadata reports it (topics must exist)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers)
    await admin.start()
    try:
        described = await admin.describe_topics(topics)
    finally:
        await admin.close()
    return {entry["topic"]: len(entry["partitions"]) for entry in described}


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def listening_socket() -> Iterator[socket.socket]:
    """A plain TCP listener on a random loopback port (not a Kafka broker)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


async def test_produce_consume_round_trip(kafka_broker: EmbeddedBroker, app_id: str) -> None:
    topic = f"{app_id}-roundtrip"
    assert create_topics(kafka_broker.bootstrap_servers, {topic: 1}) == [topic]

    producer = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap_servers)
    await producer.start()
    try:
        sent = await producer.send_and_wait(topic, b"hello tansu", key=b"device-1")
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka_broker.bootstrap_servers,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        record = await asyncio.wait_for(consumer.getone(), timeout=15)
    finally:
        await consumer.stop()

    assert (record.key, record.value) == (b"device-1", b"hello tansu")
    assert record.offset == sent.offset == 0


async def test_create_topics_sets_partitions_and_skips_existing(
    kafka_broker: EmbeddedBroker, app_id: str
) -> None:
    wanted = {f"{app_id}-events": 4, f"{app_id}-small": 2}

    first = create_topics(kafka_broker.bootstrap_servers, wanted)
    second = create_topics(kafka_broker.bootstrap_servers, wanted)

    assert first == list(wanted)
    assert second == []
    assert await _partition_counts(kafka_broker.bootstrap_servers, list(wanted)) == wanted


def test_create_topics_unreachable_broker_raises() -> None:
    # Nothing answers Kafka requests on a closed port.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]

    with pytest.raises(BrokerError, match=f"127.0.0.1:{closed_port}"):
        create_topics(f"127.0.0.1:{closed_port}", {"never": 1}, timeout_s=3.0)


async def test_tansu_auto_creates_topics_on_metadata_request(
    embedded_broker: EmbeddedBroker, app_id: str
) -> None:
    """Pins a Tansu behaviour the app must design around (see streamapp.broker docstring)."""
    asked_without, asked_with = f"{app_id}-no-auto", f"{app_id}-auto"
    client = AIOKafkaClient(bootstrap_servers=embedded_broker.bootstrap_servers)
    await client.bootstrap()
    try:
        node = client.get_random_node()
        refused = await client.send(node, MetadataRequest([asked_without], False))
        created = await client.send(node, MetadataRequest([asked_with], True))
    finally:
        await client.close()

    assert [(t["topic"], t["error_code"]) for t in refused.to_object()["topics"]] == [
        (asked_without, 3)  # UNKNOWN_TOPIC_OR_PARTITION: not created
    ]
    assert [
        (t["topic"], t["error_code"], len(t["partitions"])) for t in created.to_object()["topics"]
    ] == [(asked_with, 0, 4)]
    # The auto-created topic now exists, so create_topics leaves it (and its 4 partitions) alone.
    assert create_topics(embedded_broker.bootstrap_servers, {asked_with: 1}) == []


def test_busy_port_fails_with_clear_error(embedded_broker: EmbeddedBroker) -> None:
    busy_port = embedded_broker.port

    with pytest.raises(BrokerError, match=rf"port {busy_port} .*already in use"):
        EmbeddedBroker(port=busy_port).start()

    assert embedded_broker.is_running()


def test_stop_kills_process_and_is_idempotent() -> None:
    broker = EmbeddedBroker().start()
    pid, port = broker.pid, broker.port
    assert pid is not None and _pid_exists(pid)
    assert broker.startup_s is not None and broker.startup_s < 20.0

    broker.stop()
    broker.stop()

    assert not broker.is_running()
    assert not _pid_exists(pid)
    # The port is released: a new broker can take it.
    with EmbeddedBroker(port=port) as again:
        assert again.bootstrap_servers == f"127.0.0.1:{port}"
        assert create_topics(again.bootstrap_servers, {"after-restart": 1}) == ["after-restart"]


def test_stop_before_start_is_a_no_op() -> None:
    broker = EmbeddedBroker()
    broker.stop()
    assert broker.pid is None and not broker.is_running()


def test_start_retries_when_picked_port_is_taken(
    listening_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process grabbing the picked port before Tansu binds it makes Tansu panic yet exit
    with status 0; the broker must notice and move to another port."""
    busy_port = listening_socket.getsockname()[1]
    real_pick = broker_module.free_port
    picks: list[int] = []

    def pick_busy_first(host: str) -> int:
        port = busy_port if not picks else real_pick(host)
        picks.append(port)
        return port

    monkeypatch.setattr(broker_module, "free_port", pick_busy_first)

    with EmbeddedBroker() as broker:
        assert picks[0] == busy_port
        assert broker.port == picks[-1] != busy_port
        assert create_topics(broker.bootstrap_servers, {"served": 3}) == ["served"]
        assert broker.log_path is not None
        assert "AddrInUse" in broker.log_path.read_text()


async def test_sync_api_works_inside_running_event_loop(kafka_broker: EmbeddedBroker) -> None:
    # create_topics is synchronous; called from a coroutine it must not touch the running loop.
    topic = f"loop-safe-{id(asyncio.get_running_loop())}"
    assert create_topics(kafka_broker.bootstrap_servers, {topic: 2}) == [topic]
    assert await _partition_counts(kafka_broker.bootstrap_servers, [topic]) == {topic: 2}
