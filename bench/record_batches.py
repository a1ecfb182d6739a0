"""CPU per record of unpacking fetched record batches: ``python -m bench.record_batches``.

What a worker's consumer does with every fetched partition before a record reaches the agent:
aiokafka's ``PartitionRecords`` checks each batch's CRC-32C and parses its records, with
streamapp's guard installed (streamapp.record_batches). Measured twice in one run, with the
CRC computed by google-crc32c over the fetched buffer (the worker's default where its C
extension is installed) and by aiokafka's own table-driven C code, for each workload's request
size: digits (171 B, batches of 64 and of 1, as a backlog and a paced producer write them),
camera JPEGs (62 kB) and ResNet-50 float16 tensors (301 kB), both in batches of 4 (a 1 MiB
partition fetch holds 3 tensors). Prints µs per record and the ratio (aiokafka ÷ google-crc32c).
No broker: the batches are built in memory with aiokafka's own builder, as a producer would.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any
from uuid import uuid4

from aiokafka.consumer import fetcher
from aiokafka.consumer.fetcher import READ_UNCOMMITTED
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.structs import TopicPartition

from streamapp import record_batches

#: (name, request bytes, records per batch): the workloads of bench/workloads.py.
CASES: Sequence[tuple[str, int, int]] = (
    ("digits, batches of 64", 171, 64),
    ("digits, batches of 1", 171, 1),
    ("camera JPEG, batches of 4", 62_000, 4),
    ("ResNet-50 tensor, batches of 4", 301_173, 4),
)


def fetched_bytes(value_bytes: int, per_batch: int, total_bytes: int) -> tuple[bytes, int]:
    """One partition's fetched bytes: v2 batches of ``per_batch`` records of ``value_bytes``,
    about ``total_bytes`` in all; returns them and the record count."""
    value = os.urandom(value_bytes)
    out, offset = bytearray(), 0
    while len(out) < total_bytes:
        builder = DefaultRecordBatchBuilder(
            magic=2, compression_type=0, is_transactional=0, producer_id=-1, producer_epoch=-1,
            base_sequence=-1, batch_size=max(1 << 20, 2 * per_batch * value_bytes))
        for delta in range(per_batch):
            builder.append(delta, timestamp=1_700_000_000_000, key=b"cam-0001", value=value,
                           headers=[])
        batch = bytearray(builder.build())
        batch[0:8] = offset.to_bytes(8, "big", signed=True)
        out += batch
        offset += per_batch
    return bytes(out), offset


def unpack_us(topic: str, data: bytes, records: int, seconds: float) -> float:
    """CPU µs per record of unpacking ``data`` as aiokafka's fetcher does, CRCs checked."""
    tp = TopicPartition(topic, 0)
    rounds, start = 0, time.process_time()
    while True:
        unpacked: Any = fetcher.PartitionRecords(
            tp, fetcher.MemoryRecords(data), None, 0, None, None, True, READ_UNCOMMITTED)
        n = sum(1 for _ in unpacked)
        assert n == records, (n, records)
        rounds += 1
        spent = time.process_time() - start
        if spent >= seconds:
            return spent / (rounds * records) * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="CPU seconds per measurement")
    parser.add_argument("--fetch-bytes", type=int, default=4 << 20,
                        help="bytes of batches unpacked per round")
    args = parser.parse_args(argv)
    hardware = record_batches._crc32c
    if hardware is None:
        raise SystemExit("google-crc32c's C extension is not installed: nothing to compare")
    topic = f"bench-{uuid4().hex[:8]}"
    record_batches.guard_record_batches([topic])
    print(f"{'workload':<32} {'google-crc32c µs/rec':>21} {'aiokafka µs/rec':>16} {'ratio':>6}")
    for name, size, per_batch in CASES:
        data, records = fetched_bytes(size, per_batch, args.fetch_bytes)
        record_batches._crc32c = hardware
        ours = unpack_us(topic, data, records, args.seconds)
        record_batches._crc32c = None
        theirs = unpack_us(topic, data, records, args.seconds)
        record_batches._crc32c = hardware
        print(f"{name:<32} {ours:>21.2f} {theirs:>16.2f} {theirs / ours:>6.2f}")


if __name__ == "__main__":
    main()
