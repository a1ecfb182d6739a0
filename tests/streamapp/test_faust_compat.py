"""FaustConsumer.settled: False while Faust may still hold fetched records; the producer buffer."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from faust.types import TP

from streamapp.faust_compat import (
    FaustConsumer,
    producer_buffer_stalled,
    set_producer_buffer_max,
)
from streamapp.settings import Settings

T = "requests"


class _Flow:
    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active


class _Consumer:
    async def position(self, tp: Any) -> int:
        return 42


def _app() -> Any:
    channel = SimpleNamespace(queue=asyncio.Queue())
    buffer = SimpleNamespace(size=0, max_messages=100)
    return SimpleNamespace(
        rebalancing=False, in_recovery=False, should_stop=False, flow_control=_Flow(),
        producer=SimpleNamespace(buffer=buffer), topics=SimpleNamespace(
            _topic_name_index={T: [channel]}), consumer=_Consumer(), channel=channel,
    )


async def test_settled_only_when_faust_holds_no_fetched_record() -> None:
    app = _app()
    consumer = FaustConsumer(app, Settings())
    assert consumer.settled(T) and await consumer.position(T, 0) == 42
    app.channel.queue.put_nowait("event")  # the agent has not taken it yet
    assert not consumer.settled(T)
    app.channel.queue.get_nowait()
    app.producer.buffer.size = 101  # the conductor waits for the producer buffer
    assert not consumer.settled(T)
    app.producer.buffer.size = 0
    app.producer.buffer.streamapp_flushing = 1  # ... and keeps waiting while it flushes
    assert not consumer.settled(T)
    app.producer.buffer.streamapp_flushing = 0
    app.flow_control.active = False  # rebalance: flow suspended
    assert not consumer.settled(T)
    app.flow_control.active = True
    app.in_recovery = True  # tables recovering: Faust seeks back to the committed offset
    assert not consumer.settled(T)


async def test_the_producer_buffer_limit_is_set_and_its_flushes_are_seen() -> None:
    app = _app()
    seen = []

    async def flush_atmost(n: int | None) -> int:
        seen.append((n, producer_buffer_stalled(app)))
        return 0

    app.producer.buffer.flush_atmost = flush_atmost
    assert set_producer_buffer_max(app, 2048)
    assert app.producer.buffer.max_messages == 2048
    assert not producer_buffer_stalled(app)
    await app.producer.buffer.flush_atmost(2048)  # as Faust's wait_until_ebb calls it
    assert seen == [(2048, True)] and not producer_buffer_stalled(app)
    assert not set_producer_buffer_max(SimpleNamespace(producer=None), 2048)


class _Coordinator:
    def __init__(self) -> None:
        self.rejoins = 0

    def request_rejoin(self) -> None:
        self.rejoins += 1


def _assignment_for(assignor: Any, url: str) -> Any:
    """The assignment a leader wrote for this member, naming ``url`` as its web URL."""
    from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
    from faust.assignor.client_assignment import ClientAssignment, ClientMetadata

    metadata = ClientMetadata(
        assignment=ClientAssignment(actives={"requests": [0, 1]}, standbys={}), url=url,
        changelog_distribution={}, external_topic_distribution={}, topic_groups={},
    )
    return ConsumerProtocolMemberAssignment(
        0, [("requests", [0, 1])], assignor._compress(metadata.dumps()))


def test_a_static_member_whose_url_changed_takes_its_partitions_and_rejoins() -> None:
    import faust

    from streamapp.faust_compat import tolerate_stale_member_url

    faust_app = faust.App("compat-test", broker="kafka://127.0.0.1:1", web_port=6100,
                          canonical_url="http://worker-a:6100")
    coordinator = _Coordinator()
    app = SimpleNamespace(assignor=faust_app.assignor, consumer=SimpleNamespace(
        _thread=SimpleNamespace(_consumer=SimpleNamespace(_coordinator=coordinator))))
    tolerate_stale_member_url(app)

    # the assignment of this member's previous incarnation, on another port
    app.assignor.on_assignment(_assignment_for(app.assignor, "http://worker-a:6099"))
    assert app.assignor.assigned_actives() == {TP("requests", 0), TP("requests", 1)}
    assert coordinator.rejoins == 1

    # the fresh assignment after the rejoin names the member's own URL: no further rejoin
    app.assignor.on_assignment(_assignment_for(app.assignor, "http://worker-a:6100"))
    assert coordinator.rejoins == 1


async def test_fetch_wait_and_min_bytes_reach_aiokafkas_fetcher() -> None:
    """``fetch_max_wait_ms`` and ``fetch_min_bytes`` are set on a real aiokafka fetcher (its
    ``_create_fetch_requests`` reads both from itself for every FetchRequest)."""
    from unittest.mock import MagicMock

    from aiokafka.consumer.fetcher import Fetcher
    from aiokafka.consumer.subscription_state import SubscriptionState

    from streamapp.faust_compat import set_fetch_max_wait

    client = MagicMock(_loop=asyncio.get_running_loop(), _metadata_max_age_ms=300_000)
    fetcher = Fetcher(client, SubscriptionState())
    try:
        app = SimpleNamespace(consumer=SimpleNamespace(
            _thread=SimpleNamespace(_consumer=SimpleNamespace(_fetcher=fetcher))))
        assert set_fetch_max_wait(app, 25.0, 16_384) is True
        assert (fetcher._fetch_max_wait_ms, fetcher._fetch_min_bytes) == (25, 16_384)
        assert set_fetch_max_wait(SimpleNamespace(consumer=SimpleNamespace()), 25.0) is False
    finally:
        await fetcher.close()
