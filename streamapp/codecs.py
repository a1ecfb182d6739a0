"""Safe codecs for request, result and dead-letter values: JSON (base64 tensors) and msgpack
(raw bytes). Never pickle.

Request values are decoded defensively: every failure raises
:class:`~streamapp.exceptions.InvalidRequestError` with one of the reason codes in
:data:`REASONS`, and sizes are checked before any array is allocated.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import sys
import time
from typing import Any, Literal

import msgpack
import numpy as np
import orjson

from streamapp.exceptions import InvalidRequestError
from streamapp.records import (
    MAX_DEVICE_ID_CHARS,
    DeadLetter,
    InferenceRequest,
    TensorPayload,
    device_id_problem,
)

__all__ = [
    "ALLOWED_DTYPES",
    "MAX_DEADLINE_MS",
    "MAX_ID_CHARS",
    "MAX_REQUEST_TS_AHEAD_S",
    "MIN_REQUEST_TS",
    "REASONS",
    "canonical_dtype",
    "check_deadline",
    "check_key",
    "dead_letter_to_dict",
    "decode_dead_letter",
    "decode_request",
    "decode_result",
    "encode_dead_letter",
    "encode_request",
    "encode_result",
    "readable_fields",
    "tensor_to_array",
]

CodecName = Literal["json", "msgpack"]

#: Reason codes of rejected requests (dead-letter ``error.reason``). The reason table in
#: docs/records.md documents each one (a test checks it).
REASONS: dict[str, str] = {
    "invalid_json": "the value is not valid UTF-8 JSON",
    "invalid_msgpack": "the value is not valid msgpack",
    "wrong_type": "the value is not an object/map, or a field has the wrong type",
    "missing_field": "a required field is missing",
    "bad_device_id": "device_id is empty, longer than 256 characters or holds control, format "
    "or separator characters",
    "ambiguous_input": "the request holds both a tensor and an image",
    "too_large": "the value is larger than max_request_bytes",
    "image_too_large": "the image header claims more pixels than max_image_pixels allows",
    "bad_tensor": "the tensor's data does not match its dtype and shape, or is not valid base64",
    "bad_timestamp": "ts is before 2001-01-01 or more than a day ahead of the worker's clock",
    "bad_deadline": "deadline is not a number of milliseconds above 0 and at most one day",
    "empty_key": "the record has no key (null or empty); key requests by device_id",
    "key_mismatch": "the record key is not the request's device_id (UTF-8)",
    "unknown_model": "the model is not loaded by this worker",
    "unknown_model_version": "the request pins a model_version that is not loaded on the "
    "worker",
    "bad_dtype": "the tensor's dtype is not one the model accepts",
    "bad_shape": "the tensor's shape is not the one the model expects",
    "non_finite": "the tensor holds NaN or infinity and the model does not allow them",
    "out_of_range": "a tensor value is outside the range the model's metadata declares",
    "unsupported_input": "the model does not accept this kind of input (tensor/image)",
    "undecodable_image": "the image is not a PNG/JPEG that can be decoded",
    "duplicate_request_id": "another request with the same request_id is in the same batch",
    "inference_failed": "the engine failed on this request with a non-retriable error",
    "retries_exhausted": "transient failures persisted through max_retries retries",
    "invalid_retry_record": "a record in the retry topic is not a valid retry record",
    "unproducible_outcome": "the result, retry record or dead letter could not be produced "
    "(e.g. larger than max_produce_bytes)",
    "undecodable_record_batch": "the record batch holding this offset could not be decoded by "
    "the worker's consumer (bad CRC, a codec it lacks, corrupt compressed data)",
    "internal_error": "a bug in streamapp; the log has the traceback",
}

#: Earliest capture time accepted in a request's ``ts`` (epoch seconds): 2001-01-01T00:00:00Z.
#: Earlier values come from device clocks that were never set (1970) or from a wrong unit;
#: 2001-01-01 also leaves room for the 10-digit epoch values (>= 1e9, 2001-09-09) that test
#: fixtures like to use.
MIN_REQUEST_TS = 978_307_200.0

#: How far ahead of the worker's clock a request's ``ts`` may be (seconds): one day. That
#: tolerates skewed device clocks and time-zone mistakes, and rejects epoch milliseconds sent
#: as seconds (tens of thousands of years ahead).
MAX_REQUEST_TS_AHEAD_S = 86_400.0

#: Longest relative deadline a request may carry (milliseconds): one day. Longer is no deadline
#: for a stream of frames, and a value in microseconds or seconds-since-epoch lands above it.
MAX_DEADLINE_MS = 86_400_000.0

#: numpy's type codes of the element types a request tensor may have, by name.
_DTYPE_CODES: dict[str, str] = {
    "uint8": "u1", "int8": "i1", "uint16": "u2", "int16": "i2", "int32": "i4", "int64": "i8",
    "float16": "f2", "float32": "f4", "float64": "f8",
}
#: Element types a request tensor may have (canonical names). Object, string and void dtypes
#: are never accepted.
ALLOWED_DTYPES: frozenset[str] = frozenset(_DTYPE_CODES)
_BY_CODE = {code: name for name, code in _DTYPE_CODES.items()}

#: Longest id (``request_id``, ``device_id``, ``model``) copied from a *rejected* value into its
#: dead letter's fields: ids are for finding a record, and a 1 MB id would make the dead letter
#: too large to produce (the original value is kept whole when it fits).
MAX_ID_CHARS = 256

#: Longest ``model_version`` a request may pin (characters).
MAX_VERSION_CHARS = 64

_MAX_RANK = 8
_EXACT_INT = 2**53
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_REQUIRED: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("request_id", str),
    ("device_id", str),
    ("seq", int),
    ("ts", (int, float)),
    ("model", str),
)


# -- requests ------------------------------------------------------------------------------------


def encode_request(request: InferenceRequest, codec: CodecName = "json") -> bytes:
    """Encode a request value.

    Args:
        request: The request.
        codec: ``"json"`` (tensor data and image base64, as a gateway sends) or ``"msgpack"``
            (raw bytes).

    Returns:
        The record value.
    """
    body: dict[str, Any] = {
        "request_id": request.request_id,
        "device_id": request.device_id,
        "seq": request.seq,
        "ts": request.ts,
        "model": request.model,
    }
    if request.model_version is not None:
        body["model_version"] = request.model_version
    binary = codec == "msgpack"
    if request.tensor is not None:
        t = request.tensor
        body["tensor"] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data": t.data if binary else base64.b64encode(t.data).decode("ascii"),
        }
    if request.image is not None:
        body["image"] = request.image if binary else base64.b64encode(request.image).decode()
    if request.deadline is not None:  # optional: absent, old workers and readers see no change
        body["deadline"] = request.deadline
    if binary:
        return msgpack.packb(body, use_bin_type=True)
    return json.dumps(body, separators=(",", ":")).encode()


def _looks_like_msgpack_map(value: bytes) -> bool:
    first = value[0]
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


#: First bytes of a msgpack map or array: fixmap, fixarray, array 16/32, map 16/32.
_CONTAINER_HEADERS = frozenset([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])


def _looks_like_msgpack_container(value: bytes) -> bool:
    """A msgpack map or array header (JSON text never starts with these bytes)."""
    return value[0] in _CONTAINER_HEADERS


def decode_request(
    value: bytes | None, *, max_request_bytes: int = 1 << 20, now: float | None = None
) -> InferenceRequest:
    """Decode and validate a request value of either codec (detected from the first byte).

    A value starting with a msgpack map header is msgpack; anything else is treated as JSON.

    Args:
        value: The raw record value.
        max_request_bytes: Values longer than this are rejected before parsing.
        now: The worker's clock (epoch seconds) for the ``ts`` bounds; default ``time.time()``.

    Returns:
        The request; its tensor's byte length is checked against dtype and shape.

    Raises:
        InvalidRequestError: With ``reason`` one of :data:`REASONS`.
    """
    if not value:
        raise InvalidRequestError("invalid_json", "the value is empty; send a JSON object")
    if len(value) > max_request_bytes:
        raise InvalidRequestError(
            "too_large",
            f"the value is {len(value)} bytes, more than max_request_bytes={max_request_bytes}",
        )
    binary = value[0] in _CONTAINER_HEADERS  # _looks_like_msgpack_container, inlined
    body: Any
    if binary:
        try:
            body = msgpack.unpackb(value, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise InvalidRequestError(
                "invalid_msgpack", f"cannot decode msgpack: {_msgpack_problem(exc)}"
            ) from exc
    else:
        try:
            # decode first: json.loads(bytes) would also accept UTF-16 and UTF-32
            body = json.loads(value.decode("utf-8"))
        # RecursionError: the C scanner's answer to deeply nested arrays/objects ("[[[[...").
        # ValueError: also an integer literal longer than sys.get_int_max_str_digits() (4300).
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise InvalidRequestError(
                "invalid_json", f"cannot decode JSON: {_json_problem(exc)}"
            ) from exc
    if not isinstance(body, dict):
        raise InvalidRequestError(
            "wrong_type", f"the value is a {type(body).__name__}, expected an object with fields"
        )
    try:
        return _request_from_body(body, binary=binary, now=time.time() if now is None else now)
    except InvalidRequestError as exc:
        exc.fields = readable_fields(body)
        raise


def _msgpack_problem(exc: Exception) -> str:
    """What msgpack's exception means, in words (several of them have no message at all)."""
    text = str(exc)
    if isinstance(exc, msgpack.StackError):
        return "arrays or maps are nested too deeply"
    if isinstance(exc, msgpack.FormatError):
        return "it holds a byte that starts no msgpack value (such as 0xc1)"
    if isinstance(exc, msgpack.ExtraData):
        return "more bytes follow the first value; send one map per record"
    if isinstance(exc, UnicodeDecodeError):
        return f"a string is not valid UTF-8 (byte {exc.object[exc.start]:#04x})"
    if "incomplete input" in text:
        return "it ends in the middle of a value (truncated?)"
    if "exceeds max_" in text:
        return "an array, map, string or bin claims more entries or bytes than the value holds"
    if "map key" in text:
        return "a map key is not a string; field names are strings"
    return text or "it is not msgpack"


def _json_problem(exc: Exception) -> str:
    """What the JSON decoder's exception means, in words."""
    if isinstance(exc, RecursionError):
        return "arrays or objects are nested too deeply"
    if isinstance(exc, UnicodeDecodeError):
        return (f"it is not UTF-8 (byte {exc.object[exc.start]:#04x} at {exc.start}); send "
                "UTF-8 JSON")
    if isinstance(exc, json.JSONDecodeError):
        return str(exc)
    if "integer string conversion" in str(exc):
        return (f"an integer has more than {sys.get_int_max_str_digits()} digits; no field "
                "takes such a number")
    return str(exc)


def readable_fields(body: Any) -> dict[str, Any]:
    """The request fields of a decoded value that have the right type, whatever else is wrong
    with it: ``request_id``, ``device_id``, ``model`` (non-empty str), ``seq`` (64-bit int) and
    ``ts`` (finite number). A dead letter and the metrics carry them so that an operator can find
    the rejected request (:attr:`InvalidRequestError.fields`).

    Args:
        body: The parsed JSON/msgpack value (anything; a non-object gives ``{}``).

    Returns:
        ``{name: value}`` for each readable field; strings longer than :data:`MAX_ID_CHARS` are
        cut to that length (the dead letter keeps the original value when it fits).
    """
    if not isinstance(body, dict):
        return {}
    out: dict[str, Any] = {}
    for name in ("request_id", "device_id", "model"):
        value = body.get(name)
        if isinstance(value, str) and value:
            out[name] = value[:MAX_ID_CHARS]
    seq = body.get("seq")
    if isinstance(seq, int) and not isinstance(seq, bool) and _INT64_MIN <= seq <= _INT64_MAX:
        out["seq"] = seq
    ts = body.get("ts")
    if isinstance(ts, int | float) and not isinstance(ts, bool):
        try:
            if math.isfinite(float(ts)):
                out["ts"] = float(ts)
        except OverflowError:
            pass
    return out


def check_key(key: bytes | None, request: InferenceRequest) -> None:
    """Check a request record's Kafka key: it must be the request's ``device_id`` in UTF-8.

    The key decides the partition, and so the order a device's requests are answered in; a
    missing or different key would silently break per-device order.

    Args:
        key: The record key as stored in Kafka (raw bytes, or None).
        request: The decoded request value of that record.

    Raises:
        InvalidRequestError: ``empty_key`` (None or zero bytes) or ``key_mismatch``.
    """
    if not key:
        raise InvalidRequestError(
            "empty_key",
            f"the record has {'no key' if key is None else 'an empty key'}; key each request by "
            f"its device_id (here {request.device_id!r}, UTF-8) so a device's requests share a "
            "partition and keep their order",
        )
    if key != request.device_id.encode("utf-8"):
        shown = key[:64] + (b"..." if len(key) > 64 else b"")
        raise InvalidRequestError(
            "key_mismatch",
            f"the record key {shown!r} is not the request's device_id {request.device_id!r}; "
            "key records by device_id (UTF-8) to keep device order",
        )


def canonical_dtype(spelling: str) -> tuple[str, bool]:
    """The canonical name of a request tensor's dtype, and whether its data is big-endian.

    Accepts the names of :data:`ALLOWED_DTYPES` (``"float32"``) and numpy's type strings of
    them with or without a byte order (``"f4"``, ``"<f4"``, ``"=f4"``, ``">f4"``, ``"|u1"``,
    what ``numpy.dtype(...).str`` writes). ``<``, ``=`` and no prefix mean little-endian (the
    byte order docs/records.md defines: ``=`` is the sender's native order, little-endian on
    every platform streamapp runs on); ``|`` (no byte order) is for one-byte types only; ``>``
    is big-endian, which :func:`decode_request` converts.

    Args:
        spelling: The request's ``tensor.dtype``.

    Returns:
        ``(name, big_endian)``, e.g. ``("float32", True)`` for ``">f4"``; one-byte types are
        never big-endian.

    Raises:
        InvalidRequestError: ``bad_dtype``: not a spelling of an allowed dtype.
    """
    known = _SPELLINGS.get(spelling)
    if known is not None:
        return known
    order, code = (spelling[:1], spelling[1:]) if spelling[:1] in "<>=|" else ("", spelling)
    name = _BY_CODE.get(code)
    if name is None or (order == "|" and code[1:] != "1"):
        raise InvalidRequestError(
            "bad_dtype",
            f"tensor dtype {_short(spelling)} is not allowed; use one of "
            f"{', '.join(sorted(ALLOWED_DTYPES))}, or numpy's spelling of one with its byte "
            "order ('<f4', '>f4', '|u1'; '|' for one-byte types only)",
        )
    return name, order == ">" and code[1:] != "1"


def _spellings() -> dict[str, tuple[str, bool]]:
    """Every spelling :func:`canonical_dtype` accepts, with its answer: a finite table (the
    names, and the codes with and without a byte-order prefix), so that a lookup replaces the
    parsing on every request."""
    out: dict[str, tuple[str, bool]] = {}
    for name, code in _DTYPE_CODES.items():
        out[name] = (name, False)
        for order in ("", "<", "=", ">", "|"):
            if order == "|" and code[1:] != "1":
                continue
            out[order + code] = (name, order == ">" and code[1:] != "1")
    return out


#: :func:`canonical_dtype`'s answer for every spelling it accepts.
_SPELLINGS: dict[str, tuple[str, bool]] = _spellings()

#: Item size (bytes) of each allowed dtype, by canonical name.
_ITEMSIZE: dict[str, int] = {name: np.dtype(name).itemsize for name in _DTYPE_CODES}

#: The little-endian numpy dtype of each allowed dtype, by canonical name
#: (:func:`tensor_to_array`).
_LITTLE: dict[str, np.dtype[Any]] = {
    name: np.dtype(name).newbyteorder("<") for name in _DTYPE_CODES
}


def _check_ts(ts: float, now: float) -> None:
    if ts < MIN_REQUEST_TS:
        raise InvalidRequestError(
            "bad_timestamp",
            f"field 'ts' is {ts!r}, before 2001-01-01 (epoch {MIN_REQUEST_TS:.0f}); send the "
            "capture time in epoch seconds from a synchronised clock",
        )
    if ts > now + MAX_REQUEST_TS_AHEAD_S:
        hint = " (it looks like milliseconds)" if ts > now * 100 else ""
        raise InvalidRequestError(
            "bad_timestamp",
            f"field 'ts' is {ts!r}, {ts - now:.0f} s ahead of the worker's clock{hint}; more "
            f"than {MAX_REQUEST_TS_AHEAD_S:.0f} s ahead is not a capture time: send epoch seconds "
            "from a synchronised clock",
        )


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in body:
        raise InvalidRequestError("missing_field", f"required field {name!r} is missing")
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else "number"
        raise InvalidRequestError(
            "wrong_type", f"field {name!r} is {type(value).__name__}, expected {want}"
        )
    return value


def _short(value: Any, limit: int = 24) -> str:
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 256 else "a huge int"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _request_from_body(body: dict[str, Any], *, binary: bool, now: float) -> InferenceRequest:
    request = _plain_request(body, binary, now)
    if request is not None:
        return request
    return _checked_request(body, binary=binary, now=now)


def _plain_request(body: dict[str, Any], binary: bool, now: float) -> InferenceRequest | None:
    """The request of a body whose every field has exactly the expected type and passes every
    rule of :func:`_checked_request`, built with one type test per field; None for anything
    else (a bad value, or merely an unusual one: an image, an int ``model_version``, a
    big-endian tensor, a subclass of str), which :func:`_checked_request` then decodes or
    rejects with its exact reason and message.

    It must never accept a body that :func:`_checked_request` rejects, nor build a different
    request (tests/streamapp/test_codecs_fast_path.py checks both against the bad-input
    catalogue).
    """
    get = body.get
    request_id, device_id, seq, ts, model = (
        get("request_id"), get("device_id"), get("seq"), get("ts"), get("model"))
    if (type(request_id) is not str or not request_id or type(model) is not str or not model
            or type(device_id) is not str or not 0 < len(device_id) <= MAX_DEVICE_ID_CHARS
            or not device_id.isprintable()
            or type(seq) is not int or not _INT64_MIN <= seq <= _INT64_MAX):
        return None
    if type(ts) is not float:
        # |ts| < 2**53: float(ts) is exact, so the bounds below test the value the slow path
        # tests
        if type(ts) is not int or not -_EXACT_INT < ts < _EXACT_INT:
            return None
        ts = float(ts)
    # NaN fails both comparisons
    if not MIN_REQUEST_TS <= ts <= now + MAX_REQUEST_TS_AHEAD_S:
        return None
    tensor_body = get("tensor")
    if type(tensor_body) is not dict or get("image") is not None:
        return None
    spelling, shape, data = tensor_body.get("dtype"), tensor_body.get("shape"), tensor_body.get(
        "data")
    known = _SPELLINGS.get(spelling) if type(spelling) is str else None
    if known is None or known[1] or type(shape) is not list or len(shape) > _MAX_RANK:
        return None
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            return None
        count *= d
    if type(data) is not bytes or not binary:
        if type(data) is not str:
            return None
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            return None
    dtype = known[0]
    if len(data) != count * _ITEMSIZE[dtype]:
        return None
    version = get("model_version")
    if version is not None and (type(version) is not str or not version
                                or len(version) > MAX_VERSION_CHARS):
        return None
    deadline = get("deadline")
    if deadline is not None:
        if (type(deadline) is not float and type(deadline) is not int) or not (
                0.0 < deadline <= MAX_DEADLINE_MS):
            return None
        deadline = float(deadline)
    return InferenceRequest(
        request_id=request_id,
        device_id=device_id,
        seq=seq,
        ts=ts,
        model=model,
        tensor=TensorPayload(dtype=dtype, shape=tuple(shape), data=data),
        image=None,
        model_version=version,
        deadline=deadline,
    )


def _bin_key(body: dict[Any, Any]) -> bytes | None:
    """The first bin (bytes) key of a msgpack request or of one of its maps (``tensor``,
    ``image``); msgpack's ``strict_map_key`` lets str and bytes keys through, and a request
    packed with bytes field names would otherwise read as one without them."""
    for mapping in (body, *(v for v in body.values() if isinstance(v, dict))):
        for key in mapping:
            if isinstance(key, bytes):
                return key
    return None


def _checked_request(body: dict[str, Any], *, binary: bool, now: float) -> InferenceRequest:
    """The careful decoder: every rule in order, each failure with its reason and message."""
    if binary:
        key = _bin_key(body)
        if key is not None:
            raise InvalidRequestError(
                "invalid_msgpack", f"a map key is bin data ({_short(key, 40)}), not a string; "
                "field names are msgpack strings (str, not bytes)")
    fields = {name: _field(body, name, kind) for name, kind in _REQUIRED}
    # JSON integers are unbounded: a 400-digit ts overflows float(), a huge seq cannot be
    # written as msgpack (results) — reject both here rather than crash later.
    try:
        ts = float(fields["ts"])
    except OverflowError:
        ts = math.inf
    if not math.isfinite(ts):
        raise InvalidRequestError("wrong_type", f"field 'ts' is {_short(fields['ts'])}, not a time")
    if not _INT64_MIN <= fields["seq"] <= _INT64_MAX:
        raise InvalidRequestError(
            "wrong_type",
            f"field 'seq' is {_short(fields['seq'])}, outside the 64-bit integer range",
        )
    for name in ("request_id", "model"):
        if not fields[name]:
            raise InvalidRequestError("wrong_type", f"field {name!r} is empty")
    # an empty device_id breaks the device-id rule (1 to 256 characters) like a long one does
    problem = device_id_problem(fields["device_id"])
    if problem is not None:
        raise InvalidRequestError(
            "bad_device_id", f"field 'device_id' {_short(fields['device_id'], 64)} {problem}"
        )
    tensor_body = body.get("tensor")
    image_body = body.get("image")
    if tensor_body is None and image_body is None:
        raise InvalidRequestError(
            "missing_field", "the request has neither 'tensor' nor 'image'; send one of them"
        )
    if tensor_body is not None and image_body is not None:
        raise InvalidRequestError(
            "ambiguous_input",
            "the request holds both 'tensor' and 'image'; send exactly one of them (the worker "
            "does not guess which one is meant)",
        )
    tensor = _tensor_from_body(tensor_body, binary=binary) if tensor_body is not None else None
    image = _bytes_field(image_body, "image", binary=binary) if image_body is not None else None
    version = body.get("model_version")
    if isinstance(version, int) and not isinstance(version, bool) and version >= 0:
        version = str(version)
    if version is not None and (not isinstance(version, str) or not version
                                or len(version) > MAX_VERSION_CHARS):
        raise InvalidRequestError(
            "wrong_type",
            f"field 'model_version' is {_short(version)}; send the version to pin as a "
            f"non-empty string of at most {MAX_VERSION_CHARS} characters (e.g. \"2\"), or "
            "leave it out for the model's current version",
        )
    _check_ts(ts, now)  # after the structure: a malformed request is reported as such first
    deadline = body.get("deadline")
    if deadline is not None:
        deadline = check_deadline(deadline)
    return InferenceRequest(
        request_id=fields["request_id"],
        device_id=fields["device_id"],
        seq=fields["seq"],
        ts=ts,
        model=fields["model"],
        tensor=tensor,
        image=image,
        model_version=version,
        deadline=deadline,
    )


def check_deadline(value: Any, what: str = "field 'deadline'", unset: str = "null") -> float:
    """A request's ``deadline`` (milliseconds) as a float, checked: the one rule, which the
    worker applies on decode and the client (:func:`streamapp.frames.make_request`,
    ``streamapp publish --deadline``) before sending.

    Args:
        value: The deadline, milliseconds (an int or float; a bool is not a number here).
        what: How the message names the value (``"field 'deadline'"``, ``"--deadline"``).
        unset: How the message says "no deadline" (``"null"``, ``"None"``).

    Returns:
        ``float(value)``: finite, above 0 and at most :data:`MAX_DEADLINE_MS`.

    Raises:
        InvalidRequestError: ``wrong_type`` (not a number) or ``bad_deadline`` (not finite, not
            above 0, or above :data:`MAX_DEADLINE_MS`).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(
            "wrong_type", f"{what} is {type(value).__name__}, expected a number of "
            f"milliseconds (or {unset} for none)"
        )
    try:
        ms = float(value)
    except OverflowError:
        ms = math.inf
    if not (math.isfinite(ms) and 0.0 < ms <= MAX_DEADLINE_MS):
        raise InvalidRequestError(
            "bad_deadline",
            f"{what} is {_short(value)}; it is how old the request may be when its "
            f"batch would start, in milliseconds: a number above 0 and at most "
            f"{MAX_DEADLINE_MS:.0f} (one day), or {unset} for the model's policy",
        )
    return ms


def _bytes_field(value: Any, name: str, *, binary: bool) -> bytes:
    if binary and isinstance(value, bytes):
        return value
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise InvalidRequestError("bad_tensor", f"field {name!r} is not base64: {exc}") from exc
    raise InvalidRequestError(
        "wrong_type",
        f"field {name!r} is {type(value).__name__}, expected "
        + ("bytes" if binary else "a base64 string"),
    )


def _tensor_from_body(body: Any, *, binary: bool) -> TensorPayload:
    if not isinstance(body, dict):
        raise InvalidRequestError(
            "wrong_type", f"field 'tensor' is {type(body).__name__}, expected an object"
        )
    dtype = _field(body, "dtype", str)
    shape = _field(body, "shape", list)
    if "data" not in body:
        raise InvalidRequestError("missing_field", "required field 'tensor.data' is missing")
    dtype, big_endian = canonical_dtype(dtype)
    if len(shape) > _MAX_RANK or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InvalidRequestError(
            "bad_shape", f"tensor shape {shape!r} must be a list of at most {_MAX_RANK} "
            "non-negative integers"
        )
    data = _bytes_field(body["data"], "tensor.data", binary=binary)
    expected = math.prod(shape) * _ITEMSIZE[dtype]
    if len(data) != expected:
        raise InvalidRequestError(
            "bad_tensor",
            f"tensor data is {len(data)} bytes, but {dtype}{shape} needs {expected} bytes",
        )
    if big_endian:  # one copy, into the byte order the rest of the worker reads
        data = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder(">")).byteswap().tobytes()
    return TensorPayload(dtype=dtype, shape=tuple(shape), data=data)


def tensor_to_array(tensor: TensorPayload) -> np.ndarray:
    """A read-only numpy view of a decoded tensor (no copy): ``dtype[*shape]``, little-endian.

    Raises:
        TypeError: ``tensor.dtype`` is not a numpy dtype name.
        ValueError: ``tensor.data``'s length does not match dtype and shape.
    """
    dtype = _LITTLE.get(tensor.dtype)
    if dtype is None:  # not a request dtype (a tensor built by hand): numpy's own lookup
        dtype = np.dtype(tensor.dtype).newbyteorder("<")
    return np.frombuffer(tensor.data, dtype=dtype).reshape(tensor.shape)


# -- results -------------------------------------------------------------------------------------


def encode_result(result: dict[str, Any], codec: CodecName = "json") -> bytes:
    """Encode a result (``InferenceResult.to_dict()``) as JSON or msgpack.

    JSON is compact UTF-8 (orjson; see :func:`_json_bytes`): a NaN or ±Inf (a model's output,
    where its metadata allows them) is written as ``null``, so the value stays valid JSON.

    Raises:
        TypeError, ValueError, OverflowError: msgpack cannot encode a value (an int beyond
            64 bits); JSON takes every value the result holds.
    """
    if codec == "msgpack":
        return msgpack.packb(result, use_bin_type=True)
    return _json_bytes(result)


def _json_bytes(value: Any) -> bytes:
    """Compact UTF-8 JSON of ``value``, non-finite floats as ``null`` (strict JSON has no NaN).

    orjson takes ~1 µs for a result where ``json.dumps`` took ~10 µs (bench.pipeline_cost). It
    writes the same numbers (the shortest repr that reads back as the same float) and strings
    as UTF-8 where ``json.dumps`` escaped non-ASCII as ``\\uXXXX``: both decode to the same
    values. What orjson refuses (a str holding a lone surrogate, an int beyond 64 bits, a
    non-str key, a float subclass) is written by ``json.dumps`` as before, non-finite floats
    again as ``null``.
    """
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(_finite(value), separators=(",", ":")).encode()


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float (at any depth of dicts, lists, tuples) as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def decode_result(value: bytes) -> dict[str, Any]:
    """Decode a result value of either codec."""
    if value and _looks_like_msgpack_map(value):
        out: dict[str, Any] = msgpack.unpackb(value, raw=False)
        return out
    decoded: dict[str, Any] = json.loads(value)
    return decoded


# -- dead letters --------------------------------------------------------------------------------


def encode_dead_letter(letter: DeadLetter) -> bytes:
    """Encode a dead letter as compact UTF-8 JSON (non-finite floats as ``null``, as
    :func:`encode_result`); the original key and value are base64, byte for byte."""
    return _json_bytes(dead_letter_to_dict(letter))


def dead_letter_to_dict(letter: DeadLetter) -> dict[str, Any]:
    """The JSON form of a dead letter (key and value base64)."""
    return {
        "request_id": letter.request_id,
        "device_id": letter.device_id,
        "error": letter.error,
        "attempts": letter.attempts,
        "first_failed_ts": letter.first_failed_ts,
        "last_failed_ts": letter.last_failed_ts,
        "source": letter.source,
        "worker": letter.worker,
        "key": None if letter.key is None else base64.b64encode(letter.key).decode("ascii"),
        "value": base64.b64encode(letter.value).decode("ascii"),
        "errors": letter.errors,
        **({"extra": letter.extra} if letter.extra else {}),
    }


def decode_dead_letter(value: bytes) -> DeadLetter:
    """Decode a dead letter written by :func:`encode_dead_letter`."""
    body = json.loads(value)
    return DeadLetter(
        value=base64.b64decode(body["value"]),
        key=None if body["key"] is None else base64.b64decode(body["key"]),
        error=body["error"],
        attempts=body["attempts"],
        first_failed_ts=body["first_failed_ts"],
        last_failed_ts=body["last_failed_ts"],
        source=body["source"],
        request_id=body.get("request_id"),
        device_id=body.get("device_id"),
        worker=body.get("worker", ""),
        errors=body.get("errors", []),
        extra=body.get("extra", {}),
    )
