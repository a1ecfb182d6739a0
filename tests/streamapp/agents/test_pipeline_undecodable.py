"""Records of a batch the consumer could not decode, through the pipeline: crafted batch bytes are
unpacked by aiokafka's fetcher code with the guard installed (streamapp.record_batches), and the
records it hands out go to the pipeline as the request agent hands them. Each offset of the bad
batch becomes one ``undecodable_record_batch`` dead letter in read order between the answers of
its neighbours, and every offset is acknowledged (so the committed offset passes the batch)."""

from __future__ import annotations

import hashlib
from typing import Any
from uuid import uuid4

import numpy as np
import pytest
from aiokafka.consumer import fetcher
from aiokafka.consumer.fetcher import READ_UNCOMMITTED
from aiokafka.structs import TopicPartition

from engines.executor import ThreadExecutor
from engines.testing import FakeEngine
from streamapp.agents.pipeline import SourceMessage
from streamapp.dlq import replayable
from streamapp.exceptions import InvalidRequestError
from streamapp.metrics import Metrics
from streamapp.record_batches import guard_record_batches
from tests.record_batch_bytes import batch_bytes, with_bad_crc
from tests.streamapp.agents import test_pipeline as base
from tests.streamapp.agents.test_pipeline import (
    FakeSink,
    StartPipeline,
    dead_letters_of,
    request_value,
    results_of,
    wait_for,
)

# The fixtures of the pipeline's own tests: a started pipeline serving the digits contract,
# and the digit images.
start_pipeline = base.start_pipeline
digits_config = base.digits_config
images = base.images


class Feed:
    """Unpacks fetched bytes of partition 0 of a fresh guarded topic into source messages."""

    def __init__(self) -> None:
        self.topic = f"requests-{uuid4().hex[:8]}"
        guard_record_batches([self.topic])
        self.acked: list[int] = []

    def messages(self, data: bytes) -> list[SourceMessage]:
        unpacked = fetcher.PartitionRecords(
            TopicPartition(self.topic, 0), fetcher.MemoryRecords(data), None, 0, None, None,
            True, READ_UNCOMMITTED,
        )
        return [
            SourceMessage(r.key, r.value, self.topic, 0, r.offset,
                          ack=lambda o=r.offset: self.acked.append(o))
            for r in unpacked
        ]


def requests(
    pixels: np.ndarray, first_seq: int, n: int
) -> list[tuple[bytes | None, bytes | None]]:
    """``n`` JSON requests of device ``dev-a`` (seq ``first_seq``...), as ``(key, value)``."""
    return [(b"dev-a", request_value(pixels[seq], "dev-a", seq))
            for seq in range(first_seq, first_seq + n)]


async def test_each_offset_of_a_corrupt_batch_becomes_a_dead_letter_between_the_answers(
    start_pipeline: StartPipeline, images: np.ndarray
) -> None:
    feed, sink = Feed(), FakeSink()
    metrics = Metrics(["digits"], max_batch_size=4, process_metrics=False)
    pipeline = await start_pipeline(ThreadExecutor(FakeEngine()), sink, observers=[metrics])
    bad = with_bad_crc(batch_bytes(requests(images, 2, 3), base_offset=2))
    data = (batch_bytes(requests(images, 0, 2)) + bad
            + batch_bytes(requests(images, 5, 1), base_offset=5))
    for message in feed.messages(data):
        await pipeline.handle(message)

    await wait_for(lambda: len(feed.acked) == 6)

    assert sorted(feed.acked) == [0, 1, 2, 3, 4, 5]  # every offset finished: commits go on
    assert [s.topic for s in sink.sent] == [
        "inference-result", "inference-result",
        "inference-dlq", "inference-dlq", "inference-dlq",
        "inference-result",
    ]
    assert [r["seq"] for r in results_of(sink, pipeline)] == [0, 1, 5]
    letters = dead_letters_of(sink, pipeline)
    assert [d.source for d in letters] == [
        {"topic": feed.topic, "partition": 0, "offset": o} for o in (2, 3, 4)
    ]
    for letter in letters:
        assert letter.error["reason"] == "undecodable_record_batch"
        assert letter.error["stage"] == "consume"
        assert letter.error["type"] == "CorruptRecordException"
        assert f"{feed.topic}[0]@2..4" in letter.error["message"]
        assert (letter.key, letter.request_id, letter.device_id) == (None, None, None)
        assert letter.extra["record_batch"] == {
            "first_offset": 2, "last_offset": 4, "undecoded_from": 2, "record_count": 3,
            "attributes": 0, "codec": "none", "size_bytes": len(bad),
            "sha256": hashlib.sha256(bad).hexdigest(),
            "error": {"type": "CorruptRecordException",
                      "message": letter.extra["record_batch"]["error"]["message"]},
            "bytes_in_value": letter.source["offset"] == 2,
        }
        assert "Invalid CRC" in letter.extra["record_batch"]["error"]["message"]
        assert not replayable(letter)  # the value is a batch (or empty), not a request
    # the batch's bytes, for recovery, in the letter of its first offset only
    assert [d.value for d in letters] == [bad, b"", b""]
    assert pipeline.stats.dead_letters == {"undecodable_record_batch": 3}
    assert metrics.dead_letters.labels("unknown", "undecodable_record_batch")._value.get() == 3


async def test_a_batch_too_large_to_keep_leaves_its_size_and_digest_in_the_first_letter(
    start_pipeline: StartPipeline, images: np.ndarray
) -> None:
    feed, sink = Feed(), FakeSink()
    pipeline = await start_pipeline(
        ThreadExecutor(FakeEngine()), sink, max_dead_letter_value_bytes=100
    )
    bad = with_bad_crc(batch_bytes(requests(images, 0, 2)))
    assert len(bad) > 100
    for message in feed.messages(bad):
        await pipeline.handle(message)

    await wait_for(lambda: len(feed.acked) == 2)

    first, second = dead_letters_of(sink, pipeline)
    assert first.value == second.value == b""
    assert first.extra["value_omitted"] == {
        "bytes": len(bad), "sha256": hashlib.sha256(bad).hexdigest()
    }
    assert first.extra["record_batch"]["bytes_in_value"] is False
    assert "value_omitted" not in second.extra


async def test_a_stand_in_read_from_the_retry_topic_is_dead_lettered_as_undecodable(
    start_pipeline: StartPipeline, images: np.ndarray
) -> None:
    """The retry agent hands a record it cannot parse as a retry record to ``reject``
    (``invalid_retry_record``); a stand-in gets the batch's reason there too."""
    feed, sink = Feed(), FakeSink()
    pipeline = await start_pipeline(ThreadExecutor(FakeEngine()), sink)
    (stand_in,) = feed.messages(with_bad_crc(batch_bytes(requests(images, 0, 1))))
    await pipeline.reject(
        stand_in, InvalidRequestError("invalid_retry_record", "not a retry record")
    )

    await wait_for(lambda: feed.acked == [0])

    (letter,) = dead_letters_of(sink, pipeline)
    assert letter.error["reason"] == "undecodable_record_batch"
    assert letter.source == {"topic": feed.topic, "partition": 0, "offset": 0}


@pytest.mark.parametrize("value", [None, b""])
async def test_a_real_record_without_a_value_is_not_taken_for_a_stand_in(
    start_pipeline: StartPipeline, value: Any
) -> None:
    feed, sink = Feed(), FakeSink()
    pipeline = await start_pipeline(ThreadExecutor(FakeEngine()), sink)
    (record,) = feed.messages(batch_bytes([(b"dev-a", value)]))
    assert record.value == value
    await pipeline.handle(record)

    await wait_for(lambda: feed.acked == [0])

    (letter,) = dead_letters_of(sink, pipeline)
    assert letter.error["reason"] == "invalid_json"
    assert "record_batch" not in letter.extra
