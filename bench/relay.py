"""A plain aiokafka client that forwards ``source`` to ``sink``: the transport's per-record cost
without Faust (a ceiling for the scale-out, and the round trip of the latency budget).

Run as a child process by the benchmark: ``python -m bench.relay BOOTSTRAP SOURCE SINK GROUP
[MAX_REQUEST_BYTES [RESULT_BYTES]]``. N of them with the same ``GROUP`` share the partitions of
``source`` as N workers would. Each record read is sent to ``sink`` with its key and value
(``acks=all``, as the worker's producer) — or, with ``RESULT_BYTES`` > 0, with a value of that
many bytes in place of its own: the transport a worker needs where its results are much smaller
than its requests (a 62 kB camera frame in, a result of about 500 B out). Offsets are
auto-committed (a ceiling needs no delivery guarantee). SIGTERM stops it after flushing what
was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer


async def relay(bootstrap: str, source: str, sink: str, group: str,
                max_request_bytes: int = 1 << 20, result_bytes: int = 0) -> int:
    """Forward until SIGTERM/SIGINT; returns the number of records forwarded (each with
    ``result_bytes`` zero bytes as its value when > 0, else its own value)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    consumer = AIOKafkaConsumer(
        source, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=True,
        auto_offset_reset="earliest", fetch_max_wait_ms=25,
        max_partition_fetch_bytes=max(1 << 20, 2 * max_request_bytes),
        session_timeout_ms=10_000, heartbeat_interval_ms=1_000,
    )
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=1,
        max_batch_size=max(1 << 16, max_request_bytes // 2), max_request_size=max_request_bytes,
    )
    await producer.start()
    await consumer.start()
    forwarded = 0
    result = bytes(result_bytes) if result_bytes > 0 else None
    try:
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=100, max_records=2_000)
            for records in batches.values():
                for record in records:
                    # Not awaiting the delivery future: the producer batches, and blocks here
                    # only when its buffer is full (backpressure).
                    await producer.send(sink, record.value if result is None else result,
                                        key=record.key)
                    forwarded += 1
    finally:
        with contextlib.suppress(Exception):
            await producer.flush()
        await consumer.stop()
        await producer.stop()
    return forwarded


def main(argv: list[str]) -> int:
    if len(argv) not in (4, 5, 6):
        print(__doc__, file=sys.stderr)
        return 2
    bootstrap, source, sink, group = argv[:4]
    max_request = int(argv[4]) if len(argv) >= 5 else 1 << 20
    result_bytes = int(argv[5]) if len(argv) == 6 else 0
    asyncio.run(relay(bootstrap, source, sink, group, max_request, result_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
