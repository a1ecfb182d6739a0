"""Client side of the pipeline: publish keyed device events, collect results and dead letters.

Used by ``streamapp publish``, the demo and the integration tests. It talks to Kafka with plain
aiokafka, as a gateway in front of cameras would, not through Faust.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from tqdm import tqdm

from streamapp.codecs import CodecName, decode_dead_letter, decode_result, encode_request
from streamapp.exceptions import ConfigError
from streamapp.records import DeadLetter, InferenceRequest, TensorPayload
from streamapp.settings import Settings

__all__ = [
    "Outcomes",
    "PartitionRange",
    "SentRequest",
    "collect_outcomes",
    "digits_requests",
    "kafka_security_options",
    "load_digits_frames",
    "publish",
    "publish_values",
    "read_partition_range",
    "ssl_context",
    "start_or_close",
]


# -- security --------------------------------------------------------------------------------------


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context for ``security_protocol`` SSL or SASL_SSL, else None.

    Verifies the brokers' certificates against ``ssl_cafile`` (default: the system's trust
    store), checks host names unless ``ssl_check_hostname`` is false, and presents
    ``ssl_certfile``/``ssl_keyfile`` when set (mutual TLS).

    Raises:
        ConfigError: A file is missing or is not valid PEM; the message names the setting.
    """
    if not settings.security_protocol.endswith("SSL"):
        return None
    cafile = settings.ssl_cafile
    try:
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=str(cafile) if cafile else None
        )
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"ssl_cafile {str(cafile)!r} cannot be used as CA certificates: {exc}; give a PEM "
            "file (STREAMAPP_SSL_CAFILE)"
        ) from None
    context.check_hostname = settings.ssl_check_hostname
    if settings.ssl_certfile is not None:
        password = settings.ssl_key_password.get_secret_value() or None
        try:
            context.load_cert_chain(
                str(settings.ssl_certfile),
                str(settings.ssl_keyfile) if settings.ssl_keyfile else None,
                password=password,
            )
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"ssl_certfile {str(settings.ssl_certfile)!r} / ssl_keyfile "
                f"{str(settings.ssl_keyfile)!r} cannot be loaded: {exc}; give a PEM certificate "
                "and its key (and ssl_key_password if the key is encrypted)"
            ) from None
    return context


def kafka_security_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for aiokafka clients (producer, consumer, admin) from the settings.

    Args:
        settings: ``security_protocol``, ``sasl_*`` and ``ssl_*``.

    Returns:
        ``security_protocol``, plus ``ssl_context`` with SSL/SASL_SSL and ``sasl_mechanism``,
        ``sasl_plain_username``, ``sasl_plain_password`` with SASL_* (aiokafka uses these two
        for SCRAM as well). Holds the password in clear: never log it.

    Raises:
        ConfigError: See :func:`ssl_context`.
    """
    options: dict[str, Any] = {"security_protocol": settings.security_protocol}
    context = ssl_context(settings)
    if context is not None:
        options["ssl_context"] = context
    if settings.security_protocol.startswith("SASL_"):
        options["sasl_mechanism"] = settings.sasl_mechanism
        options["sasl_plain_username"] = settings.sasl_username
        options["sasl_plain_password"] = settings.sasl_password.get_secret_value()
    return options


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


async def start_or_close(client: Any) -> None:
    """Start an aiokafka producer/consumer; if that fails, close it before re-raising (aiokafka
    leaves a half-started client behind otherwise, and warns about it at exit)."""
    try:
        await client.start()
    except BaseException:
        await client.stop()
        raise


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
) -> list[SentRequest]:
    """Publish requests keyed by ``device_id`` (UTF-8), stamping ``ts`` at send time.

    Args:
        bootstrap_servers: ``host:port``.
        topic: The request topic.
        requests: ``(image index, request)`` as from :func:`digits_requests`.
        codec: ``"json"`` (base64 tensors) or ``"msgpack"`` (raw bytes).
        rate_per_s: Open-loop send rate (requests/s); None sends as fast as possible.
        progress: Show a progress bar on stderr.
        security: aiokafka security options (:func:`kafka_security_options`); None: plaintext.

    Returns:
        One :class:`SentRequest` per request, after the broker acknowledged all of them.
    """
    producer = _producer(bootstrap_servers, security)
    await start_or_close(producer)
    sent: list[SentRequest] = []
    futures = []
    bar = tqdm(total=len(requests), unit="frame", disable=not progress, desc="publish")
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
                request.tensor, request.image,
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
) -> None:
    """Publish raw ``(key, value)`` records in order (for bad-input tests and replays).

    ``security``: aiokafka security options (:func:`kafka_security_options`); None: plaintext.
    """
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


class PartitionRange(list[tuple[int, bytes | None, bytes | None]]):
    """What :func:`read_partition_range` read: ``(offset, key, value)`` records in offset order.

    Attributes:
        deleted_before: Offsets of the range below this were deleted by retention (the range's
            start when none were). Other offsets of the range without a record hold no data:
            transaction markers and records of aborted transactions.
    """

    deleted_before: int = 0


async def read_partition_range(
    bootstrap_servers: str,
    topic: str,
    partition: int,
    start: int,
    end: int,
    *,
    security: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
) -> PartitionRange:
    """Read the records ``start <= offset < end`` of one partition, outside any consumer group.

    Reads committed records only (``isolation_level=read_committed``, like the worker's
    consumer), and stops as soon as the reader's position reaches ``end``: transaction markers
    and aborted records occupy offsets but are never returned.

    Returns:
        The records, in offset order, with ``deleted_before`` set (offsets below it no longer
        exist: retention); fewer than ``end - start`` when some offsets hold no data records or
        the timeout passed.
    """
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers, group_id=None, enable_auto_commit=False,
        auto_offset_reset="earliest", isolation_level="read_committed", **(security or {}),
    )
    await start_or_close(consumer)
    out = PartitionRange()
    out.deleted_before = start
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        log_start = (await consumer.beginning_offsets([tp]))[tp]
        out.deleted_before = max(start, min(log_start, end))
        consumer.seek(tp, out.deleted_before)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batch = await consumer.getmany(tp, timeout_ms=200, max_records=10_000)
            for record in batch.get(tp, []):
                if record.offset >= end:
                    return out
                out.append((record.offset, record.key, record.value))
            if await consumer.position(tp) >= end:  # also past markers and aborted records
                return out
    finally:
        await consumer.stop()
    return out


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
    bar = tqdm(total=progress_total, unit="result", disable=progress_total is None, desc="results")
    try:
        partitions = []
        for topic in (result_topic, dlq_topic):
            for p in sorted(await _partitions(consumer, topic)):
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


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    # Topics are created before any client runs (see streamapp.broker.create_topics); asking for
    # a missing one would auto-create it on Tansu.
    for _ in range(50):
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return set(parts)
        await consumer._client.force_metadata_update()
    raise RuntimeError(f"topic {topic!r} has no partitions; was it created?")
