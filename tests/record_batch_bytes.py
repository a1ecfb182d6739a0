"""Kafka v2 record batches as bytes, good and broken, for unit and integration tests.

Built with aiokafka's own ``DefaultRecordBatchBuilder`` (what its producer sends), so a good
batch is exactly what any producer writes; a broken one differs by one flipped byte.
"""

from __future__ import annotations

from aiokafka.record.default_records import DefaultRecordBatchBuilder

#: ``compression_type`` codes of the record batch attributes.
CODEC_IDS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}

#: Byte offset of the CRC in a v2 batch header (base offset 8, length 4, leader epoch 4, magic 1).
CRC_AT = 17


def batch_bytes(
    records: list[tuple[bytes | None, bytes | None]],
    *,
    base_offset: int = 0,
    codec: str = "none",
    timestamp_ms: int = 1_700_000_000_000,
) -> bytes:
    """One v2 record batch holding ``records`` (``(key, value)``), offsets
    ``base_offset .. base_offset + len(records) - 1``, compressed with ``codec``."""
    builder = DefaultRecordBatchBuilder(
        magic=2, compression_type=CODEC_IDS[codec], is_transactional=0, producer_id=-1,
        producer_epoch=-1, base_sequence=-1, batch_size=1 << 20,
    )
    for delta, (key, value) in enumerate(records):
        builder.append(delta, timestamp=timestamp_ms, key=key, value=value, headers=[])
    data = bytearray(builder.build())
    data[0:8] = base_offset.to_bytes(8, "big", signed=True)
    return bytes(data)


def with_bad_crc(batch: bytes) -> bytes:
    """``batch`` with its last byte flipped: the stored CRC no longer matches (a broker that
    validates batches refuses it; one that does not stores it)."""
    broken = bytearray(batch)
    broken[-1] ^= 0xFF
    return bytes(broken)
