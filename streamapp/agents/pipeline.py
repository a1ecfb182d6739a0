"""The inference pipeline behind the request agent, independent of Faust.

For each source record: decode and validate (bad input becomes a dead letter with a reason
code), pre-process into an engine input item, micro-batch (:mod:`streamapp.batching`), run the
batch on the model's executor, post-process, and produce the result or dead letter. Outcomes are
produced in the order records were read, and a record is acknowledged only once the broker has
acknowledged what was produced for it; Faust then commits the contiguous acknowledged prefix of
each partition, so a crash can duplicate but never lose a request.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from engines.base import EngineInfo
from engines.exceptions import EngineError
from engines.executor import Executor
from streamapp.batching import Completion, MicroBatcher
from streamapp.codecs import decode_request, encode_dead_letter, encode_result
from streamapp.exceptions import InvalidRequestError, StreamAppError
from streamapp.models import ModelConfig
from streamapp.records import DeadLetter, InferenceRequest, InferenceResult
from streamapp.settings import Settings

__all__ = ["InferencePipeline", "LoadedModel", "PipelineStats", "Sink", "SourceMessage"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SourceMessage:
    """One record read from the request topic.

    Attributes:
        key / value: Raw bytes as stored in Kafka (either may be None).
        topic / partition / offset: Where it was read.
        ack: Marks the record processed (safe to commit); called at most once.
        received_at: ``time.monotonic()`` when it was read.
    """

    key: bytes | None
    value: bytes | None
    topic: str
    partition: int
    offset: int
    ack: Callable[[], Any]
    received_at: float = field(default_factory=time.monotonic)


class Sink(Protocol):
    """Where outcomes go: ``send`` hands a record to the producer and returns an awaitable that
    resolves once the broker acknowledged it (Faust's ``FutureMessage``, an asyncio future)."""

    async def send(self, topic: str, key: bytes | None, value: bytes) -> Awaitable[Any]: ...


@dataclass
class LoadedModel:
    """A model ready to serve: its contract and the executor running its engine."""

    config: ModelConfig
    executor: Executor

    @property
    def info(self) -> EngineInfo:
        return self.executor.engine.info


@dataclass(slots=True)
class _Work:
    source: SourceMessage
    request: InferenceRequest | None = None
    model: LoadedModel | None = None
    array: np.ndarray | None = None


@dataclass
class PipelineStats:
    """Counters since start: records read, results, dead letters by reason, produce failures."""

    received: int = 0
    results: int = 0
    dead_letters: dict[str, int] = field(default_factory=dict)
    produce_failures: int = 0
    acked: int = 0


class InferencePipeline:
    """Decode → validate → batch → infer → produce, in read order.

    Args:
        settings: Topics, batching limits, ``max_request_bytes``, ``top_k``, result codec.
        models: Loaded models by name (the request's ``model`` field).
        sink: Producer of results and dead letters.
        worker: Name put in results and dead letters.
    """

    def __init__(
        self,
        settings: Settings,
        models: Mapping[str, LoadedModel],
        sink: Sink,
        *,
        worker: str,
    ) -> None:
        self.settings = settings
        self.models = dict(models)
        self.sink = sink
        self.worker = worker
        self.stats = PipelineStats()
        self.batcher: MicroBatcher[_Work] = MicroBatcher(
            self._run_batch,
            self._emit,
            max_batch_size=settings.max_batch_size,
            max_batch_delay_ms=settings.max_batch_delay_ms,
            max_inflight_batches=settings.max_inflight_batches,
        )

    async def start(self) -> None:
        await self.batcher.start()

    async def stop(self, *, drain: bool = True) -> None:
        """Stop; with ``drain`` every record read so far is answered (and acked) first."""
        await self.batcher.stop(drain=drain)

    # -- input ----------------------------------------------------------------------------------

    async def handle(self, message: SourceMessage) -> None:
        """Accept one record. Waits when too much is in flight (backpressure). Never raises for
        bad input: it becomes a dead letter."""
        self.stats.received += 1
        work = _Work(message)
        try:
            work.request = decode_request(
                message.value, max_request_bytes=self.settings.max_request_bytes
            )
            self._check_key(message.key, work.request)
            work.model = self._model(work.request.model)
            work.array = work.model.config.preprocess(work.request)
        except InvalidRequestError as exc:
            await self.batcher.put_done(work, exc)
            return
        await self.batcher.put(work, key=work.request.model)

    def _check_key(self, key: bytes | None, request: InferenceRequest) -> None:
        if key is None or key.decode("utf-8", "replace") != request.device_id:
            raise InvalidRequestError(
                "key_mismatch",
                f"the record key {key!r} is not the request's device_id "
                f"{request.device_id!r}; key records by device_id (UTF-8) to keep device order",
            )

    def _model(self, name: str) -> LoadedModel:
        try:
            return self.models[name]
        except KeyError:
            raise InvalidRequestError(
                "unknown_model",
                f"model {name!r} is not loaded by this worker; loaded: "
                f"{', '.join(sorted(self.models))}",
            ) from None

    # -- batches --------------------------------------------------------------------------------

    async def _run_batch(self, key: Hashable, batch: list[_Work]) -> Sequence[Any]:
        model = self.models[str(key)]
        config = model.config
        started = time.perf_counter()
        items = []
        for work in batch:
            assert work.array is not None
            items.append({config.input_name: work.array})
        outputs = await model.executor.run(items)
        infer_ms = (time.perf_counter() - started) * 1000.0
        probs = outputs[config.output_name]
        k = min(self.settings.top_k, len(config.labels))
        return [({"top_k": config.top_k(probs[i], k)}, infer_ms) for i in range(len(batch))]

    # -- output ---------------------------------------------------------------------------------

    async def _emit(self, completion: Completion[_Work]) -> None:
        work = completion.item
        source = work.source
        if completion.error is None:
            topic, value = self.settings.result_topic, self._result_value(completion)
            self.stats.results += 1
        else:
            topic, value = self.settings.dlq_topic, self._dead_letter_value(completion)
        ack_future = await self.sink.send(topic, source.key, value)

        def on_produced(fut: Any) -> None:
            if fut.cancelled() or fut.exception() is not None:
                self.stats.produce_failures += 1
                log.error(
                    "producing to %s for %s[%d]@%d failed (%s): the record stays unacknowledged "
                    "and is processed again after a restart",
                    topic, source.topic, source.partition, source.offset,
                    "cancelled" if fut.cancelled() else fut.exception(),
                )
                return
            source.ack()
            self.stats.acked += 1

        add_done_callback = getattr(ack_future, "add_done_callback", None)
        if add_done_callback is None:  # a sink that produces synchronously
            await ack_future
            source.ack()
            self.stats.acked += 1
        else:
            add_done_callback(on_produced)

    def _result_value(self, completion: Completion[_Work]) -> bytes:
        work = completion.item
        request, model, batch = work.request, work.model, completion.batch
        assert request is not None and model is not None and batch is not None
        outputs, infer_ms = completion.result
        now = time.time()
        result = InferenceResult(
            request_id=request.request_id,
            device_id=request.device_id,
            seq=request.seq,
            model=request.model,
            engine=model.info.tag,
            outputs=outputs,
            attempt=0,
            queue_ms=round((batch.started_at - work.source.received_at) * 1000.0, 3),
            infer_ms=round(infer_ms, 3),
            e2e_ms=round((now - request.ts) * 1000.0, 3),
            batch_id=f"{self.worker}/{batch.batch_id}",
            batch_size=batch.size,
            worker=self.worker,
            ts=now,
        )
        return encode_result(result.to_dict(), self.settings.result_codec)

    def _dead_letter_value(self, completion: Completion[_Work]) -> bytes:
        work = completion.item
        error = completion.error
        assert error is not None
        if isinstance(error, InvalidRequestError):
            reason, stage = error.reason, "decode" if work.request is None else "validate"
        elif isinstance(error, EngineError):
            reason, stage = "inference_failed", "inference"
        else:
            reason, stage = "internal_error", "inference"
            log.error(
                "internal error on %s[%d]@%d:\n%s",
                work.source.topic, work.source.partition, work.source.offset,
                "".join(traceback.format_exception(error)),
            )
        if isinstance(error, StreamAppError | EngineError) and not isinstance(
            error, InvalidRequestError
        ):
            detail = getattr(error, "reason", "")
        else:
            detail = ""
        self.stats.dead_letters[reason] = self.stats.dead_letters.get(reason, 0) + 1
        now = time.time()
        log.warning(
            "dead letter %s from %s[%d]@%d: %s",
            reason, work.source.topic, work.source.partition, work.source.offset, error,
        )
        letter = DeadLetter(
            value=work.source.value or b"",
            key=work.source.key,
            error={
                "reason": reason,
                "type": type(error).__name__,
                "message": str(error),
                "stage": stage,
                **({"detail": detail} if detail else {}),
            },
            attempts=1,
            first_failed_ts=now,
            last_failed_ts=now,
            source={
                "topic": work.source.topic,
                "partition": work.source.partition,
                "offset": work.source.offset,
            },
            request_id=work.request.request_id if work.request else None,
            device_id=work.request.device_id if work.request else None,
            worker=self.worker,
        )
        return encode_dead_letter(letter)
