"""Message contracts: inference requests, results and dead letters (see docs/records.md).

Plain dataclasses, not Faust ``Record`` models: request values are decoded by our own codecs
(:mod:`streamapp.codecs`) from raw bytes, so that bad input becomes a dead letter with a reason
instead of a deserialization crash inside Faust.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "MAX_DEVICE_ID_CHARS",
    "RESULT_OUTCOMES",
    "DeadLetter",
    "InferenceRequest",
    "InferenceResult",
    "TensorPayload",
    "device_id_problem",
]

#: Longest device id (characters) a request may carry and a URL may name.
MAX_DEVICE_ID_CHARS = 256

_CATEGORY_NAMES = {
    "Cc": "a control character", "Cf": "a format character", "Cs": "a lone surrogate",
    "Co": "a private-use character", "Cn": "an unassigned character",
    "Zl": "a line separator", "Zp": "a paragraph separator",
    "Zs": "a space other than U+0020",
}


def device_id_problem(device_id: str) -> str | None:
    """What is wrong with ``device_id``, or None when it is a valid device id.

    The one rule for device ids: the worker dead-letters a request whose id breaks it
    (``bad_device_id``) and every view that takes a device id answers 400 ``bad_device_id``
    for it, so that every device the worker records can be queried from every worker. A device
    id is 1 to :data:`MAX_DEVICE_ID_CHARS` characters of printable text (``str.isprintable``):
    no control (tab, NUL), format (U+202E, zero-width), surrogate, private-use, unassigned or
    separator characters other than the ASCII space.

    Args:
        device_id: The id (a request's ``device_id``, a record key decoded as UTF-8, a URL
            path segment percent-decoded).

    Returns:
        A phrase to put after the id in a message (``"is 300 characters long; ..."``), or None.
    """
    if not device_id:
        return "is empty"
    if len(device_id) > MAX_DEVICE_ID_CHARS:
        return (f"is {len(device_id)} characters long; at most {MAX_DEVICE_ID_CHARS} are "
                "allowed")
    if device_id.isprintable():
        return None
    index, char = next((i, c) for i, c in enumerate(device_id) if not c.isprintable())
    kind = _CATEGORY_NAMES.get(unicodedata.category(char), "a non-printable character")
    return (f"holds U+{ord(char):04X} ({kind}) at index {index}; device ids are printable "
            "text, without control, format or separator characters other than the space")


@dataclass(frozen=True, slots=True)
class TensorPayload:
    """A tensor as carried in a request.

    Attributes:
        dtype: numpy dtype name, e.g. ``"uint8"`` or ``"float32"`` (little-endian data).
        shape: Dimensions, e.g. ``(8, 8)``.
        data: Raw C-order bytes; ``len(data) == prod(shape) * itemsize`` (checked on decode).
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One keyed device event asking for a prediction.

    Attributes:
        request_id: Unique id; results and dead letters carry it so sinks can de-duplicate.
        device_id: The device; also the Kafka key (raw UTF-8 bytes).
        seq: Per-device sequence number, increasing.
        ts: Capture time, epoch seconds.
        model: Model name in the model repository, e.g. ``"digits"``.
        tensor: The input tensor, or None when ``image`` is given.
        image: Encoded image bytes (JPEG/PNG), or None when ``tensor`` is given.
        model_version: The version the request pins (e.g. ``"2"``), or None for the model's
            current one. A pinned version must be loaded on the worker (docs/versions.md).
        deadline: Optional relative deadline, milliseconds (> 0, at most
            :data:`streamapp.codecs.MAX_DEADLINE_MS`): how old the request may be when its
            batch would start, measured from when it reached Kafka (docs/delivery.md, "Queue
            policy"); it replaces the model's ``queue_policy.max_age_ms``. None: the model's
            policy, if any.
    """

    request_id: str
    device_id: str
    seq: int
    ts: float
    model: str
    tensor: TensorPayload | None = None
    image: bytes | None = None
    model_version: str | None = None
    deadline: float | None = None


@dataclass(slots=True)
class InferenceResult:
    """A prediction for one request (JSON form in ``inference-result``).

    Timings are milliseconds: ``queue_ms`` from reading the request to its batch starting,
    ``infer_ms`` the batch's engine time, ``e2e_ms`` from the request's ``ts`` to the result
    being handed to the producer — never negative. A device clock cannot be trusted: when
    ``ts`` is more than ``max_clock_skew_s`` away from when the request reached Kafka (the
    record's timestamp; the worker's read time where the record has none, the first failure for
    a retry), ``e2e_ms`` runs from that time instead and ``clock_skew_ms`` is ``ts`` minus it
    (positive: the device clock is ahead); else ``clock_skew_ms`` is None (docs/faults.md).
    ``model_version`` is the model version whose engine answered (the current one when the
    request's batch started, or the one the request pinned); ``engine`` names its file digest.

    ``outcome`` is ``"answered"`` for a prediction. A request that a queue policy kept from the
    engine (docs/delivery.md) is a result too, in its device's order, with ``outcome``
    ``"expired"`` (older than its max age when its batch would start) or ``"superseded"`` (a
    newer request of its device in the same batch was inferred instead), empty ``outputs``,
    ``infer_ms`` 0, ``batch_id`` None and ``batch_size`` 0. ``policy`` holds what the policy
    saw, written as top-level fields by :meth:`to_dict` (absent without a policy):
    ``age_ms`` (how old the request was when its batch started, or when it was skipped),
    ``max_age_ms`` and ``max_age_from`` (``"request"`` or ``"model"``) when a max age applied,
    ``superseded_by`` (the ``request_id`` inferred instead) for a superseded request.
    """

    request_id: str
    device_id: str
    seq: int
    model: str
    engine: str
    model_version: str
    outputs: dict[str, Any]
    attempt: int
    queue_ms: float
    infer_ms: float
    e2e_ms: float
    batch_id: str | None
    batch_size: int
    worker: str
    ts: float
    clock_skew_ms: float | None = None
    outcome: str = "answered"
    policy: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        # Not dataclasses.asdict: its recursive deep copy took 20 µs per result on the worker's
        # hot path (bench/, profile of the digits workload); a shallow copy takes about 2 µs,
        # and ``outputs`` is built fresh for every result anyway.
        out = {name: getattr(self, name) for name in _RESULT_FIELDS}
        if self.policy is not None:
            out.update(self.policy)
        return out


#: Result outcomes: a prediction, or a request a queue policy kept from the engine.
RESULT_OUTCOMES = ("answered", "expired", "superseded")

_RESULT_FIELDS = tuple(f.name for f in fields(InferenceResult) if f.name != "policy")


@dataclass(slots=True)
class DeadLetter:
    """A request that could not be answered (JSON form in ``inference-dlq``).

    Attributes:
        value: The original record value, byte for byte (base64 in the JSON form).
        key: The original record key (base64 in the JSON form), or None.
        error: ``{reason, type, message, stage}``.
        attempts: Processing attempts made (1 for input rejected on decode).
        first_failed_ts / last_failed_ts: Epoch seconds.
        source: ``{topic, partition, offset}`` of the original record.
        request_id / device_id: Copied from the request when it could be decoded, else None.
        errors: Every failed attempt, ``{attempt, reason, type, message, ts}`` (the last one is
            ``error``); one entry when the request was rejected without retries.
    """

    value: bytes
    key: bytes | None
    error: dict[str, str]
    attempts: int
    first_failed_ts: float
    last_failed_ts: float
    source: dict[str, Any]
    request_id: str | None = None
    device_id: str | None = None
    worker: str = ""
    errors: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
