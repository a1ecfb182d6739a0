"""Noticing that the cluster under a running worker changed (a broker that came back empty).

Why acknowledgements can look good for records that no consumer will ever read (issue 18
item 4, measured with Tansu 0.6 and aiokafka 0.14): the embedded broker **acknowledges a
produce to a topic that does not exist, or to a partition beyond the topic's count**, with no
error and offset 0 (a 16-partition topic deleted, then records sent to its partitions 2 and
12: both acknowledged; ``list_topics`` empty; after a broker restart, a topic auto-created
with 4 partitions took an acknowledged record on partition 12, and fetching 12 returns
nothing). aiokafka trusts the acknowledgement and, having seen no error, never refreshes
its metadata, so it keeps producing to the old partitions. Apache Kafka refuses such produces
(``UNKNOWN_TOPIC_OR_PARTITION``), but a topic deleted and created again, or a new cluster
behind the same address, starts its offsets at 0 again just the same.

:class:`TopicWatch` is the pipeline's ack guard:

* :meth:`~TopicWatch.acknowledged` checks every acknowledgement: a partition whose offsets
  go back (offset ≤ one acknowledged before) lost its log;
* :meth:`~TopicWatch.confirm` runs before held acknowledgements are applied (once per state
  flush): a metadata request **without topic auto-creation** must find every topic of the
  worker with at least the partitions it had at the first check, every acknowledged partition
  among them, and the same cluster id;
* the first problem is logged as one CRITICAL line and the worker is stopped (``on_lost``);
  the records whose acknowledgement was not confirmed stay uncommitted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiokafka.protocol.metadata import MetadataRequest

__all__ = ["TopicWatch"]

log = logging.getLogger(__name__)


class TopicWatch:
    """Confirms that acknowledged outcomes are on partitions that exist (see the module
    docstring).

    Args:
        topics: The topics the worker reads and writes.
        client: Returns the aiokafka client to ask (the producer's, so the check goes where
            the records went).
        on_lost: Awaited once with the problem (one sentence) when the cluster changed.
        timeout_s: Seconds a metadata check may take; one that times out confirms nothing
            (acknowledgements stay held) and is not a problem by itself.

    Attributes:
        problem: The first problem found, or None.
    """

    def __init__(
        self, topics: Iterable[str], client: Callable[[], Any],
        on_lost: Callable[[str], Awaitable[Any]] | None = None, *, timeout_s: float = 5.0,
    ) -> None:
        self.topics = sorted(set(topics))
        self.client = client
        self.on_lost = on_lost
        self.timeout_s = timeout_s
        self.problem: str | None = None
        self.checks = 0
        self._cluster_id: str | None = None
        self._partitions: dict[str, int] = {}
        self._last_offset: dict[tuple[str, int], int] = {}
        self._lost_task: asyncio.Future[Any] | None = None

    def acknowledged(self, topic: str, partition: int, offset: int | None) -> bool:
        """Whether an acknowledgement of ``topic[partition]`` at ``offset`` (the first record's)
        may count; False (and the problem reported) when the partition's offsets went back."""
        if self.problem is not None:
            return False
        if offset is None or offset < 0:  # acks=0: nothing to compare
            return True
        key = (topic, partition)
        last = self._last_offset.get(key)
        if last is not None and offset <= last:
            self._lost(
                f"the broker acknowledged {topic}[{partition}] at offset {offset} after offset "
                f"{last}: the partition's log was lost (a broker that came back empty, or the "
                "topic deleted and created again)"
            )
            return False
        self._last_offset[key] = offset
        return True

    async def confirm(self) -> bool:
        """One metadata check (without auto-creation); True when every topic still has the
        partitions it had and the cluster id is the same.

        Returns:
            False when the cluster changed (reported) or the check did not get an answer.
        """
        if self.problem is not None:
            return False
        try:
            response = await asyncio.wait_for(self._metadata(), self.timeout_s)
        except Exception as exc:  # unreachable, timed out: confirms nothing, changes nothing
            log.debug("topic check without an answer: %s", exc)
            return False
        problem = self._compare(response)
        self.checks += 1
        if problem is not None:
            self._lost(problem)
            return False
        return True

    async def _metadata(self) -> Any:
        client = self.client()
        node = client.get_random_node()
        if node is None:
            raise ConnectionError("no broker known")
        return await client.send(node, MetadataRequest(self.topics, False))

    def _compare(self, response: Any) -> str | None:
        cluster_id = getattr(response, "cluster_id", None)
        if self._cluster_id is None:
            self._cluster_id = cluster_id
        elif cluster_id != self._cluster_id:
            return (f"the broker now belongs to cluster {cluster_id!r}, not {self._cluster_id!r}"
                    " (a new cluster behind the same address)")
        counts: dict[str, int] = {}
        for topic_data in response.topics:
            error_code, topic, partitions = topic_data[0], topic_data[1], topic_data[-1]
            counts[topic] = len(partitions) if error_code == 0 else 0
        first = not self._partitions
        for topic in self.topics:
            n = counts.get(topic, 0)
            if first:
                self._partitions[topic] = n
                continue
            had = self._partitions.get(topic, 0)
            if had and n == 0:
                return f"topic {topic} no longer exists (it had {had} partitions)"
            if n < had:
                return f"topic {topic} has {n} partitions, it had {had}"
        for topic, partition in self._last_offset:
            n = counts.get(topic, 0)
            if topic in counts and partition >= n:
                return (f"{topic}[{partition}] was acknowledged but the topic has {n} "
                        "partitions")
        return None

    def _lost(self, problem: str) -> None:
        if self.problem is not None:
            return
        self.problem = problem
        log.critical(
            "the cluster under this worker changed: %s; stopping, with nothing after this "
            "committed (create the topics again, or point the worker at its own cluster, and "
            "restart it)", problem,
        )
        if self.on_lost is not None:
            with_loop = asyncio.get_running_loop()
            self._lost_task = with_loop.create_task(_call(self.on_lost, problem))


async def _call(on_lost: Callable[[str], Awaitable[Any]], problem: str) -> None:
    await on_lost(problem)
