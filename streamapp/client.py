"""Client side of the pipeline: publish keyed device events, await their answers, collect
results and dead letters.

:class:`AsyncClient` and its blocking twin :class:`Client` are the API for one's own frames
(README, "Publish a JPEG from Python"): ``send`` publishes a frame (numpy array, PNG/JPEG bytes or
file, ``.npy`` file, PIL image) for a device, ``infer`` publishes it and returns its result or dead
letter (:class:`~streamapp.replies.Reply`). The functions below them publish and read in bulk for
``streamapp publish``, the demo, the benchmarks and the tests. It talks to Kafka with plain
aiokafka, as a gateway in front of cameras would, not through Faust.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaError
from tqdm import tqdm

from streamapp.codecs import CodecName, decode_dead_letter, decode_result, encode_request
from streamapp.exceptions import BrokerError, FrameError, PublishError, ReplyTimeoutError
from streamapp.frames import Frame, checked_deadline, make_request
from streamapp.kafka import (
    IsolationLevel,
    describe_error,
    ensure_topics,
    partitions_of,
    start_or_close,
    unreachable_line,
)
from streamapp.records import DeadLetter, InferenceRequest, TensorPayload
from streamapp.replies import Reply, ReplyWaiter
from streamapp.settings import DEFAULT_TOPIC_PARTITIONS

if TYPE_CHECKING:
    from streamapp.settings import Settings

_T = TypeVar("_T")

#: Where a client's broker address comes from, for the hint of an unreachable broker.
_BROKER_SETTING = "the broker argument / STREAMAPP_BROKER"

__all__ = [
    "AsyncClient",
    "Client",
    "FrameError",
    "Outcomes",
    "Reply",
    "ReplyTimeoutError",
    "SentRequest",
    "check_request_size",
    "collect_outcomes",
    "digits_requests",
    "frame_requests",
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
        partition / offset: Where the broker stored it (-1 where not recorded).
    """

    request_id: str
    device_id: str
    seq: int
    ts: float
    index: int
    sent_at: float
    partition: int = -1
    offset: int = -1


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
    deadline: float | None = None,
) -> list[tuple[int, InferenceRequest]]:
    """Turn images into requests from ``devices`` devices, round-robin, with per-device ``seq``.

    Args:
        images: ``uint8[n, 8, 8]``.
        devices: Number of devices (``device-00`` ...), >= 1.
        model: Model name put in each request.
        run_id: Prefix of request ids (default: random), so runs never collide.
        indices: Which images to send, in order (default: all).
        deadline: Relative deadline of every request, milliseconds (as
            :meth:`AsyncClient.send`); None: the model's queue policy, if any.

    Returns:
        ``(image index, request)`` pairs in send order; ``ts`` is filled in when sent.

    Raises:
        FrameError: ``deadline`` is out of range (:func:`streamapp.frames.checked_deadline`).
    """
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    tensors = [TensorPayload(str(image.dtype), image.shape, np.ascontiguousarray(image).tobytes())
               for image in images]
    return frame_requests(tensors, device_ids=[f"device-{d:02d}" for d in range(devices)],
                          model=model, run_id=run_id, indices=indices, deadline=deadline)


def frame_requests(
    inputs: Sequence[TensorPayload | bytes],
    *,
    device_ids: Sequence[str],
    model: str,
    run_id: str | None = None,
    indices: Sequence[int] | None = None,
    deadline: float | None = None,
) -> list[tuple[int, InferenceRequest]]:
    """Requests for frame inputs from the given devices, round-robin, with per-device ``seq``.

    Args:
        inputs: Tensors, or PNG/JPEG bytes (:func:`streamapp.frames.frame_input`).
        device_ids: The devices, at least one; frame ``n`` goes to ``device_ids[n % len]``.
        model: Model name put in each request.
        run_id: Prefix of request ids (``<run_id>-<n>``; default: random).
        indices: Which inputs to send, in order (default: all, once).
        deadline: Relative deadline of every request, milliseconds (as
            :meth:`AsyncClient.send`); None: the model's queue policy, if any.

    Returns:
        ``(input index, request)`` pairs in send order; ``ts`` is filled in when sent.

    Raises:
        FrameError: ``deadline`` is out of range (:func:`streamapp.frames.checked_deadline`).
    """
    if not device_ids:
        raise ValueError("device_ids is empty; give at least one device")
    deadline = checked_deadline(deadline)
    run_id = run_id or uuid.uuid4().hex[:8]
    seqs = dict.fromkeys(device_ids, 0)
    out = []
    for n, index in enumerate(range(len(inputs)) if indices is None else indices):
        device = device_ids[n % len(device_ids)]
        value = inputs[index]
        out.append((index, InferenceRequest(
            request_id=f"{run_id}-{n}", device_id=device, seq=seqs[device], ts=0.0, model=model,
            tensor=value if isinstance(value, TensorPayload) else None,
            image=value if isinstance(value, bytes) else None, deadline=deadline,
        )))
        seqs[device] += 1
    return out


def check_request_size(request: InferenceRequest, codec: CodecName, limit: int,
                       what: str = "") -> bytes:
    """The encoded request value, refused when the worker would refuse it as too large.

    Args:
        request: The request.
        codec: ``"json"`` or ``"msgpack"``.
        limit: The worker's ``max_request_bytes``.
        what: Where the frame came from, for the message (a file name), or "".

    Returns:
        The value, ``len(value) <= limit``.

    Raises:
        FrameError: It is larger than ``limit``.
    """
    value = encode_request(request, codec)
    if len(value) > limit:
        source = f" ({what})" if what else ""
        raise FrameError(
            f"the request for device {request.device_id!r}{source} is {len(value):,} bytes as "
            f"{codec}, more than max_request_bytes={limit:,} that the worker accepts "
            "(STREAMAPP_MAX_REQUEST_BYTES): send a smaller frame ("
            + ("resize the image, or compress it as a JPEG" if request.image is not None else
               "a smaller tensor or dtype, or the image it came from as a JPEG") + ")"
            + (", or msgpack instead of json (no base64)" if codec == "json" else "")
        )
    return value


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


def _producer(bootstrap_servers: str, security: Mapping[str, Any] | None,
              max_request_size: int = 1_048_576) -> AIOKafkaProducer:
    # acks=all: a frame counts as sent once every in-sync replica has it; linger 2 ms lets
    # concurrent sends share a record batch. No idempotence: it needs InitProducerId, which the
    # embedded broker does not have.
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap_servers, acks="all", linger_ms=2, request_timeout_ms=30_000,
        max_request_size=max_request_size, **(security or {}),
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
    isolation_level: IsolationLevel = "read_committed",
) -> Outcomes:
    """Read both topics from the beginning until ``done(outcomes)`` or the timeout.

    Args:
        done: Called after each fetch; return True to stop.
        timeout_s: Give up after this long and return what was read (callers check counts).
        progress_total: Show a progress bar of outcomes read towards this total.
        security: aiokafka security options (:func:`kafka_security_options`); None: plaintext.
        isolation_level: ``"read_committed"`` (default): only records of committed
            transactions (what an exactly_once worker promises to show once; at_least_once
            workers write no transactions, so it reads the same there);
            ``"read_uncommitted"``: also those of open and aborted ones.

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
        isolation_level=isolation_level,
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


# -- one's own frames: AsyncClient / Client -----------------------------------------------------


class AsyncClient:
    """Publish frames for devices and await their answers (asyncio).

    One producer for every send, and one consumer of the result and dead-letter topics shared by
    every :meth:`infer` (started at the first one). Use ``async with AsyncClient(...) as
    client:``, or call :meth:`close` at the end; the first call starts it.

    Args:
        broker: ``kafka://host:port`` or ``host:port`` (default: ``STREAMAPP_BROKER``).
        topic_prefix: As the worker's (default: ``STREAMAPP_TOPIC_PREFIX``).
        model: Model named in requests when a call names none (default: the first of
            ``STREAMAPP_MODELS``, ``digits``).
        codec: ``"json"`` (base64 data) or ``"msgpack"`` (raw bytes, a third smaller).
        settings: Complete settings instead of the environment (``broker`` and
            ``topic_prefix`` then ignored); the security settings (TLS/SASL),
            ``topic_partitions`` (a missing request topic is created with it) and
            ``max_request_bytes`` (larger requests are refused before sending) come from them.

    Raises:
        ConfigError: A setting is invalid (from the environment or the arguments).
    """

    def __init__(
        self,
        broker: str | None = None,
        *,
        topic_prefix: str | None = None,
        model: str | None = None,
        codec: CodecName = "json",
        settings: Settings | None = None,
    ) -> None:
        from streamapp.kafka import kafka_security_options
        from streamapp.settings import load_settings

        if codec not in ("json", "msgpack"):
            raise ValueError(f"codec must be 'json' or 'msgpack', got {codec!r}")
        self.settings = settings or load_settings(broker=broker, topic_prefix=topic_prefix)
        self.model = model or self.settings.models[0]
        self.codec: CodecName = codec
        self._security = kafka_security_options(self.settings)
        self._seqs: dict[str, int] = {}
        self._producer: AIOKafkaProducer | None = None
        self._replies: ReplyWaiter | None = None
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> AsyncClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Create the request topic when it is missing, and start the producer.

        Raises:
            BrokerError: The broker did not answer, or the topic could not be created.
        """
        async with self._lock:
            await self._start_producer()

    async def _start_producer(self) -> AIOKafkaProducer:
        if self._producer is None:
            s = self.settings
            try:
                await _ensure_topic(s.bootstrap_servers, s.request_topic, s.topic_partitions,
                                    self._security, s.topic_replication_factor)
            except BrokerError as exc:
                # no broker: the CLI's line, not the admin client's "Cannot create topics"
                if isinstance(exc.__cause__, KafkaConnectionError):
                    raise BrokerError(unreachable_line(
                        s.bootstrap_servers, exc.__cause__, _BROKER_SETTING)) from exc.__cause__
                raise
            producer = _producer(s.bootstrap_servers, self._security,
                                 max(1_048_576, s.max_request_bytes + 4096))
            try:
                await start_or_close(producer)
            except KafkaConnectionError as exc:
                raise BrokerError(
                    unreachable_line(s.bootstrap_servers, exc, _BROKER_SETTING)) from exc
            except KafkaError as exc:
                raise BrokerError(
                    f"cannot publish to {s.bootstrap_servers}: {describe_error(exc)}"
                ) from exc
            self._producer = producer
        return self._producer

    async def _start_replies(self) -> ReplyWaiter:
        async with self._lock:
            await self._start_producer()
            if self._replies is None:
                s = self.settings
                replies = ReplyWaiter(s.bootstrap_servers, s.result_topic, s.dlq_topic,
                                      security=self._security)
                await replies.start()
                self._replies = replies
            return self._replies

    async def close(self) -> None:
        """Stop the producer and the consumer; requests still awaited get a BrokerError."""
        async with self._lock:
            if self._replies is not None:
                await self._replies.stop()
                self._replies = None
            if self._producer is not None:
                await self._producer.stop()
                self._producer = None

    def request(
        self, device_id: str, frame: Frame, *, model: str | None = None, seq: int | None = None,
        request_id: str | None = None, ts: float | None = None, deadline: float | None = None,
    ) -> InferenceRequest:
        """The request :meth:`send` would publish for this frame (nothing is sent).

        ``seq`` defaults to the device's next number in this client (0, 1, ...); the other
        arguments are those of :meth:`send`.

        Raises:
            FrameError: The frame cannot become a request, the deadline is out of range, or
                it would be larger than ``max_request_bytes`` (which the worker refuses).
        """
        if seq is None:
            seq = self._seqs.get(device_id, 0)
        request = make_request(device_id, frame, model=model or self.model, seq=seq,
                               request_id=request_id, ts=ts, deadline=deadline)
        self._seqs[device_id] = seq + 1
        return request

    async def send(
        self, device_id: str, frame: Frame, *, model: str | None = None, seq: int | None = None,
        request_id: str | None = None, ts: float | None = None, deadline: float | None = None,
    ) -> SentRequest:
        """Publish one frame of a device and wait for the broker's acknowledgement.

        Args:
            device_id: The device; the record key (UTF-8), so its frames keep their order.
            frame: A numpy array (a tensor: any of the request dtypes, e.g.
                ``uint8[8, 8]`` for ``digits``; sent little-endian, C order), PNG/JPEG bytes,
                the path of a PNG, JPEG or ``.npy`` file, or a PIL image (sent as PNG). Images
                need a model with an ``image`` declaration (docs/images.md).
            model: Model name (default: the client's).
            seq: The device's sequence number (default: the next one in this client, from 0).
            request_id: Default: a random 32-hex-digit id.
            ts: Capture time, epoch seconds (default: now).
            deadline: Relative deadline, milliseconds (float, > 0, at most 86,400,000: one
                day): how old the request may be when its batch would start, measured from
                when it reached Kafka; older, it is not inferred and its answer is a result
                with ``outcome: "expired"`` (docs/delivery.md, "Queue policy"). It replaces
                the model's ``queue_policy.max_age_ms``. None (default): the model's policy,
                if any.

        Returns:
            What was sent, with the partition and offset the broker stored it at.

        Raises:
            FrameError: The frame cannot become a request, or ``deadline`` is 0 or less, not
                finite or over one day (the worker's ``bad_deadline``); nothing was sent.
            BrokerError: The broker did not answer when the client started.
            PublishError: The broker did not acknowledge the frame (it may or may not have
                arrived).
        """
        request = self.request(device_id, frame, model=model, seq=seq, request_id=request_id,
                               ts=ts, deadline=deadline)
        return await self._publish(request)

    async def _publish(self, request: InferenceRequest,
                       replies: ReplyWaiter | None = None) -> SentRequest:
        value = check_request_size(request, self.codec, self.settings.max_request_bytes)
        if self._producer is None:
            await self.start()
        producer = self._producer
        assert producer is not None
        topic = self.settings.request_topic
        sent_at = time.time()
        try:
            metadata = await (await producer.send(topic, value,
                                                  key=request.device_id.encode("utf-8")))
        except KafkaError as exc:
            raise PublishError(
                f"publishing request {request.request_id} of device {request.device_id!r} to "
                f"{topic} on {self.settings.bootstrap_servers} failed; it may or may not have "
                f"arrived ({describe_error(exc)})", sent=1, acknowledged=0, total=1,
            ) from exc
        if replies is not None:
            replies.published(request.request_id, topic, metadata.partition, metadata.offset)
        return SentRequest(request.request_id, request.device_id, request.seq, request.ts, -1,
                           sent_at, metadata.partition, metadata.offset)

    async def infer(
        self, device_id: str, frame: Frame, *, timeout: float = 30.0, model: str | None = None,
        seq: int | None = None, request_id: str | None = None, ts: float | None = None,
        deadline: float | None = None,
    ) -> Reply:
        """Publish one frame and return its answer: the result, or the dead letter.

        Concurrent calls share one consumer of the result and dead-letter topics; each gets the
        answer with its own ``request_id`` (or, for a dead letter without one, the one whose
        source is its record). The first answer counts: a duplicate after a worker restart
        (at-least-once) is ignored.

        Args:
            device_id / frame / model / seq / request_id / ts / deadline: As :meth:`send`.
            timeout: Seconds to wait for the answer after publishing, > 0.

        Returns:
            The :class:`~streamapp.replies.Reply`: ``reply.result`` (``reply.label``,
            ``reply.score``; ``reply.result["outcome"]`` is ``"expired"``, with no label, when
            the request was older than its ``deadline``) or ``reply.dead_letter``
            (``reply.reason``).

        Raises:
            FrameError: As :meth:`send`; nothing was sent.
            BrokerError: The result or dead-letter topic does not exist (no worker has run),
                or reading them failed.
            PublishError: As :meth:`send`.
            ReplyTimeoutError: No answer within ``timeout`` (the request was published and may
                still be answered later).
        """
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        request = self.request(device_id, frame, model=model, seq=seq, request_id=request_id,
                               ts=ts, deadline=deadline)
        replies = await self._start_replies()
        future = replies.expect(request.request_id)
        try:
            sent = await self._publish(request, replies)
            try:
                return await asyncio.wait_for(future, timeout)
            except TimeoutError:
                pass
            s = self.settings
            raise ReplyTimeoutError(
                f"no answer to request {request.request_id} (device {request.device_id!r}, "
                f"model {request.model!r}) within {timeout:g} s: neither {s.result_topic} nor "
                f"{s.dlq_topic} has it. It was published to {s.request_topic}[{sent.partition}]"
                f"@{sent.offset}; is a worker running with this topic prefix "
                f"({s.topic_prefix!r}) and caught up (streamapp status)? Give a longer timeout "
                "for a first request (a worker may still be starting)",
                request_id=request.request_id, timeout_s=timeout,
            )
        finally:
            replies.forget(request.request_id)


class Client:
    """The blocking form of :class:`AsyncClient`, for scripts and threads.

    Its own event loop runs in a background thread; methods block until done and may be called
    from several threads at once (their requests share the producer and the consumer). Use
    ``with Client(...) as client:``, or call :meth:`close`.

    Args:
        broker / topic_prefix / model / codec / settings: As :class:`AsyncClient`.

    Raises:
        ConfigError: A setting is invalid.
    """

    def __init__(
        self,
        broker: str | None = None,
        *,
        topic_prefix: str | None = None,
        model: str | None = None,
        codec: CodecName = "json",
        settings: Settings | None = None,
    ) -> None:
        self._client = AsyncClient(broker, topic_prefix=topic_prefix, model=model, codec=codec,
                                   settings=settings)
        self.settings = self._client.settings
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="streamapp-client",
                                        daemon=True)
        self._thread.start()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def send(self, device_id: str, frame: Frame, **options: Any) -> SentRequest:
        """Publish one frame; see :meth:`AsyncClient.send` (same arguments, errors, result)."""
        return self._call(self._client.send(device_id, frame, **options))

    def infer(self, device_id: str, frame: Frame, *, timeout: float = 30.0,
              **options: Any) -> Reply:
        """Publish one frame and return its answer; see :meth:`AsyncClient.infer`."""
        return self._call(self._client.infer(device_id, frame, timeout=timeout, **options))

    def close(self) -> None:
        """Stop the producer, the consumer and the background loop (safe to call twice)."""
        if self._loop.is_closed():
            return
        try:
            self._call(self._client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
