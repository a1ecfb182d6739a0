"""InferencePipeline without Kafka: records go in through ``handle``, results and dead letters come
out through a fake sink whose acknowledgement futures the tests resolve (or fail) themselves.

The model is the real bundled ``digits`` contract, run either by ONNX Runtime (predictions checked
against an independent offline ``onnxruntime`` session) or by :class:`FakeEngine` (checked against
``FakeEngine.predict``), always through :class:`ThreadExecutor`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import onnxruntime as ort
import pytest
from sklearn.datasets import load_digits

from engines.base import Engine
from engines.exceptions import EngineRuntimeError, InputSpecError
from engines.executor import Item, ThreadExecutor
from engines.registry import load_engine
from engines.testing import FakeEngine, FaultyEngine
from streamapp.agents.observer import Outcome
from streamapp.agents.pipeline import InferencePipeline, LoadedModel, SourceMessage
from streamapp.codecs import REASONS, decode_dead_letter, decode_result, encode_request
from streamapp.metrics import Metrics
from streamapp.models import ModelConfig, ModelRepository
from streamapp.records import DeadLetter, InferenceRequest, InferenceResult, TensorPayload
from streamapp.retry import MemoryRetryStore, RetryRecord
from streamapp.settings import Settings

REQUEST_TOPIC = "inference-request"
PARTITION = 3
WORKER = "test-worker"


# -- helpers -------------------------------------------------------------------------------------


async def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Yield to the event loop until ``condition()`` holds; fail the test after the timeout."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0)


async def settle() -> None:
    """Let every runnable task run (no wall-clock wait)."""
    for _ in range(50):
        await asyncio.sleep(0)


@dataclass
class Sent:
    topic: str
    key: bytes | None
    value: bytes
    future: asyncio.Future[None]


@dataclass
class FakeSink:
    """Records what is produced; each ``send`` returns an asyncio future standing for the
    broker's acknowledgement, resolved at once with ``auto_resolve`` or by the test."""

    auto_resolve: bool = True
    sent: list[Sent] = field(default_factory=list)

    async def send(self, topic: str, key: bytes | None, value: bytes) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sent.append(Sent(topic, key, value, future))
        if self.auto_resolve:
            future.set_result(None)
        return future


class Source:
    """Makes source messages of one topic-partition with increasing offsets; records acks."""

    def __init__(self) -> None:
        self.acked: list[int] = []
        self._offsets = itertools.count(100)

    def message(self, value: bytes | None, key: bytes | None) -> SourceMessage:
        offset = next(self._offsets)
        return SourceMessage(
            key, value, REQUEST_TOPIC, PARTITION, offset, ack=lambda: self.acked.append(offset)
        )


def request_value(
    pixels: np.ndarray,
    device: str,
    seq: int,
    *,
    codec: str = "json",
    model: str = "digits",
) -> bytes:
    request = InferenceRequest(
        request_id=f"{device}-{seq}",
        device_id=device,
        seq=seq,
        ts=1_700_000_000.0,
        model=model,
        tensor=TensorPayload(str(pixels.dtype), tuple(pixels.shape), pixels.tobytes()),
    )
    return encode_request(request, codec)  # type: ignore[arg-type]


def good(source: Source, pixels: np.ndarray, device: str, seq: int, **kw: Any) -> SourceMessage:
    return source.message(request_value(pixels, device, seq, **kw), device.encode())


class Recorder:
    """A pipeline observer that keeps every outcome."""

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []

    def on_outcome(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def on_batch(self, model: str, info: Any) -> None:
        return None

    async def flush(self) -> None:
        return None


def top_label(probs: np.ndarray) -> str:
    return str(int(np.argmax(probs)))


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_config() -> ModelConfig:
    return ModelRepository().get("digits")


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    """scikit-learn's digit images as ``uint8[1797, 8, 8]``, pixel values 0..16."""
    return load_digits().images.astype(np.uint8)


@pytest.fixture(scope="module")
def onnx_engine(digits_config: ModelConfig) -> Iterator[Engine]:
    engine = load_engine("onnxruntime", digits_config.path, intra_op_threads=1)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def offline_probs(digits_config: ModelConfig, images: np.ndarray) -> Callable[[int], np.ndarray]:
    """Probabilities for image ``i`` from a plain onnxruntime session (no streamapp code)."""
    session = ort.InferenceSession(str(digits_config.path), providers=["CPUExecutionProvider"])

    def probs(i: int) -> np.ndarray:
        x = (images[i].astype(np.float32) / 16.0).reshape(1, 1, 8, 8)
        (out,) = session.run(["probs"], {"input": x})
        return np.asarray(out)[0]

    return probs


StartPipeline = Callable[..., Awaitable[InferencePipeline]]


@pytest.fixture
async def start_pipeline(digits_config: ModelConfig) -> AsyncIterator[StartPipeline]:
    """``await start_pipeline(executor, sink, **settings)``: a started pipeline serving
    ``digits`` (or ``config=``) on ``executor``; stopped and the executor closed after the
    test."""
    started: list[tuple[InferencePipeline, ThreadExecutor]] = []

    async def start(
        executor: ThreadExecutor, sink: FakeSink, *, retry_store: Any = None,
        observers: Sequence[Any] = (), highwater: Any = None,
        config: ModelConfig | None = None, **settings: Any
    ) -> InferencePipeline:
        options: dict[str, Any] = {
            "max_batch_size": 4,
            "max_batch_delay_ms": 5.0,
            "max_inflight_batches": executor.max_inflight,
            "topic_prefix": "",
            "top_k": 3,
            **settings,
        }
        pipeline = InferencePipeline(
            Settings(**options),
            {"digits": LoadedModel(config or digits_config, executor)},
            sink,
            worker=WORKER,
            retry_store=retry_store,
            observers=observers,
            highwater=highwater,
        )
        await pipeline.start()
        started.append((pipeline, executor))
        return pipeline

    yield start
    for pipeline, executor in started:
        await pipeline.stop(drain=False)
        await executor.close()


def results_of(sink: FakeSink, pipeline: InferencePipeline) -> list[dict[str, Any]]:
    return [decode_result(s.value) for s in sink.sent if s.topic == pipeline.settings.result_topic]


def dead_letters_of(sink: FakeSink, pipeline: InferencePipeline) -> list[DeadLetter]:
    return [
        decode_dead_letter(s.value) for s in sink.sent if s.topic == pipeline.settings.dlq_topic
    ]


# -- good requests -------------------------------------------------------------------------------


@pytest.mark.parametrize("request_codec", ["json", "msgpack"])
@pytest.mark.parametrize("result_codec", ["json", "msgpack"])
async def test_good_requests_get_the_offline_prediction(
    start_pipeline: StartPipeline,
    onnx_engine: Engine,
    images: np.ndarray,
    offline_probs: Callable[[int], np.ndarray],
    request_codec: str,
    result_codec: str,
) -> None:
    sink, source = FakeSink(), Source()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink, result_codec=result_codec)
    indices = [*range(10), 1500, 1796]
    devices = ["dev-a", "dev-b", "dev-c"]
    read: list[tuple[int, str, int, int]] = []  # (image index, device, seq, offset)
    for n, i in enumerate(indices):
        device, seq = devices[n % 3], n // 3
        message = good(source, images[i], device, seq, codec=request_codec)
        read.append((i, device, seq, message.offset))
        await pipeline.handle(message)

    await wait_for(lambda: len(source.acked) == len(indices))

    assert [s.topic for s in sink.sent] == ["inference-result"] * len(indices)
    parse = msgpack.unpackb if result_codec == "msgpack" else json.loads
    assert [parse(s.value)["request_id"] for s in sink.sent] == [f"{d}-{q}" for _, d, q, _ in read]
    results = results_of(sink, pipeline)
    batch_sizes: dict[str, int] = {}
    for sent, result, (i, device, seq, _) in zip(sink.sent, results, read, strict=True):
        expected = offline_probs(i)
        assert sent.key == device.encode()
        assert result["request_id"] == f"{device}-{seq}"
        assert result["device_id"] == device and result["seq"] == seq
        assert result["model"] == "digits"
        assert result["engine"] == onnx_engine.info.tag
        assert result["attempt"] == 0
        assert result["worker"] == WORKER
        top = result["outputs"]["top_k"]
        assert len(top) == 3
        assert top[0]["label"] == top_label(expected)
        assert [t["score"] for t in top] == sorted((t["score"] for t in top), reverse=True)
        for t in top:
            assert t["score"] == pytest.approx(float(expected[int(t["label"])]), abs=1e-5)
        assert 1 <= result["batch_size"] <= 4
        batch_sizes.setdefault(result["batch_id"], result["batch_size"])
        assert batch_sizes[result["batch_id"]] == result["batch_size"]
    per_batch = {b: sum(r["batch_id"] == b for r in results) for b in batch_sizes}
    assert per_batch == batch_sizes
    assert source.acked == [offset for *_, offset in read]
    assert pipeline.stats.results == len(indices) and pipeline.stats.acked == len(indices)


async def test_predictions_match_dataset_labels(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray
) -> None:
    # The bundled model is ~99% accurate on the whole set; these 10 are among the right ones.
    targets = load_digits().target
    sink, source = FakeSink(), Source()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink)
    for i in range(10):
        await pipeline.handle(good(source, images[i], "dev-a", i))

    await wait_for(lambda: len(source.acked) == 10)

    labels = [r["outputs"]["top_k"][0]["label"] for r in results_of(sink, pipeline)]
    assert labels == [str(t) for t in targets[:10]]


@pytest.mark.parametrize("result_codec", ["json", "msgpack"])
async def test_a_result_record_is_an_inference_result_and_its_outcome_says_the_same(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray, result_codec: str
) -> None:
    # _result writes InferenceResult.to_dict() out by hand: the same keys, in the same order
    sink, source, recorder = FakeSink(), Source(), Recorder()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink, observers=[recorder],
                                    result_codec=result_codec)
    for i in range(4):
        await pipeline.handle(good(source, images[i], "dev-a", i))
    await wait_for(lambda: len(source.acked) == 4)

    names = [f.name for f in dataclasses.fields(InferenceResult) if f.name != "policy"]
    for sent, outcome in zip(sink.sent, recorder.outcomes, strict=True):
        body = decode_result(sent.value)
        assert list(body) == names
        result = InferenceResult(**body)
        assert result.to_dict() == body
        assert result.outcome == "answered" and result.worker == WORKER
        assert result.batch_id is not None and result.batch_id.startswith(f"{WORKER}/")
        top = result.outputs["top_k"][0]
        assert (outcome.kind, outcome.request_id, outcome.device_id, outcome.seq,
                outcome.model, outcome.reason) == (
            "result", result.request_id, result.device_id, result.seq, result.model, None)
        assert (outcome.label, outcome.score) == (top["label"], top["score"])
        assert (outcome.e2e_ms, outcome.queue_ms, outcome.infer_ms, outcome.batch_size,
                outcome.clock_skew_ms) == (result.e2e_ms, result.queue_ms, result.infer_ms,
                                           result.batch_size, result.clock_skew_ms)
        assert outcome.ts >= result.ts and outcome.partition == PARTITION


# -- acknowledgement -----------------------------------------------------------------------------


async def test_ack_only_after_the_sink_future_resolves(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray
) -> None:
    sink, source = FakeSink(auto_resolve=False), Source()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink)
    message = good(source, images[0], "dev-a", 0)

    await pipeline.handle(message)
    await wait_for(lambda: len(sink.sent) == 1)
    await settle()

    assert source.acked == []  # produced, but the broker has not acknowledged yet
    assert pipeline.stats.acked == 0

    sink.sent[0].future.set_result(None)
    await wait_for(lambda: source.acked == [message.offset])
    assert pipeline.stats.acked == 1


async def test_no_ack_when_the_sink_future_fails(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray
) -> None:
    sink, source = FakeSink(auto_resolve=False), Source()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink)
    failing = good(source, images[0], "dev-a", 0)
    bad_input = source.message(b"not json", b"dev-a")
    later = good(source, images[1], "dev-a", 1)
    for message in (failing, bad_input, later):
        await pipeline.handle(message)
    await wait_for(lambda: len(sink.sent) == 3)

    sink.sent[0].future.set_exception(ConnectionError("broker went away"))
    sink.sent[1].future.cancel()
    await settle()
    assert source.acked == []

    sink.sent[2].future.set_result(None)
    await wait_for(lambda: source.acked == [later.offset])
    await settle()

    assert source.acked == [later.offset]
    assert pipeline.stats.produce_failures == 2
    assert pipeline.stats.acked == 1


# -- bad input -----------------------------------------------------------------------------------


def _json_without(field_name: str, pixels: np.ndarray) -> bytes:
    body = json.loads(request_value(pixels, "dev-a", 5))
    del body[field_name]
    return json.dumps(body).encode()


def _image_only() -> bytes:
    request = InferenceRequest("dev-a-5", "dev-a", 5, 1_700_000_000.0, "digits", image=b"\x89PNG")
    return encode_request(request)


@dataclass(frozen=True)
class BadCase:
    value: Callable[[np.ndarray], bytes | None]
    key: bytes | None
    reason: str
    stage: str
    readable: bool  # request_id / device_id / model readable from the value (issue 10, item 4)


def _json_with(pixels: np.ndarray, codec: str = "json", **changes: Any) -> bytes:
    """A valid request (``dev-a-5`` of ``dev-a``) with some fields changed (tensor fields
    prefixed ``tensor_``)."""
    value = request_value(pixels, "dev-a", 5, codec=codec)
    body = msgpack.unpackb(value) if codec == "msgpack" else json.loads(value)
    for name, new in changes.items():
        if name.startswith("tensor_"):
            body["tensor"][name.removeprefix("tensor_")] = new
        else:
            body[name] = new
    if codec == "msgpack":
        return bytes(msgpack.packb(body, use_bin_type=True))
    return json.dumps(body).encode()


BAD_CASES = {
    "not-json": BadCase(lambda px: b"\x00\xffnot json", b"dev-a", "invalid_json", "decode", False),
    "empty": BadCase(lambda px: None, b"dev-a", "invalid_json", "decode", False),
    "truncated-msgpack": BadCase(
        lambda px: request_value(px, "dev-a", 5, codec="msgpack")[:-7],
        b"dev-a",
        "invalid_msgpack",
        "decode",
        False,
    ),
    "missing-field": BadCase(
        lambda px: _json_without("seq", px), b"dev-a", "missing_field", "decode", True
    ),
    # rejected after the value parsed: whatever had the right type is kept (issue 10, item 4)
    "negative-shape": BadCase(
        lambda px: _json_with(px, tensor_shape=[-8, 8]), b"dev-a", "bad_shape", "decode", True
    ),
    "msgpack-negative-shape": BadCase(
        lambda px: _json_with(px, "msgpack", tensor_shape=[-8, 8]),
        b"dev-a", "bad_shape", "decode", True,
    ),
    "data-length": BadCase(
        lambda px: _json_with(px, tensor_shape=[4, 8]), b"dev-a", "bad_tensor", "decode", True
    ),
    "seq-as-text": BadCase(
        lambda px: _json_with(px, seq="5"), b"dev-a", "wrong_type", "decode", True
    ),
    "ts-in-milliseconds": BadCase(
        lambda px: _json_with(px, ts=1_700_000_000_000.0), b"dev-a", "bad_timestamp", "decode",
        True,
    ),
    "msgpack-no-tensor": BadCase(
        lambda px: _json_with(px, "msgpack", tensor=None), b"dev-a", "missing_field", "decode",
        True,
    ),
    "too-large": BadCase(
        lambda px: b"{" + b" " * (1 << 20) + b"}", b"dev-a", "too_large", "decode", False
    ),
    "unknown-model": BadCase(
        lambda px: request_value(px, "dev-a", 5, model="mnist"),
        b"dev-a",
        "unknown_model",
        "validate",
        True,
    ),
    "wrong-dtype": BadCase(
        lambda px: request_value(px.astype(np.int32), "dev-a", 5),
        b"dev-a",
        "bad_dtype",
        "validate",
        True,
    ),
    "wrong-shape": BadCase(
        lambda px: request_value(px.ravel(), "dev-a", 5), b"dev-a", "bad_shape", "validate", True
    ),
    "image-only": BadCase(  # digits takes PNG/JPEG images; b"\x89PNG" is not one
        lambda px: _image_only(), b"dev-a", "undecodable_image", "validate", True
    ),
    "key-not-device": BadCase(
        lambda px: request_value(px, "dev-a", 5), b"dev-b", "key_mismatch", "validate", True
    ),
    "no-key": BadCase(
        lambda px: request_value(px, "dev-a", 5), None, "empty_key", "validate", True
    ),
}


@pytest.mark.parametrize("case", list(BAD_CASES.values()), ids=list(BAD_CASES))
async def test_bad_input_becomes_one_dead_letter(
    start_pipeline: StartPipeline,
    onnx_engine: Engine,
    images: np.ndarray,
    offline_probs: Callable[[int], np.ndarray],
    case: BadCase,
) -> None:
    sink, source, seen = FakeSink(), Source(), Recorder()
    metrics = Metrics(["digits"], max_batch_size=4, process_metrics=False)
    pipeline = await start_pipeline(
        ThreadExecutor(onnx_engine), sink, observers=[seen, metrics]
    )
    before = good(source, images[3], "dev-a", 4)
    value = case.value(images[5])
    bad = source.message(value, case.key)
    after = good(source, images[7], "dev-a", 6)
    for message in (before, bad, after):
        await pipeline.handle(message)

    await wait_for(lambda: len(source.acked) == 3)

    assert [s.topic for s in sink.sent] == ["inference-result", "inference-dlq", "inference-result"]
    assert [r["seq"] for r in results_of(sink, pipeline)] == [4, 6]
    assert [r["outputs"]["top_k"][0]["label"] for r in results_of(sink, pipeline)] == [
        top_label(offline_probs(3)),
        top_label(offline_probs(7)),
    ]
    assert sink.sent[1].key == case.key
    (letter,) = dead_letters_of(sink, pipeline)
    if len(value or b"") > pipeline.settings.max_dead_letter_value_bytes:
        # too big to carry in a dead letter: its size and digest instead
        assert letter.value == b""
        assert letter.extra["value_omitted"] == {
            "bytes": len(value), "sha256": hashlib.sha256(value).hexdigest()
        }
    else:
        assert letter.value == (value or b"")
    assert letter.key == case.key
    assert letter.error["reason"] == case.reason
    assert case.reason in REASONS
    assert letter.error["stage"] == case.stage
    assert letter.error["type"] == "InvalidRequestError"
    assert letter.error["message"]
    assert letter.source == {"topic": REQUEST_TOPIC, "partition": PARTITION, "offset": bad.offset}
    assert letter.attempts == 1 and letter.worker == WORKER
    (rejected,) = [o for o in seen.outcomes if o.kind == "dead_letter"]
    named = "mnist" if case.reason == "unknown_model" else "digits"
    if case.readable:
        assert (letter.request_id, letter.device_id) == ("dev-a-5", "dev-a")
        assert (rejected.request_id, rejected.device_id, rejected.model) == (
            "dev-a-5", "dev-a", named
        )
    else:
        assert (letter.request_id, letter.device_id) == (None, None)
        assert rejected.model is None
    # /metrics counts it under the (loaded) model it named, when that could be read
    label = named if case.readable and named == "digits" else "unknown"
    dead = metrics.dead_letters.labels(label, case.reason)
    assert dead._value.get() == 1
    assert pipeline.stats.dead_letters == {case.reason: 1}
    assert source.acked == [before.offset, bad.offset, after.offset]


async def test_mixed_stream_is_answered_in_read_order(
    start_pipeline: StartPipeline,
    onnx_engine: Engine,
    images: np.ndarray,
    offline_probs: Callable[[int], np.ndarray],
) -> None:
    sink, source = FakeSink(), Source()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink, max_batch_size=3)
    expected: list[tuple[str, str | int]] = []  # ("result", image index) or ("dlq", reason)
    seqs = itertools.count()
    for n, case in enumerate(BAD_CASES.values()):
        i = 20 + n
        device = "dev-a" if n % 2 else "dev-b"
        await pipeline.handle(good(source, images[i], device, next(seqs)))
        expected.append(("result", i))
        await pipeline.handle(source.message(case.value(images[i]), case.key))
        expected.append(("dlq", case.reason))

    await wait_for(lambda: len(source.acked) == len(expected))

    got: list[tuple[str, str | int]] = []
    results = iter(results_of(sink, pipeline))
    letters = iter(dead_letters_of(sink, pipeline))
    for sent, (kind, what) in zip(sink.sent, expected, strict=True):
        if sent.topic == "inference-result":
            result = next(results)
            assert kind == "result"
            assert result["outputs"]["top_k"][0]["label"] == top_label(offline_probs(int(what)))
            got.append(("result", what))
        else:
            got.append(("dlq", next(letters).error["reason"]))
    assert got == expected
    assert source.acked == sorted(source.acked)


# -- ordering across batches ---------------------------------------------------------------------


class RecordingExecutor(ThreadExecutor):
    """A ThreadExecutor that records the requests of every batch in the order batches finish."""

    def __init__(self, engine: Engine, **kwargs: Any) -> None:
        super().__init__(engine, **kwargs)
        self.finished: list[list[float]] = []

    async def run(self, items: Sequence[Item]) -> dict[str, np.ndarray]:
        outputs = await super().run(items)
        self.finished.append([float(item["input"].sum()) for item in items])
        return outputs


async def test_device_order_kept_when_batches_finish_out_of_order(
    start_pipeline: StartPipeline, digits_config: ModelConfig, images: np.ndarray
) -> None:
    release = threading.Event()
    marker = np.full((8, 8), 16, dtype=np.uint8)  # pre-processed to all ones: sum 64

    def hold_first_batch(item: np.ndarray) -> None:
        if item.sum() == 64.0:
            release.wait(timeout=10)
        return None

    engine = FakeEngine(fail_on=hold_first_batch)
    executor = RecordingExecutor(engine, max_inflight=2)
    sink, source = FakeSink(), Source()
    pipeline = await start_pipeline(
        executor, sink, max_batch_size=2, max_batch_delay_ms=60_000.0, max_inflight_batches=2
    )
    pixels = {
        ("dev-a", 0): marker,
        ("dev-b", 0): images[1],
        ("dev-a", 1): images[2],
        ("dev-b", 1): images[3],
    }
    try:
        for device, seq in pixels:  # batch 1: a0, b0 (held); batch 2: a1, b1
            await pipeline.handle(good(source, pixels[device, seq], device, seq))

        await wait_for(lambda: len(executor.finished) == 1)
        second = [float(np.sum(images[i] / 16.0)) for i in (2, 3)]
        assert executor.finished == [pytest.approx(second)]  # batch 2 is done, batch 1 is not
        await settle()
        assert sink.sent == []  # nothing overtakes the held batch
    finally:
        release.set()

    await wait_for(lambda: len(source.acked) == 4)

    assert engine.batch_sizes == [2, 2]
    assert len(executor.finished) == 2 and executor.finished[1][0] == 64.0
    results = results_of(sink, pipeline)
    assert [(r["device_id"], r["seq"]) for r in results] == list(pixels)
    for r in results:
        x = (pixels[r["device_id"], r["seq"]].astype(np.float32) / 16).reshape(1, 1, 8, 8)
        assert r["outputs"]["top_k"][0]["label"] == top_label(engine.predict({"input": x})["probs"])
        assert r["engine"] == engine.info.tag and r["batch_size"] == 2
    assert len({r["batch_id"] for r in results}) == 2
    assert [s.key for s in sink.sent] == [b"dev-a", b"dev-b", b"dev-a", b"dev-b"]


# -- engine failures: bisection, retries, dead letters --------------------------------------------


POISON = np.float32(15.5)  # real digit pixels are integers 0..16, so 15.5 marks a test item


def poison_pixels(images: np.ndarray, i: int) -> np.ndarray:
    pixels = images[i].astype(np.float32)
    pixels[0, 0] = POISON
    return pixels


def is_poison(item: np.ndarray) -> bool:
    return bool(item.flat[0] == POISON / 16)


async def test_a_transiently_failed_batch_is_bisected_and_every_request_answered(
    start_pipeline: StartPipeline, images: np.ndarray
) -> None:
    engine = FakeEngine(fail_batches=1)
    sink, source = FakeSink(), Source()
    pipeline = await start_pipeline(
        ThreadExecutor(engine, max_inflight=1), sink, max_batch_size=4,
        max_batch_delay_ms=60_000.0,
    )
    for seq in range(4):
        await pipeline.handle(good(source, images[seq], "dev-a", seq))
    await wait_for(lambda: len(source.acked) == 4)

    assert [r["seq"] for r in results_of(sink, pipeline)] == [0, 1, 2, 3]
    assert dead_letters_of(sink, pipeline) == []
    assert engine.batch_sizes == [4, 1, 1, 1, 1]  # the failed batch, then each request alone
    assert pipeline.stats.bisections == 1


async def _poisoned_64(start_pipeline: StartPipeline, images: np.ndarray, batch: int
                       ) -> tuple[FakeEngine, FakeSink, InferencePipeline]:
    """64 requests of 8 devices through an engine that fails any batch holding request 37,
    in batches of ``batch`` that close only full; returns once every record is acked."""
    def fail_on(item: np.ndarray) -> Any:
        return InputSpecError("poison item") if is_poison(item) else None

    engine = FakeEngine(fail_on=fail_on)
    sink, source = FakeSink(), Source()
    pipeline = await start_pipeline(
        ThreadExecutor(engine, max_inflight=1), sink, max_batch_size=batch,
        max_batch_delay_ms=60_000.0,
    )
    for seq in range(64):
        pixels = poison_pixels(images, seq) if seq == 37 else images[seq]
        await pipeline.handle(good(source, pixels, f"dev-{seq % 8}", seq))
    await wait_for(lambda: len(source.acked) == 64)
    return engine, sink, pipeline


async def test_one_poison_request_in_a_batch_of_64_fails_alone(
    start_pipeline: StartPipeline, images: np.ndarray
) -> None:
    engine, sink, pipeline = await _poisoned_64(start_pipeline, images, 64)

    results = results_of(sink, pipeline)
    letters = dead_letters_of(sink, pipeline)
    assert len(results) == 63 and 37 not in {r["seq"] for r in results}
    assert [(d.request_id, d.error["reason"], d.attempts) for d in letters] == [
        ("dev-5-37", "inference_failed", 1)
    ]
    assert engine.batch_sizes == [64] + [1] * 64  # the failed batch, then each request alone


class RecordingFaultyEngine(FaultyEngine):
    """A :class:`FaultyEngine` that records every batch it is given: the items (their bytes)
    and whether it failed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[list[bytes], bool]] = []

    def infer_impl(self, feeds: Any) -> dict[str, np.ndarray]:
        items = [np.asarray(x).tobytes() for x in feeds[self.inputs[0].name]]
        try:
            out = super().infer_impl(feeds)
        except Exception:
            self.calls.append((items, True))
            raise
        self.calls.append((items, False))
        return out

    def runs_of(self, pixels: np.ndarray) -> list[tuple[int, bool]]:
        """``(batch size, failed)`` of every call that held the item of these raw pixels."""
        item = (pixels.astype(np.float32) / 16.0).reshape(1, 8, 8).tobytes()
        return [(len(items), failed) for items, failed in self.calls if item in items]


#: The issue-19 fault: every batch holding an item whose first pixel is the marker fails
#: (retriable). The issue used -1, which the digits model's value range (0-16) now refuses at
#: intake, so the marker is POISON (15.5), inside the range.
MARKED_RULE = {"match_first_value": float(POISON) / 16.0, "kind": "runtime"}


async def test_a_poison_request_costs_each_neighbour_one_extra_engine_run(
    start_pipeline: StartPipeline, images: np.ndarray
) -> None:
    engine = RecordingFaultyEngine(FakeEngine(), [MARKED_RULE])
    sink, source = FakeSink(), Source()
    pipeline = await start_pipeline(
        ThreadExecutor(engine, max_inflight=2), sink, max_batch_size=8,
        max_batch_delay_ms=60_000.0,
    )
    frames = [poison_pixels(images, i) if i == 3 else images[i].astype(np.float32)
              for i in range(8)]
    assert len({f.tobytes() for f in frames}) == 8
    await pipeline.handle_many([
        good(source, f, "bad" if i == 3 else f"ok-{i}", 0) for i, f in enumerate(frames)
    ])
    await wait_for(lambda: len(source.acked) == 8)

    assert sorted(r["device_id"] for r in results_of(sink, pipeline)) == sorted(
        f"ok-{i}" for i in range(8) if i != 3
    )
    assert [r.request_id for r in retry_records(sink, pipeline)] == ["bad-0"]
    for i, f in enumerate(frames):
        runs = engine.runs_of(f)
        assert runs[0] == (8, True)  # the batch the poison failed
        assert len(runs) == 2, (i, runs)  # then once more, alone: one extra run each
        assert runs[1] == (1, i == 3)
    assert len(engine.calls) == 1 + 8


async def test_retries_and_a_failing_device_run_alone_never_with_healthy_requests(
    start_pipeline: StartPipeline, images: np.ndarray
) -> None:
    engine = RecordingFaultyEngine(FakeEngine(), [MARKED_RULE])
    sink, source, store = FakeSink(), Source(), MemoryRetryStore()
    pipeline = await start_pipeline(
        ThreadExecutor(engine, max_inflight=2), sink, max_batch_size=4,
        max_batch_delay_ms=20.0, retry_store=store, max_retries=1,
    )
    poison = poison_pixels(images, 0)
    await pipeline.handle_many([
        good(source, poison, "bad", 0),
        *(good(source, images[i], f"ok-{i}", 0) for i in (1, 2, 3)),
    ])
    await wait_for(lambda: len(retry_records(sink, pipeline)) == 1)
    calls_before = len(engine.calls)

    # The retry, the bad device's next request and fresh healthy requests, read together.
    (record,) = retry_records(sink, pipeline)
    store.record_attempt(record, None)
    retry = source.message(record.value, record.key)
    retry.retry = record
    healthy = [images[i].astype(np.float32) for i in (4, 5, 6, 7)]
    await pipeline.handle_many([
        retry,
        good(source, poison_pixels(images, 8), "bad", 1),
        *(good(source, f, f"ok-{i}", 1) for i, f in enumerate(healthy)),
    ])
    await wait_for(lambda: len(source.acked) == 4 + 6)

    later = engine.calls[calls_before:]
    assert all(not failed for items, failed in later if len(items) > 1)
    assert sorted(len(items) for items, _ in later) == [1, 1, 4]
    for f in healthy:
        assert engine.runs_of(f) == [(4, False)]  # no extra run at all
    (letter,) = dead_letters_of(sink, pipeline)
    assert (letter.request_id, letter.error["reason"]) == ("bad-0", "retries_exhausted")
    assert [r.request_id for r in retry_records(sink, pipeline)] == ["bad-0", "bad-1"]


async def test_a_batch_failing_whole_quarantines_no_device(
    start_pipeline: StartPipeline, images: np.ndarray
) -> None:
    # The engine fails the batch and every request run alone: nothing points at one request.
    engine = RecordingFaultyEngine(FakeEngine(), [{"kind": "runtime", "times": 5}])
    sink, source = FakeSink(), Source()
    pipeline = await start_pipeline(
        ThreadExecutor(engine, max_inflight=2), sink, max_batch_size=4,
        max_batch_delay_ms=60_000.0,
    )
    await pipeline.handle_many([good(source, images[i], f"dev-{i}", 0) for i in range(4)])
    await wait_for(lambda: len(retry_records(sink, pipeline)) == 4)
    await pipeline.handle_many([good(source, images[i], f"dev-{i}", 1) for i in range(4, 8)])
    await wait_for(lambda: len(results_of(sink, pipeline)) == 4)

    assert [(len(items), failed) for items, failed in engine.calls] == [
        (4, True), (1, True), (1, True), (1, True), (1, True), (4, False),
    ]


class FlakyOn:
    """Fails poison items with a retriable error the first ``times`` times each is seen."""

    def __init__(self, times: int) -> None:
        self.times = times
        self.seen = 0

    def __call__(self, item: np.ndarray) -> Any:
        if not is_poison(item):
            return None
        self.seen += 1
        return EngineRuntimeError("flaky") if self.seen <= self.times else None


def retry_records(sink: FakeSink, pipeline: InferencePipeline) -> list[RetryRecord]:
    return [RetryRecord.decode(s.value) for s in sink.sent
            if s.topic == pipeline.settings.retry_topic]


async def feed_retry(
    pipeline: InferencePipeline, source: Source, store: MemoryRetryStore, record: RetryRecord
) -> None:
    """What the retry agent does with a record of the retry topic once it is due."""
    store.record_attempt(record, None)
    message = source.message(record.value, record.key)
    message.retry = record
    await pipeline.handle(message)


async def test_a_request_failing_twice_then_succeeding_gets_one_result_with_attempt_2(
    start_pipeline: StartPipeline, images: np.ndarray
) -> None:
    flaky = FlakyOn(times=2)
    engine = FakeEngine(fail_on=flaky)
    sink, source, store = FakeSink(), Source(), MemoryRetryStore()
    pipeline = await start_pipeline(
        ThreadExecutor(engine, max_inflight=1), sink, max_batch_size=1, max_retries=3,
        retry_store=store,
    )
    original = good(source, poison_pixels(images, 3), "dev-a", 0)
    await pipeline.handle(original)
    for attempt in (1, 2):
        await wait_for(lambda a=attempt: len(retry_records(sink, pipeline)) == a)
        record = retry_records(sink, pipeline)[-1]
        assert record.attempt == attempt and len(record.errors) == attempt
        assert record.value == original.value and record.key == b"dev-a"
        assert record.source["offset"] == original.offset
        assert record.not_before > record.errors[-1]["ts"]  # a backoff was applied
        await feed_retry(pipeline, source, store, record)
        assert store.rows["dev-a-0"]["attempts"] == attempt
    await wait_for(lambda: len(results_of(sink, pipeline)) == 1)

    (result,) = results_of(sink, pipeline)
    assert (result["request_id"], result["attempt"]) == ("dev-a-0", 2)
    assert dead_letters_of(sink, pipeline) == []
    assert store.rows == {}  # the counter row is removed when the request finishes
    retry_keys = [s.key for s in sink.sent if s.topic == pipeline.settings.retry_topic]
    assert retry_keys == [b"dev-a-0", b"dev-a-0"]  # keyed by request_id


async def test_a_request_failing_always_ends_in_one_dead_letter_with_every_attempt(
    start_pipeline: StartPipeline, images: np.ndarray
) -> None:
    engine = FakeEngine(fail_on=FlakyOn(times=1_000))
    sink, source, store = FakeSink(), Source(), MemoryRetryStore()
    pipeline = await start_pipeline(
        ThreadExecutor(engine, max_inflight=1), sink, max_batch_size=1, max_retries=2,
        retry_store=store,
    )
    original = good(source, poison_pixels(images, 3), "dev-a", 0)
    await pipeline.handle(original)
    for attempt in (1, 2):
        await wait_for(lambda a=attempt: len(retry_records(sink, pipeline)) == a)
        await feed_retry(pipeline, source, store, retry_records(sink, pipeline)[-1])
    await wait_for(lambda: len(dead_letters_of(sink, pipeline)) == 1)

    (letter,) = dead_letters_of(sink, pipeline)
    assert letter.error["reason"] == "retries_exhausted"
    assert letter.attempts == 3  # max_retries + 1
    assert [e["attempt"] for e in letter.errors] == [0, 1, 2]
    assert {e["reason"] for e in letter.errors} == {"engine_runtime_error"}
    assert letter.value == original.value and letter.source["offset"] == original.offset
    assert results_of(sink, pipeline) == []
    assert store.rows == {}


async def test_a_duplicated_request_id_in_one_batch_is_answered_once(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray
) -> None:
    sink, source = FakeSink(), Source()
    pipeline = await start_pipeline(
        ThreadExecutor(onnx_engine), sink, max_batch_size=3, max_batch_delay_ms=60_000.0
    )
    await pipeline.handle(good(source, images[0], "dev-a", 0))
    await pipeline.handle(good(source, images[0], "dev-a", 0))  # same request_id
    await pipeline.handle(good(source, images[1], "dev-a", 1))
    await wait_for(lambda: len(source.acked) == 3)

    assert [r["request_id"] for r in results_of(sink, pipeline)] == ["dev-a-0", "dev-a-1"]
    (letter,) = dead_letters_of(sink, pipeline)
    assert (letter.request_id, letter.error["reason"]) == ("dev-a-0", "duplicate_request_id")
    assert letter.source["offset"] == 101


class PickySink(FakeSink):
    """Refuses the first record sent to a topic with the given error."""

    def __init__(self, topic: str, error: BaseException) -> None:
        super().__init__()
        self.refuse_topic, self.error = topic, error

    async def send(self, topic: str, key: bytes | None, value: bytes) -> asyncio.Future[None]:
        if topic == self.refuse_topic and self.error is not None:
            error, self.error = self.error, None  # type: ignore[assignment]
            raise error
        return await super().send(topic, key, value)


async def test_an_outcome_too_large_to_produce_becomes_a_small_dead_letter(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray
) -> None:
    from aiokafka.errors import MessageSizeTooLargeError

    sink, source = PickySink("inference-result", MessageSizeTooLargeError("too big")), Source()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink, max_batch_size=1)
    message = good(source, images[0], "dev-a", 0)
    await pipeline.handle(message)
    await wait_for(lambda: len(source.acked) == 1)

    assert results_of(sink, pipeline) == []
    (letter,) = dead_letters_of(sink, pipeline)
    assert letter.error["reason"] == "unproducible_outcome"
    assert "MessageSizeTooLargeError" in letter.error["message"]
    assert letter.request_id == "dev-a-0" and letter.value == b""
    assert letter.extra["value_omitted"]["bytes"] == len(message.value or b"")


async def test_a_failing_producer_leaves_the_record_unacknowledged_not_dead_lettered(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray
) -> None:
    from aiokafka.errors import KafkaConnectionError

    sink, source = PickySink("inference-result", KafkaConnectionError("broker gone")), Source()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink, max_batch_size=1)
    await pipeline.handle(good(source, images[0], "dev-a", 0))
    await pipeline.handle(good(source, images[1], "dev-a", 1))
    await wait_for(lambda: len(source.acked) == 1)

    assert source.acked == [101]  # the first record stays uncommitted: it is read again later
    assert [r["seq"] for r in results_of(sink, pipeline)] == [1]
    assert dead_letters_of(sink, pipeline) == []
    assert pipeline.stats.produce_failures == 1


# -- outcomes that cannot be produced (issue 10, item 1) -----------------------------------------


def _long_id_request(pixels: np.ndarray, *, request_id: str, device: str = "dev-a") -> bytes:
    body = json.loads(request_value(pixels, device, 0))
    body["request_id"] = request_id
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("name", "make"),
    [
        # a valid request whose result (it repeats the request_id) is over the producer limit
        ("long-request-id", lambda px: (
            b"dev-a", _long_id_request(px, request_id="r" * 999_600), "r" * 999_600, "dev-a")),
        # a 600,000-character device id (the key matches): dead-lettered as bad_device_id,
        # and that letter, holding key and value, is 1.4 MB (its ids already cut to 256)
        ("long-device-id", lambda px: (
            b"d" * 600_000, json.dumps({**json.loads(request_value(px, "d" * 600_000, 0)),
                                        "request_id": "long-dev"}).encode(),
            "long-dev", "d" * 256)),
        # an 800,000-byte key with value [1]: its own dead letter would be 1.87 MB
        ("huge-key-bad-value", lambda px: (b"k" * 800_000, b"[1]", None, None)),
    ],
)
async def test_an_outcome_over_the_producer_limit_becomes_a_small_dead_letter_before_producing(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray, name: str,
    make: Callable[[np.ndarray], tuple[bytes, bytes, str | None, str | None]],
) -> None:
    key, value, request_id, device_id = make(images[0])
    sink, source = FakeSink(), Source()
    pipeline = await start_pipeline(
        ThreadExecutor(onnx_engine), sink, max_batch_size=1, max_request_bytes=2_000_000
    )
    bad = source.message(value, key)
    await pipeline.handle(bad)
    await pipeline.handle(good(source, images[1], "dev-a", 1))
    await wait_for(lambda: len(source.acked) == 2)

    assert source.acked == [bad.offset, bad.offset + 1]  # the partition's commit moves on
    assert [r["seq"] for r in results_of(sink, pipeline)] == [1]
    (letter,) = dead_letters_of(sink, pipeline)
    assert all(len(s.value) + len(s.key or b"") < 1_000_000 for s in sink.sent)
    assert letter.error["reason"] == "unproducible_outcome"
    assert letter.error["stage"] == "produce"
    assert "max_produce_bytes=1000000" in letter.error["message"]
    assert letter.source == {"topic": REQUEST_TOPIC, "partition": PARTITION, "offset": bad.offset}
    assert letter.value == b"" and letter.extra["value_omitted"] == {
        "bytes": len(value), "sha256": hashlib.sha256(value).hexdigest()
    }
    # ids cut to 256 characters, their lengths kept; a long key is cut the same way
    assert letter.request_id == (request_id[:256] if request_id else None)
    assert letter.device_id == (device_id[:256] if device_id else None)
    long_ids = {n: len(v) for n, v in (("request_id", request_id), ("device_id", device_id))
                if v is not None and len(v) > 256}
    assert letter.extra.get("ids_truncated", {}) == long_ids
    assert letter.key == key[:256]
    if len(key) > 256:
        assert letter.extra["key_omitted"] == {
            "bytes": len(key), "sha256": hashlib.sha256(key).hexdigest()
        }
    assert pipeline.stats.dead_letters.get("unproducible_outcome") == 1


class RefusingSink(FakeSink):
    """Accepts every record, then the broker refuses those of ``topics`` (their ack futures
    fail with ``error``); raising ``send_error`` from ``send`` itself for ``raise_topics``."""

    def __init__(self, topics: set[str], error: BaseException,
                 raise_topics: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__()
        self.topics, self.error, self.raise_topics = topics, error, raise_topics

    async def send(self, topic: str, key: bytes | None, value: bytes) -> asyncio.Future[None]:
        if topic in self.raise_topics:
            raise self.error
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sent.append(Sent(topic, key, value, future))
        if topic in self.topics:
            future.set_exception(self.error)
        else:
            future.set_result(None)
        return future


async def test_a_result_the_broker_refuses_for_good_is_answered_by_a_small_dead_letter(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray
) -> None:
    from aiokafka.errors import MessageSizeTooLargeError

    # e.g. the result topic's max.message.bytes is below the producer's limit
    sink, source = RefusingSink({"inference-result"}, MessageSizeTooLargeError()), Source()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink, max_batch_size=1)
    message = good(source, images[0], "dev-a", 0)
    await pipeline.handle(message)
    await wait_for(lambda: len(source.acked) == 1)

    (letter,) = dead_letters_of(sink, pipeline)
    assert (letter.request_id, letter.error["reason"]) == ("dev-a-0", "unproducible_outcome")
    assert letter.source["offset"] == message.offset
    assert pipeline.stats.unwritable == 0


async def test_a_record_with_no_producible_outcome_is_still_finished_and_counted(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from aiokafka.errors import MessageSizeTooLargeError
    from faust.exceptions import ProducerSendError

    # Faust wraps the producer's error; neither the result nor the dead letter can be written
    refused = ProducerSendError("Error while sending")
    refused.__cause__ = MessageSizeTooLargeError()
    sink = RefusingSink(set(), refused, raise_topics={"inference-result", "inference-dlq"})
    source = Source()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink, max_batch_size=1)
    first = good(source, images[0], "dev-a", 0)
    await pipeline.handle(first)
    await wait_for(lambda: len(source.acked) == 1)

    assert source.acked == [first.offset]  # never a reason to stop committing the partition
    assert sink.sent == []
    assert pipeline.stats.unwritable == 1
    assert any(r.levelname == "ERROR" and f"{REQUEST_TOPIC}[{PARTITION}]@{first.offset}"
               in r.getMessage() for r in caplog.records)


async def test_a_refused_dead_letter_is_not_replaced_again_and_the_record_finishes(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray
) -> None:
    from aiokafka.errors import RecordListTooLargeError

    sink = RefusingSink({"inference-dlq"}, RecordListTooLargeError())
    source = Source()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink, max_batch_size=1)
    bad = source.message(b"[1]", b"dev-a")
    await pipeline.handle(bad)
    await wait_for(lambda: len(source.acked) == 1)

    reasons = [decode_dead_letter(s.value).error["reason"] for s in sink.sent]
    assert reasons == ["wrong_type", "unproducible_outcome"]  # then nothing more is tried
    assert pipeline.stats.unwritable == 1


# -- untrusted device clocks (issue 10, item 3) --------------------------------------------------


@dataclass
class _Message:
    topic: str
    key: bytes
    timestamp: float


@dataclass
class _Event:
    message: _Message


@pytest.mark.parametrize("skew_s", [82_800.0, -7_200.0, -86_400.0 * 3], ids=["ahead-23h",
                                                                               "behind-2h",
                                                                               "behind-3d"])
@pytest.mark.parametrize("stamped", [True, False], ids=["record-timestamp", "no-timestamp"])
async def test_a_wrong_device_clock_does_not_distort_latency_stats_or_windows(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray, skew_s: float,
    stamped: bool,
) -> None:
    import time

    from streamapp.tables import (
        DeviceStateObserver,
        DeviceStateReader,
        MemoryDeviceTables,
        WindowPlan,
    )

    tables = MemoryDeviceTables()
    plan = WindowPlan(tumbling_ms=60_000, hopping_ms=120_000, step_ms=60_000,
                      expires_ms=600_000)
    observer = DeviceStateObserver(tables, plan, request_topic=REQUEST_TOPIC, ewma_alpha=0.2)
    sink, source = FakeSink(), Source()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink, max_batch_size=1,
                                    observers=[observer])
    for seq in range(21):
        now = time.time()
        ts = now + skew_s if seq == 0 else now - 0.05  # one request from a wrong clock
        body = json.loads(request_value(images[seq], "dev-c", seq))
        body["ts"] = ts
        message = source.message(json.dumps(body).encode(), b"dev-c")
        if stamped:  # the record reached Kafka 20 ms before the worker read it
            message.event = _Event(_Message(REQUEST_TOPIC, b"dev-c", now - 0.02))
        await pipeline.handle(message)
        await wait_for(lambda s=seq: len(source.acked) == s + 1)

    results = results_of(sink, pipeline)
    first = results[0]
    assert 0.0 <= first["e2e_ms"] < 5_000.0  # from the record timestamp / read time, not ts
    assert first["clock_skew_ms"] == pytest.approx(skew_s * 1000.0, abs=5_000.0)
    assert all(r["clock_skew_ms"] is None for r in results[1:])
    assert all(0.0 <= r["e2e_ms"] < 5_000.0 for r in results)
    stats = DeviceStateReader(tables, plan).stats(b"dev-c")
    assert stats is not None
    assert 0.0 <= stats["latency_ewma_ms"]["e2e"] < 5_000.0
    assert stats["clock_skew"]["count"] == 1
    assert stats["clock_skew"]["last_ms"] == first["clock_skew_ms"]
    windows = DeviceStateReader(tables, plan).windows(b"dev-c", "tumbling", 2)
    assert windows is not None
    means = [w["e2e_mean_ms"] for w in windows if w["results"]]
    assert means and all(0.0 <= m < 5_000.0 for m in means)


async def test_a_clock_within_the_skew_bound_is_trusted_and_never_gives_a_negative_latency(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray
) -> None:
    import time

    sink, source = FakeSink(), Source()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink, max_batch_size=1)
    for seq, offset_s in enumerate((-30.0, 2.0)):  # 30 s old (trusted), 2 s ahead (trusted)
        body = json.loads(request_value(images[seq], "dev-c", seq))
        body["ts"] = time.time() + offset_s
        await pipeline.handle(source.message(json.dumps(body).encode(), b"dev-c"))
    await wait_for(lambda: len(source.acked) == 2)

    old, ahead = results_of(sink, pipeline)
    assert old["e2e_ms"] >= 30_000.0 and old["clock_skew_ms"] is None
    assert ahead["e2e_ms"] == 0.0 and ahead["clock_skew_ms"] is None


# -- the batched produce path (BatchSink.send_many) ----------------------------------------------


@dataclass
class BatchFakeSink(FakeSink):
    """A sink with ``send_many``: one future per call and topic (a record batch), resolved by
    the test, or failed with ``refuse`` for the topics in ``refused``."""

    calls: list[list[tuple[str, bytes | None, bytes]]] = field(default_factory=list)
    batches: list[asyncio.Future[None]] = field(default_factory=list)
    refused: set[str] = field(default_factory=set)

    async def send_many(
        self, records: Sequence[tuple[str, bytes | None, bytes]]
    ) -> list[Any]:
        self.calls.append(list(records))
        futures: dict[str, asyncio.Future[None]] = {}
        out = []
        for topic, key, value in records:
            future = futures.get(topic)
            if future is None:
                future = futures[topic] = asyncio.get_running_loop().create_future()
                self.batches.append(future)
                if topic in self.refused:
                    from aiokafka.errors import MessageSizeTooLargeError

                    future.set_exception(MessageSizeTooLargeError())
                elif self.auto_resolve:
                    future.set_result(None)
            self.sent.append(Sent(topic, key, value, future))
            out.append(future)
        return out


class StateWriter(Recorder):
    """An observer whose ``flush`` writes device state: commits must wait for it."""

    writes_state = True

    def __init__(self) -> None:
        super().__init__()
        self.flushed_outcomes = 0

    async def flush(self) -> None:
        self.flushed_outcomes = len(self.outcomes)


async def test_a_batch_of_outcomes_is_handed_over_in_one_call_and_acked_with_its_batch(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray,
    offline_probs: Callable[[int], np.ndarray],
) -> None:
    sink, source = BatchFakeSink(auto_resolve=False), Source()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink, max_batch_size=8,
                                    max_batch_delay_ms=10_000, state_flush_interval_ms=0)
    messages = [good(source, images[i], f"dev-{i % 3}", i // 3) for i in range(8)]
    messages.insert(3, source.message(b"not a request", b"dev-0"))
    await pipeline.handle_many(messages)
    await wait_for(lambda: len(sink.sent) == 9)

    (call,) = sink.calls  # the batch closed full: every outcome in one call, in read order
    assert [t for t, _, _ in call] == ["inference-result"] * 3 + ["inference-dlq"] + \
        ["inference-result"] * 5
    results = [json.loads(v) for t, _, v in call if t == "inference-result"]
    assert [r["request_id"] for r in results] == [f"dev-{i % 3}-{i // 3}" for i in range(8)]
    for i, result in enumerate(results):
        assert result["outputs"]["top_k"][0]["label"] == top_label(offline_probs(i))
    await settle()
    assert source.acked == []  # handed over, not acknowledged by the broker yet
    result_batch, dlq_batch = sink.batches
    dlq_batch.set_result(None)
    await wait_for(lambda: len(source.acked) == 1)
    assert source.acked == [messages[3].offset]
    result_batch.set_result(None)
    await wait_for(lambda: len(source.acked) == 9)
    assert sorted(source.acked) == sorted(m.offset for m in messages)


async def _held_acks_pipeline(
    start_pipeline: StartPipeline, engine: Engine, state: StateWriter, **settings: Any
) -> tuple[InferencePipeline, Source]:
    """A pipeline whose acks wait for ``state``'s flush (an hour-long interval: only an
    explicit flush or ``state_flush_max_records`` writes it), batches of 4."""
    pipeline = await start_pipeline(ThreadExecutor(engine), BatchFakeSink(auto_resolve=True),
                                    max_batch_size=4, max_batch_delay_ms=1.0,
                                    observers=[state], state_flush_interval_ms=3_600_000,
                                    **settings)
    return pipeline, Source()


async def _answer(pipeline: InferencePipeline, state: StateWriter,
                  messages: list[SourceMessage]) -> None:
    """Hand ``messages`` over and wait until their outcomes reached ``state``."""
    seen = len(state.outcomes)
    await pipeline.handle_many(messages)
    await wait_for(lambda: len(state.outcomes) == seen + len(messages))
    await settle()


async def test_acks_wait_for_the_state_flush_that_covers_their_outcomes(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray
) -> None:
    state = StateWriter()
    pipeline, source = await _held_acks_pipeline(start_pipeline, onnx_engine, state)
    messages = [good(source, images[i], "dev-a", i) for i in range(4)]
    await _answer(pipeline, state, messages)
    assert source.acked == [] and state.flushed_outcomes == 0  # broker has them; state not yet

    await pipeline.flush_state()
    assert state.flushed_outcomes == 4
    assert source.acked == [m.offset for m in messages]
    assert pipeline.stats.acked == 4


async def test_enough_held_acks_flush_the_state_before_the_interval(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray
) -> None:
    # state_flush_max_records bounds what a crash re-delivers at any rate: an hour-long
    # interval, yet the 8th finished record flushes the state and acks all eight.
    state = StateWriter()
    pipeline, source = await _held_acks_pipeline(start_pipeline, onnx_engine, state,
                                                 state_flush_max_records=8)
    first = [good(source, images[i], "dev-a", i) for i in range(4)]
    await _answer(pipeline, state, first)
    assert source.acked == [] and state.flushed_outcomes == 0  # 4 of 8: still held

    second = [good(source, images[i], "dev-a", i) for i in range(4, 8)]
    await pipeline.handle_many(second)
    await wait_for(lambda: len(source.acked) == 8)
    assert state.flushed_outcomes == 8
    assert source.acked == [m.offset for m in first + second]


async def test_a_flush_waits_for_the_one_in_progress_before_the_commit_that_follows(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray
) -> None:
    # The periodic flush has taken the held acks and is still writing the state when a stop
    # flushes: that flush must return only once those acks are applied, since the commit
    # follows it (else the restarted worker answers those records again).
    class SlowWriter(StateWriter):
        def __init__(self) -> None:
            super().__init__()
            self.gate = asyncio.Event()
            self.entered = asyncio.Event()

        async def flush(self) -> None:
            if not self.entered.is_set():  # only the first flush is slow
                self.entered.set()
                await self.gate.wait()
            await super().flush()

    state = SlowWriter()
    pipeline, source = await _held_acks_pipeline(start_pipeline, onnx_engine, state)
    messages = [good(source, images[i], "dev-a", i) for i in range(4)]
    await _answer(pipeline, state, messages)
    first = asyncio.ensure_future(pipeline.flush_state())  # takes the 4 acks, then waits
    await asyncio.wait_for(state.entered.wait(), 5)
    second = asyncio.ensure_future(pipeline.flush_state())  # the stop's flush
    await settle()
    assert not second.done() and source.acked == []
    state.gate.set()
    await asyncio.wait_for(second, 5)
    assert source.acked == [m.offset for m in messages]  # applied before the commit
    await first


async def test_a_backlog_in_the_partitions_holds_a_batch_until_it_is_full(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray,
    offline_probs: Callable[[int], np.ndarray],
) -> None:
    # Records arrive in small chunks while the broker holds more beyond the last offset read
    # (the fetch high watermark): the batch waits for them instead of closing on its 5 ms delay.
    sink, source = BatchFakeSink(auto_resolve=True), Source()
    messages = [good(source, images[i], "dev-a", i) for i in range(8)]
    marks = {(messages[0].topic, messages[0].partition): messages[-1].offset + 1}
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink, max_batch_size=8,
                                    max_batch_delay_ms=5.0, max_batch_hold_ms=10_000,
                                    highwater=lambda t, p: marks.get((t, p)))
    for i in range(0, 8, 2):
        await pipeline.handle_many(messages[i:i + 2])
        assert pipeline.backlog() == 8 - (i + 2)
        await asyncio.sleep(0.02)  # 4 × the delay between chunks
    await wait_for(lambda: len(sink.sent) == 8)
    results = results_of(sink, pipeline)
    assert {r["batch_size"] for r in results} == {8}
    assert [r["outputs"]["top_k"][0]["label"] for r in results] == [
        top_label(offline_probs(i)) for i in range(8)]


async def test_a_record_batch_the_broker_refuses_is_sent_again_record_by_record(
    start_pipeline: StartPipeline, onnx_engine: Engine, images: np.ndarray
) -> None:
    # e.g. the result topic's max.message.bytes is below the producer's limit: each record of
    # the refused batch goes alone through the path that answers a refused one with a small
    # dead letter.
    from aiokafka.errors import MessageSizeTooLargeError

    class Sink(BatchFakeSink):
        async def send(self, topic: str, key: bytes | None, value: bytes) -> Any:
            future = await super().send(topic, key, value)
            if topic == "inference-result":
                future.set_exception(MessageSizeTooLargeError())
            elif not future.done():
                future.set_result(None)
            return future

    sink, source = Sink(auto_resolve=False, refused={"inference-result"}), Source()
    pipeline = await start_pipeline(ThreadExecutor(onnx_engine), sink, max_batch_size=2,
                                    max_batch_delay_ms=10_000, state_flush_interval_ms=0)
    messages = [good(source, images[i], "dev-a", i) for i in range(2)]
    await pipeline.handle_many(messages)
    await wait_for(lambda: len(source.acked) == 2)

    letters = dead_letters_of(sink, pipeline)
    assert sorted((d.request_id, d.error["reason"]) for d in letters) == [
        ("dev-a-0", "unproducible_outcome"), ("dev-a-1", "unproducible_outcome")]
    assert sorted(source.acked) == [m.offset for m in messages]


async def test_a_poison_batch_and_its_bisection_leave_no_garbage_for_the_cyclic_collector(
    start_pipeline: StartPipeline, images: np.ndarray
) -> None:
    """Batches closed full, one of them failed by a poison request and bisected, and the
    dead letter: what they held is freed by reference counting, not left in reference cycles
    for the cyclic collector, whose pauses are latency (issue 17)."""
    import gc

    from streamapp import batching

    gc.collect()
    gc.disable()
    try:
        gc.set_debug(gc.DEBUG_SAVEALL)
        _, sink, pipeline = await _poisoned_64(start_pipeline, images, 16)
        assert len(dead_letters_of(sink, pipeline)) == 1
        sink.sent.clear()
        gc.collect()
        kinds = (batching.Completion, batching._Slot, batching._Batch, SourceMessage,
                 InferenceRequest, TensorPayload, BaseException)
        left = sorted({type(o).__name__ for o in gc.garbage if isinstance(o, kinds)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []
