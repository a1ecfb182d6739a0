"""The ack guard of a worker whose cluster changes under it (issue 18 item 4), with a fake
client answering metadata requests as a broker would."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from streamapp.topology import TopicWatch


@dataclass
class Metadata:
    cluster_id: str
    topics: list[tuple[Any, ...]]


@dataclass
class FakeClient:
    counts: dict[str, int]
    cluster_id: str = "c1"
    requests: list[Any] = field(default_factory=list)

    def get_random_node(self) -> int:
        return 1

    async def send(self, node: int, request: Any) -> Metadata:
        self.requests.append(request)
        return Metadata(self.cluster_id, [
            (0, t, False, list(range(n))) if n else (3, t, False, [])
            for t, n in self.counts.items()
        ])


def _watch(client: FakeClient, lost: list[str]) -> TopicWatch:
    async def on_lost(problem: str) -> None:
        lost.append(problem)
    return TopicWatch(["results", "requests"], lambda: client, on_lost)


@pytest.mark.parametrize(("change", "words"), [
    ({"results": 0}, "topic results no longer exists (it had 16 partitions)"),
    ({"results": 4}, "topic results has 4 partitions, it had 16"),
    ({"cluster_id": "c2"}, "cluster 'c2'"),
])
async def test_a_changed_cluster_refuses_the_held_acks_and_stops_the_worker_with_one_line(
    change: dict[str, Any], words: str, caplog: pytest.LogCaptureFixture
) -> None:
    client, lost = FakeClient({"results": 16, "requests": 16}), []
    watch = _watch(client, lost)
    assert await watch.confirm()
    assert watch.acknowledged("results", 12, 0) and watch.acknowledged("results", 12, 5)
    client.cluster_id = change.pop("cluster_id", client.cluster_id)
    client.counts.update(change)
    with caplog.at_level(logging.CRITICAL):
        assert not await watch.confirm()
        assert not await watch.confirm()
    assert not watch.acknowledged("results", 12, 9)
    await watch._lost_task  # type: ignore[misc]
    assert len(lost) == 1 and words in lost[0]
    assert len([r for r in caplog.records if r.levelno == logging.CRITICAL]) == 1
    assert all(r._allow_auto_topic_creation is False for r in client.requests)


async def test_offsets_that_go_back_on_a_partition_mean_its_log_was_lost() -> None:
    client, lost = FakeClient({"results": 4, "requests": 4}), []
    watch = _watch(client, lost)
    assert watch.acknowledged("results", 2, 57) and watch.acknowledged("results", 3, 0)
    assert not watch.acknowledged("results", 2, 0)
    await watch._lost_task  # type: ignore[misc]
    assert "results[2] at offset 0 after offset 57" in lost[0]


async def test_an_unreachable_broker_confirms_nothing_and_is_not_a_change() -> None:
    class Down(FakeClient):
        async def send(self, node: int, request: Any) -> Metadata:
            raise ConnectionError("refused")
    watch = _watch(Down({}), [])
    assert not await watch.confirm()
    assert watch.problem is None
