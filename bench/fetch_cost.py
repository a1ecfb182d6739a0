"""A plain aiokafka consumer's CPU per record on a paced stream, by fetch size:
``python -m bench.fetch_cost``.

Why a paced record costs a worker more than a backlogged one (issue 17, the p99 level): aiokafka
sends the next fetch for a broker only once the records of the last one were taken, and with
``fetch_min_bytes=1`` the broker answers as soon as one record is there, so at a few thousand
records/s over 32 partitions every fetch carries a few records, and a fetch costs the consumer
the same work (request and response for every partition, their parsing in Python, the
records' unpacking) whatever it carries. This measures it without Faust and without the
worker: one consumer assigned every partition of a fresh topic, reading what a separate sender
process writes at ``--rate``/s (171 B values, like a digits request, keyed by 256 devices,
``linger_ms`` 0), for each ``min_bytes:wait_ms`` variant. Fetches are counted by wrapping
aiokafka's ``Fetcher._proc_fetch_request`` (aiokafka 0.14); CPU is this process's over the
steady part of the run (the sender's is not counted). Starts its own Apache Kafka node unless
``--bootstrap`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from uuid import uuid4

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.consumer import fetcher

#: The sender: ``python -c SENDER bootstrap topic rate seconds``.
SENDER = r"""
import asyncio, os, sys, time
from aiokafka import AIOKafkaProducer
async def main(bootstrap, topic, rate, seconds):
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=0)
    await producer.start()
    value, n, start, i = os.urandom(171), int(rate * seconds), time.time(), 0
    while i < n:
        due = min(n, int((time.time() - start) * rate) + 1)
        while i < due:
            await producer.send(topic, value, key=f"device-{i % 256:03d}".encode())
            i += 1
        delay = start + i / rate - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
    await producer.flush()
    await producer.stop()
asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])))
"""


async def measure(bootstrap: str, partitions: int, rate: float, seconds: float,
                  min_bytes: int, wait_ms: int) -> dict[str, Any]:
    """One variant on a fresh topic: records/s, fetches/s, records per fetch, CPU µs per
    record and cores of the consumer, over the run less its first and last second."""
    from streamapp.kafka import create_topics

    topic = f"bench-fetch-{uuid4().hex[:8]}"
    create_topics(bootstrap, {topic: partitions})
    fetches = 0
    original = fetcher.Fetcher._proc_fetch_request

    async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal fetches
        fetches += 1
        return await original(self, *args, **kwargs)

    fetcher.Fetcher._proc_fetch_request = counted  # type: ignore[method-assign]
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                fetch_min_bytes=min_bytes, fetch_max_wait_ms=wait_ms)
    try:
        await consumer.start()
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        sender = subprocess.Popen(
            [sys.executable, "-c", SENDER, bootstrap, topic, str(rate), str(seconds)])
        records, mark = 0, None
        deadline = time.monotonic() + seconds + 30
        while time.monotonic() < deadline:
            got = await consumer.getmany(timeout_ms=100)
            n = sum(len(v) for v in got.values())
            records += n
            if mark is None and records >= rate:  # about a second of records: steady
                mark = (time.monotonic(), time.process_time(), fetches, records)
            if mark is not None and time.monotonic() - mark[0] >= seconds - 2:
                break
        sender.wait(timeout=60)
    finally:
        await consumer.stop()
        fetcher.Fetcher._proc_fetch_request = original  # type: ignore[method-assign]
    if mark is None:
        raise SystemExit(f"fewer than {rate:.0f} records arrived in {seconds + 30:.0f} s")
    wall, cpu = time.monotonic() - mark[0], time.process_time() - mark[1]
    n, f = records - mark[3], fetches - mark[2]
    return {"min_bytes": min_bytes, "wait_ms": wait_ms, "records_per_s": n / wall,
            "fetches_per_s": f / wall, "records_per_fetch": n / max(f, 1),
            "cpu_us_per_record": cpu / n * 1e6, "cores": cpu / wall}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2500.0, help="records/s sent")
    parser.add_argument("--seconds", type=float, default=12.0, help="per variant")
    parser.add_argument("--partitions", type=int, default=32)
    parser.add_argument("--variants", default="1:25,16384:3",
                        help="comma-separated min_bytes:wait_ms (the worker's default first)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds of all variants")
    parser.add_argument("--bootstrap", default=None, help="a running broker (else one is started)")
    args = parser.parse_args(argv)
    # aiokafka's WARNINGs while a fresh topic's leaders are elected would split the table
    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    variants = [tuple(int(x) for x in v.split(":")) for v in args.variants.split(",") if v]

    def run(bootstrap: str) -> None:
        print(f"sent at {args.rate:,.0f} records/s (171 B) over {args.partitions} partitions "
              f"(records/s: what arrived; a loaded machine's sender falls behind), "
              f"{args.seconds:g} s per variant, {args.repeat} round(s); one aiokafka consumer, "
              "CPU of this process")
        print(f"{'min_bytes':>9} {'wait_ms':>7} {'records/s':>9} {'fetches/s':>9} "
              f"{'rec/fetch':>9} {'µs/record':>9} {'cores':>5} {'÷ first':>7}")
        first: float | None = None
        for _ in range(args.repeat):
            for min_bytes, wait_ms in variants:
                r = asyncio.run(measure(bootstrap, args.partitions, args.rate, args.seconds,
                                        min_bytes, wait_ms))
                first = first or r["cpu_us_per_record"]
                print(f"{min_bytes:>9} {wait_ms:>7} {r['records_per_s']:>9,.0f} "
                      f"{r['fetches_per_s']:>9,.0f} {r['records_per_fetch']:>9.1f} "
                      f"{r['cpu_us_per_record']:>9.1f} {r['cores']:>5.2f} "
                      f"{r['cpu_us_per_record'] / first:>7.2f}", flush=True)

    if args.bootstrap:
        run(args.bootstrap)
        return
    from streamapp.kafka_server import KafkaBroker

    with tempfile.TemporaryDirectory() as tmp, KafkaBroker(data_dir=Path(tmp)) as kafka:
        run(kafka.bootstrap_servers)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
