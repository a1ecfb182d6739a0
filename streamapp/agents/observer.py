"""Hooks that let tables and metrics watch the pipeline without slowing it per message.

The pipeline calls :meth:`PipelineObserver.on_outcome` for every request it finishes (cheap,
in-memory), :meth:`PipelineObserver.on_batch` once per batch, and :meth:`PipelineObserver.flush`
after the last outcome of a batch (or of a lone rejected request) was produced — that is where an
observer writes its per-device aggregates to tables, once per batch per device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from streamapp.batching import BatchInfo

__all__ = [
    "FINAL_KINDS", "Outcome", "OutcomeKind", "PipelineObserver", "SkippedKind",
]

OutcomeKind = Literal["result", "dead_letter", "retry", "expired", "superseded"]
#: Outcomes of requests a queue policy kept from the engine (a result record without outputs).
SkippedKind = Literal["expired", "superseded"]
#: Outcome kinds that finish a request (every kind but ``retry``).
FINAL_KINDS: tuple[OutcomeKind, ...] = ("result", "dead_letter", "expired", "superseded")


@dataclass(slots=True)
class Outcome:
    """What happened to one request.

    Attributes:
        kind: ``result`` (answered), ``dead_letter`` (given up), ``retry`` (sent to the retry
            topic after a transient failure), ``expired`` or ``superseded`` (a queue policy
            kept it from the engine; a result record without outputs, docs/delivery.md).
        device_id / request_id / seq / model: From the request; None where it could not be
            decoded.
        reason: Reason code for dead letters and retries, else None.
        label / score: Top-1 prediction of a result, else None.
        e2e_ms / queue_ms / infer_ms: Timings of a result (milliseconds; of an expired or
            superseded request too, ``infer_ms`` 0), else None.
        attempt: 0 for the first try, n for the n-th retry.
        ts: Epoch seconds when the outcome was produced.
        partition: Source partition.
        event: The Faust event the request came in (table writes need it as the current event so
            they land in the key's partition), or None outside Faust.
        batch_size: Size of the batch the request ran in, else None.
        clock_skew_ms: For a result whose device clock was off by more than
            ``max_clock_skew_s``: ``ts`` minus when the request reached Kafka (ms); else None.
    """

    kind: OutcomeKind
    device_id: str | None
    request_id: str | None
    seq: int | None
    model: str | None
    reason: str | None
    label: str | None
    score: float | None
    e2e_ms: float | None
    queue_ms: float | None
    infer_ms: float | None
    attempt: int
    ts: float
    partition: int
    event: Any = None
    batch_size: int | None = None
    clock_skew_ms: float | None = None


class PipelineObserver(Protocol):
    """Receives outcomes and batch boundaries from :class:`~streamapp.agents.pipeline.
    InferencePipeline`. ``on_outcome`` and ``on_batch`` must be cheap and must not raise.

    An observer may also have ``on_outcomes(outcomes)``: the pipeline then hands it every
    outcome of one produce call at once (in read order) instead of calling ``on_outcome`` for
    each; ``writes_state = True`` makes commits wait for its ``flush`` (device tables).
    """

    def on_outcome(self, outcome: Outcome) -> None: ...

    def on_batch(self, model: str, info: BatchInfo) -> None: ...

    async def flush(self) -> None: ...
