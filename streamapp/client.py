"""Client side of the pipeline: publish keyed device events, collect results and dead letters.

Used by ``streamapp publish``, the demo, the benchmarks and the integration tests. It talks to
Kafka with plain aiokafka, as a gateway in front of cameras would, not through Faust.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from tqdm import tqdm

from streamapp.codecs import CodecName, decode_dead_letter, decode_result, encode_request
from streamapp.exceptions import PublishError
from streamapp.kafka import describe_error, ensure_topics, partitions_of, start_or_close
from streamapp.records import DeadLetter, InferenceRequest, TensorPayload
from streamapp.settings import DEFAULT_TOPIC_PARTITIONS

__all__ = [
    "Outcomes",
    "SentRequest",
    "collect_outcomes",
    "digits_requests",
    "load_digits_frames",
    "publish",
    "publish_values",
]


@dataclass(frozen=True, slots=True)
class SentRequest:
    """What was published for one frame.

    Attributes:
        request_id / device_id / seq / ts: As in the request.
        index: Index of the image in ``sklearn.datasets.load_digits()`` (or -1).
        sent_at: Epoch seconds when the producer handed it over.
    """

    request_id: str
    device_id: str
    seq: int
    ts: float
    index: int
    sent_at: float


def load_digits_frames() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 real 8×8 handwritten digits bundled with scikit-learn.

    Returns:
        ``(images uint8[1797, 8, 8] with values 0..16, labels int64[1797])``.
    """
    from sklearn.datasets import load_digits  # heavy import, only when frames are needed

    digits = load_digits()
    return digits.images.astype(np.uint8), digits.target.astype(np.int64)


def digits_requests(
    images: np.ndarray,
    *,
    devices: int,
    model: str = "digits",
    run_id: str | None = None,
    indices: Sequence[int] | None = None,
) -> list[tuple[int, InferenceRequest]]:
    """Turn images into requests from ``devices`` devices, round-robin, with per-device ``seq``.

    Args:
        images: ``uint8[n, 8, 8]``.
        devices: Number of devices (``device-00`` ...), >= 1.
        model: Model name put in each request.
        run_id: Prefix of request ids (default: random), so runs never collide.
        indices: Which images to send, in order (default: all).

    Returns:
        ``(image index, request)`` pairs in send order; ``ts`` is filled in when sent.
    """
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    run_id = run_id or uuid.uuid4().hex[:8]
    seqs = [0] * devices
    out = []
    for n, index in enumerate(range(len(images)) if indices is None else indices):
        d = n % devices
        image = np.ascontiguousarray(images[index])
        out.append(
            (
                index,
                InferenceRequest(
                    request_id=f"{run_id}-{n}",
                    device_id=f"device-{d:02d}",
                    seq=seqs[d],
                    ts=0.0,
                    model=model,
                    tensor=TensorPayload(str(image.dtype), image.shape, image.tobytes()),
                ),
            )
        )
        seqs[d] += 1
    return out


async def _ensure_topic(
    bootstrap_servers: str, topic: str, partitions: int | None,
    security: Mapping[str, Any] | None, replication_factor: int = 1,
) -> None:
    """Create ``topic`` with ``partitions`` partitions if it does not exist, before the producer
    asks for its metadata (brokers that auto-create topics would pick their own default count:
    4 on the embedded broker, ``num.partitions`` on Kafka, and the worker's tables follow the
    request topic's count)."""
    if partitions is not None:
        await ensure_topics(bootstrap_servers, {topic: partitions}, security=security,
                            replication_factor=replication_factor)


def _producer(bootstrap_servers: str, security: Mapping[str, Any] | None) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap_servers, acks="all", linger_ms=2, request_timeout_ms=30_000,
        **(security or {}),
    )


async def publish(
    bootstrap_servers: str,
    topic: str,
    requests: Sequence[tuple[int, InferenceRequest]],
    *,
    codec: CodecName = "json",
    rate_per_s: float | None = None,
    progress: bool = False,
    security: Mapping[str, Any] | None = None,
    partitions: int | None = DEFAULT_TOPIC_PARTITIONS,
    replication_factor: int = 1,
) -> list[SentRequest]:
    """Publish requests keyed by ``device_id`` (UTF-8), stamping ``ts`` at send time.

    Args:
        bootstrap_servers: ``host:port``.
        topic: The request topic.
        requests: ``(image index, request)`` as from :func:`digits_requests`.
        codec: ``"json"`` (base64 tensors) or ``"msgpack"`` (raw bytes).
        rate_per_s: Open-loop send rate (requests/s); None sends as fast as possible.
        progress: Show a progress bar on stderr (only when stderr is a terminal).
        security: aiokafka security options (:func:`kafka_security_options`); None: plaintext.
        partitions: Create ``topic`` with this many partitions when it does not exist (the
            worker's ``topic_partitions``); None: leave that to the broker.
        replication_factor: Replicas of a topic created here.

    Returns:
        One :class:`SentRequest` per request, after the broker acknowledged all of them.

    Raises:
        BrokerError: The topic could not be created.
        PublishError: Sending failed part way (the message says how many frames were sent
            and acknowledged before it).
        KafkaError: The producer could not reach the broker when it started.
    """
    await _ensure_topic(bootstrap_servers, topic, partitions, security, replication_factor)
    producer = _producer(bootstrap_servers, security)
    await start_or_close(producer)
    sent: list[SentRequest] = []
    futures = []
    # disable=None: no bar when stderr is not a terminal (a log file would get every redraw)
    bar = tqdm(total=len(requests), unit="frame", disable=None if progress else True,
               desc="publish")
    try:
        start = time.monotonic()
        for n, (index, request) in enumerate(requests):
            if rate_per_s:
                delay = start + n / rate_per_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            now = time.time()
            stamped = InferenceRequest(
                request.request_id, request.device_id, request.seq, now, request.model,
                request.tensor, request.image, deadline=request.deadline,
            )
            fut = await producer.send(
                topic, encode_request(stamped, codec), key=request.device_id.encode()
            )
            fut.add_done_callback(lambda _f: bar.update(1))
            futures.append(fut)
            sent.append(
                SentRequest(request.request_id, request.device_id, request.seq, now, index, now)
            )
        await asyncio.gather(*futures)
    except KafkaError as exc:
        # say how far it got, so that nobody re-publishes everything after a broker stall
        acked = sum(f.done() and not f.cancelled() and f.exception() is None for f in futures)
        raise PublishError(
            f"publishing to {topic} on {bootstrap_servers} failed after {len(futures):,} of "
            f"{len(requests):,} frames were sent: {acked:,} of {len(requests):,} acknowledged; "
            f"the rest may or may not have arrived ({describe_error(exc)}). Read the topic "
            "(or the results) before publishing them again",
            sent=len(futures), acknowledged=acked, total=len(requests),
        ) from exc
    finally:
        await producer.stop()
        bar.close()
    return sent


async def publish_values(
    bootstrap_servers: str,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes]],
    *,
    security: Mapping[str, Any] | None = None,
    partitions: int | None = DEFAULT_TOPIC_PARTITIONS,
) -> None:
    """Publish raw ``(key, value)`` records in order (for bad-input tests and replays).

    ``security``: aiokafka security options (:func:`kafka_security_options`); None: plaintext.
    ``partitions``: as in :func:`publish` (the topic is created when missing).
    """
    await _ensure_topic(bootstrap_servers, topic, partitions, security)
    producer = _producer(bootstrap_servers, security)
    await start_or_close(producer)
    try:
        for key, value in records:
            await (await producer.send(topic, value, key=key))
    finally:
        await producer.stop()


@dataclass
class Outcomes:
    """Results and dead letters read back, in topic order per partition.

    Attributes:
        results: Decoded result records, each with ``_received_at`` (epoch s) and ``_partition``.
        dead_letters: Decoded dead letters.
    """

    results: list[dict[str, Any]] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)

    def result_ids(self) -> set[str]:
        return {r["request_id"] for r in self.results}

    def dead_letter_ids(self) -> set[str | None]:
        return {d.request_id for d in self.dead_letters}


async def collect_outcomes(
    bootstrap_servers: str,
    result_topic: str,
    dlq_topic: str,
    *,
    done: Callable[[Outcomes], bool],
    timeout_s: float = 60.0,
    progress_total: int | None = None,
    security: Mapping[str, Any] | None = None,
) -> Outcomes:
    """Read both topics from the beginning until ``done(outcomes)`` or the timeout.

    Args:
        done: Called after each fetch; return True to stop.
        timeout_s: Give up after this long and return what was read (callers check counts).
        progress_total: Show a progress bar of outcomes read towards this total.
        security: aiokafka security options (:func:`kafka_security_options`); None: plaintext.

    Returns:
        What was read.
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        # short fetch waits: the embedded broker holds an empty fetch for the whole wait, which
        # would add up to 500 ms (aiokafka's default) to every latency measured here
        fetch_max_wait_ms=10,
        **(security or {}),
    )
    await start_or_close(consumer)
    outcomes = Outcomes()
    bar = tqdm(total=progress_total, unit="result",
               disable=True if progress_total is None else None, desc="results")
    try:
        partitions = []
        for topic in (result_topic, dlq_topic):
            for p in sorted(await partitions_of(consumer, topic)):
                partitions.append(TopicPartition(topic, p))
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        deadline = time.monotonic() + timeout_s
        while not done(outcomes) and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=200, max_records=5000)
            now = time.time()
            for tp, records in batches.items():
                for record in records:
                    assert record.value is not None
                    if tp.topic == result_topic:
                        result = decode_result(record.value)
                        result["_received_at"] = now
                        result["_partition"] = tp.partition
                        outcomes.results.append(result)
                    else:
                        outcomes.dead_letters.append(decode_dead_letter(record.value))
                    bar.update(1)
    finally:
        bar.close()
        await consumer.stop()
    return outcomes
