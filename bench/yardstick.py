"""The best Faust agent we know of: batches in, one produce call per partition out (issue 17).

Run as a child process by ``python -m bench hotpath`` (``python -m bench.yardstick``),
configured through the worker's ``STREAMAPP_*`` variables (broker, app id, data directory,
web port, partitions) and ``BENCH_YS_*`` ones:

* ``BENCH_YS_SOURCE`` / ``BENCH_YS_SINK``: the topics read and written (raw bytes);
* ``BENCH_YS_MAX_BATCH`` (records) and ``BENCH_YS_WITHIN_MS`` (milliseconds): the arguments of
  ``stream.take_events(max_, within)``;
* ``BENCH_YS_UVLOOP=1``: run on uvloop's event loop.

The Faust app has the worker's options (:func:`streamapp.app.faust_options`) plus the knobs
shared/BROKER.md measured to matter: ``producer_linger_ms=5``, ``broker_max_poll_records=5000``
and ``consumer_max_fetch_size`` 4 MiB. Per batch of events the agent groups the records by
output partition (murmur2 of the key, as aiokafka's ``DefaultPartitioner`` over the sink's
partition count), appends them to ``create_batch()`` batches of Faust's own aiokafka producer,
closes each (complete: no linger) and hands it to ``send_batch(batch, sink, partition=p)``, and
waits for every broker acknowledgement before it asks for the next batch; ``take_events``
acknowledges the batch's events (their offsets become committable) only then. Records of one
key keep their order (one key, one partition, appended in order, batches acknowledged before
the next is taken) and nothing is committed before it was written: per-key order and
at-least-once, as the worker.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

import faust
from aiokafka.partitioner import DefaultPartitioner

from streamapp.app import faust_options
from streamapp.faust_compat import set_fetch_max_wait
from streamapp.settings import load_settings

__all__ = ["TUNED_OPTIONS", "create_app", "main"]

#: Faust options beyond the worker's that shared/BROKER.md measured to matter on Apache Kafka
#: (178 instead of 280 µs per record for a forwarder): linger 5 ms, 5,000 records per poll,
#: a 4 MiB fetch. Leaving either of the first two at Faust's default undid the gain.
TUNED_OPTIONS: dict[str, Any] = {
    "producer_linger_ms": 5,
    "broker_max_poll_records": 5000,
    "consumer_max_fetch_size": 4 * 1024 * 1024,
}


class _PartitionOf:
    """Key → partition of ``sink`` as aiokafka's ``DefaultPartitioner`` would pick it
    (murmur2 of the key bytes), memoised per key: devices repeat, murmur2 in pure Python costs
    microseconds."""

    def __init__(self, partitions: Sequence[int]) -> None:
        self.partitions = sorted(partitions)
        self._pick = DefaultPartitioner()
        self._cache: dict[bytes, int] = {}

    def __call__(self, key: bytes) -> int:
        partition = self._cache.get(key)
        if partition is None:
            partition = self._cache[key] = self._pick(key, self.partitions, self.partitions)
        return partition


def create_app() -> faust.App:
    settings = load_settings()
    app = faust.App(settings.app_id, **{**faust_options(settings), **TUNED_OPTIONS})
    raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw",
           "value_serializer": "raw"}
    source = app.topic(os.environ["BENCH_YS_SOURCE"], partitions=settings.topic_partitions,
                       **raw)
    sink = os.environ["BENCH_YS_SINK"]
    max_batch = int(os.environ.get("BENCH_YS_MAX_BATCH", "64"))
    within_s = float(os.environ.get("BENCH_YS_WITHIN_MS", "5")) / 1000.0

    @app.agent(source, name="yardstick")
    async def yardstick(stream: faust.StreamT[bytes]) -> None:
        # Faust's own aiokafka producer (faust/transport/drivers/aiokafka.py: Producer keeps
        # the aiokafka.AIOKafkaProducer it started in _producer; _ensure_producer returns it).
        producer = app.producer._ensure_producer()  # type: ignore[attr-defined]
        partition_of = _PartitionOf(await producer.partitions_for(sink))
        loop = type(asyncio.get_running_loop())
        print(f"yardstick: take_events({max_batch}, {within_s * 1000:g} ms) on "
              f"{loop.__module__}.{loop.__qualname__}, {sink} has "
              f"{len(partition_of.partitions)} partitions", flush=True)
        async for events in stream.noack().take_events(max_batch, within_s):
            by_partition: dict[int, list[Any]] = {}
            for event in events:
                by_partition.setdefault(partition_of(event.key), []).append(event)
            acks = []
            for partition, part in by_partition.items():
                batch = producer.create_batch()
                for event in part:
                    if batch.append(key=event.key, value=event.value, timestamp=None) is None:
                        # Full (it closed itself): send what it holds, start another one.
                        acks.append(await producer.send_batch(batch, sink, partition=partition))
                        batch = producer.create_batch()
                        batch.append(key=event.key, value=event.value, timestamp=None)
                # Closed: complete, so the sender takes it at once instead of letting it
                # linger for records that will not come (aiokafka's MessageBatch.
                # remaining_linger is 0 for a closed builder).
                batch.close()
                acks.append(await producer.send_batch(batch, sink, partition=partition))
            # Every record of the batch is on the broker before take_events acks the events.
            await asyncio.gather(*acks)

    @app.on_partitions_assigned.connect  # type: ignore[arg-type]
    async def on_assigned(app_: Any, assigned: set[Any], **kwargs: Any) -> None:
        # The same fetch wait as the worker (Faust fixes 1500 ms; see settings.fetch_max_wait_ms).
        set_fetch_max_wait(app, settings.fetch_max_wait_ms)

    return app


def main() -> None:
    if os.environ.get("BENCH_YS_UVLOOP") == "1":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    faust.Worker(create_app(), loglevel="warning").execute_from_commandline()


if __name__ == "__main__":
    main()
