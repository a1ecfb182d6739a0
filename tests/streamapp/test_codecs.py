"""Codecs: requests, results and dead letters round-trip in both forms; every bad request value is
rejected with the reason code a dead letter will carry, and a message that names the field."""

from __future__ import annotations

import base64
import dataclasses
import json
import time
import tracemalloc
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgpack
import numpy as np
import pytest

from streamapp.codecs import (
    MAX_REQUEST_TS_AHEAD_S,
    MIN_REQUEST_TS,
    REASONS,
    check_key,
    decode_dead_letter,
    decode_request,
    decode_result,
    encode_dead_letter,
    encode_request,
    encode_result,
    tensor_to_array,
)
from streamapp.exceptions import InvalidRequestError
from streamapp.records import DeadLetter, InferenceRequest, InferenceResult, TensorPayload

CODECS = ["json", "msgpack"]

#: A tiny but real PNG header plus bytes that are not valid UTF-8.
IMAGE = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256))


def make_request(array: np.ndarray | None = None, image: bytes | None = None) -> InferenceRequest:
    tensor = None
    if array is not None:
        tensor = TensorPayload(str(array.dtype), tuple(array.shape), array.tobytes())
    return InferenceRequest(
        request_id="r-1",
        device_id="dev-7",
        seq=42,
        ts=1_700_000_000.25,
        model="digits",
        tensor=tensor,
        image=image,
    )


def json_body(**changes: Any) -> dict[str, Any]:
    """A valid JSON request body (uint8[8, 8] tensor), with fields replaced or removed (None)."""
    body: dict[str, Any] = {
        "request_id": "r-1",
        "device_id": "dev-7",
        "seq": 3,
        "ts": 1_700_000_000.5,
        "model": "digits",
        "tensor": {
            "dtype": "uint8",
            "shape": [8, 8],
            "data": base64.b64encode(bytes(64)).decode(),
        },
    }
    for name, value in changes.items():
        if value is None:
            body.pop(name, None)
        else:
            body[name] = value
    return body


def tensor_body(**changes: Any) -> dict[str, Any]:
    tensor: dict[str, Any] = dict(json_body()["tensor"])
    for name, value in changes.items():
        if value is None:
            tensor.pop(name)
        else:
            tensor[name] = value
    return json_body(tensor=tensor)


def as_json(body: Any) -> bytes:
    return json.dumps(body).encode()


def rejection(value: bytes | None, **kwargs: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        decode_request(value, **kwargs)
    assert info.value.reason in REASONS
    return info.value


# -- round trips ---------------------------------------------------------------------------------

ARRAYS: list[np.ndarray] = [
    np.arange(64, dtype=np.uint8).reshape(8, 8),
    np.array([[0, 255], [128, 1]], dtype=np.uint8),
    np.linspace(-3.5, 16.0, 64, dtype=np.float32).reshape(1, 8, 8),
    np.array([np.inf, -0.0, 1e-30, -1e30], dtype=np.float32),
    np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    np.zeros((0, 8), dtype=np.float32),
    np.array(7.5, dtype=np.float32),  # rank 0
]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("array", ARRAYS, ids=[f"{a.dtype}{list(a.shape)}" for a in ARRAYS])
def test_tensor_request_round_trips(codec: str, array: np.ndarray) -> None:
    request = make_request(array)

    decoded = decode_request(encode_request(request, codec))  # type: ignore[arg-type]

    assert decoded == request
    assert decoded.tensor is not None
    out = tensor_to_array(decoded.tensor)
    assert out.dtype == array.dtype and out.shape == array.shape
    np.testing.assert_array_equal(out, array)


@pytest.mark.parametrize("codec", CODECS)
def test_image_request_round_trips(codec: str) -> None:
    request = make_request(image=IMAGE)

    decoded = decode_request(encode_request(request, codec))  # type: ignore[arg-type]

    assert decoded == request
    assert decoded.image == IMAGE and decoded.tensor is None


def test_msgpack_carries_raw_bytes_and_json_base64() -> None:
    request = make_request(np.arange(64, dtype=np.uint8).reshape(8, 8), image=IMAGE)

    packed = msgpack.unpackb(encode_request(request, "msgpack"), raw=False)
    as_text = json.loads(encode_request(request, "json"))

    assert packed["tensor"]["data"] == bytes(range(64))
    assert packed["image"] == IMAGE
    assert base64.b64decode(as_text["tensor"]["data"]) == bytes(range(64))
    assert base64.b64decode(as_text["image"]) == IMAGE


def test_decode_request_detects_the_codec() -> None:
    request = make_request(np.full((8, 8), 9, dtype=np.uint8))
    packed = encode_request(request, "msgpack")
    text = encode_request(request, "json")
    assert packed != text

    assert decode_request(packed) == request
    assert decode_request(text) == request


@pytest.mark.parametrize("codec", CODECS)
def test_result_round_trips(codec: str) -> None:
    result = InferenceResult(
        request_id="r-1",
        device_id="dev-7",
        seq=42,
        model="digits",
        engine="onnxruntime-1.20.1:1ec95d21",
        model_version="1",
        outputs={"top_k": [{"label": "3", "score": 0.987654}, {"label": "8", "score": 0.01}]},
        attempt=0,
        queue_ms=0.125,
        infer_ms=1.5,
        e2e_ms=12.75,
        batch_id="w/b3",
        batch_size=4,
        worker="host:1",
        ts=1_700_000_001.5,
    ).to_dict()

    assert decode_result(encode_result(result, codec)) == result  # type: ignore[arg-type]


ORIGINAL_VALUES = [
    bytes(range(256)),
    b"",
    b"\xff\xfe not utf-8 \x00",
    encode_request(make_request(np.ones((8, 8), dtype=np.uint8)), "msgpack"),
]


@pytest.mark.parametrize("key", [None, b"dev-7", b"\x00\xff\x80"], ids=["no-key", "utf8", "binary"])
@pytest.mark.parametrize("value", ORIGINAL_VALUES, ids=["all-bytes", "empty", "garbage", "msgpack"])
def test_dead_letter_round_trips_original_bytes(key: bytes | None, value: bytes) -> None:
    letter = DeadLetter(
        value=value,
        key=key,
        error={
            "reason": "invalid_json",
            "type": "InvalidRequestError",
            "message": "m",
            "stage": "decode",
        },
        attempts=1,
        first_failed_ts=1_700_000_000.0,
        last_failed_ts=1_700_000_002.5,
        source={"topic": "inference-request", "partition": 3, "offset": 17},
        request_id=None,
        device_id=None,
        worker="host:1",
    )

    encoded = encode_dead_letter(letter)
    decoded = decode_dead_letter(encoded)

    assert decoded == letter
    assert decoded.value == value and decoded.key == key
    assert json.loads(encoded)["source"] == {
        "topic": "inference-request",
        "partition": 3,
        "offset": 17,
    }


# -- tensor_to_array -----------------------------------------------------------------------------


def test_tensor_to_array_gives_exact_values() -> None:
    values = [0.0, -1.5, 16.0, 1 / 3, np.finfo(np.float32).max, -np.inf]
    data = np.array(values, dtype="<f4").tobytes()

    array = tensor_to_array(TensorPayload("float32", (2, 3), data))

    assert array.dtype == np.float32 and array.shape == (2, 3)
    np.testing.assert_array_equal(array.ravel(), np.array(values, dtype=np.float32))
    assert not array.flags.writeable  # a view of the record's bytes


def test_tensor_to_array_uint8_row_major() -> None:
    array = tensor_to_array(TensorPayload("uint8", (2, 4), bytes([1, 2, 3, 4, 250, 251, 252, 0])))

    np.testing.assert_array_equal(array, [[1, 2, 3, 4], [250, 251, 252, 0]])


# -- rejections ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [b"not json", b'{"request_id": ', b"\xc3\x28\xa0\xa1 garbage", b"\xff\xfe\x00\x01", b" "],
    ids=["text", "truncated", "non-utf8", "bom-garbage", "blank"],
)
def test_invalid_json(value: bytes) -> None:
    error = rejection(value)

    assert error.reason == "invalid_json"
    assert "JSON" in error.message


@pytest.mark.parametrize("value", [b"", None], ids=["empty", "none"])
def test_empty_value_is_invalid_json(value: bytes | None) -> None:
    error = rejection(value)

    assert error.reason == "invalid_json"
    assert "empty" in error.message


@pytest.mark.parametrize("value", [b"[" * 100_000, b'{"a":' * 50_000], ids=["array", "object"])
def test_deeply_nested_json_is_invalid_json(value: bytes) -> None:
    # Under max_request_bytes, yet json.loads raises RecursionError: that must not escape.
    error = rejection(value)

    assert error.reason == "invalid_json"


def test_truncated_msgpack_map() -> None:
    value = encode_request(make_request(np.ones((8, 8), dtype=np.uint8)), "msgpack")

    error = rejection(value[:-10])

    assert error.reason == "invalid_msgpack"
    assert "msgpack" in error.message


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (b"\x81\xa1a" + b"\x91" * 3000 + b"\xc0",
         "cannot decode msgpack: arrays or maps are nested too deeply"),
        (b"\x81\xa1a\xc1", "cannot decode msgpack: it holds a byte that starts no msgpack "
                            "value (such as 0xc1)"),
        (b"\x81\xa1a\x01extra", "cannot decode msgpack: more bytes follow the first value; "
                                 "send one map per record"),
        (b"\x82\xa1a\x01", "cannot decode msgpack: it ends in the middle of a value "
                           "(truncated?)"),
        (b"\x81\xa1a\xa2\xff\xfe", "cannot decode msgpack: a string is not valid UTF-8 "
                                   "(byte 0xff)"),
        (b'{"seq": ' + b"1" * 5000 + b"}",
         "cannot decode JSON: an integer has more than 4300 digits; no field takes such a "
         "number"),
        (b"[" * 100_000, "cannot decode JSON: arrays or objects are nested too deeply"),
        (b'{"a": "\xff"}', "cannot decode JSON: it is not UTF-8 (byte 0xff at 7); send UTF-8 "
                          "JSON"),
    ],
    ids=["msgpack-deep", "msgpack-0xc1", "msgpack-extra", "msgpack-truncated",
         "msgpack-not-utf8", "json-huge-int", "json-deep", "json-not-utf8"],
)
def test_decode_failures_are_said_in_words_not_python_internals(value: bytes, message: str) -> None:
    error = rejection(value)

    assert error.message == message
    assert "sys." not in error.message and "Error" not in error.message


def test_msgpack_map_with_non_string_key() -> None:
    error = rejection(msgpack.packb({1: "x"}))

    assert error.reason == "invalid_msgpack"


@pytest.mark.parametrize(("body", "key"), [
    ({b"request_id": b"x", b"device_id": b"mal"}, "b'request_id'"),
    ({"request_id": "r", "device_id": "d", "seq": 1, "ts": 1.8e9, "model": "digits",
      "tensor": {b"dtype": "uint8", "shape": [8, 8], "data": bytes(64)}}, "b'dtype'"),
])
def test_msgpack_field_names_packed_as_bin_are_named(body: dict[Any, Any], key: str) -> None:
    # a trial's request read as one without its fields: 'missing_field: request_id'
    error = rejection(msgpack.packb(body, use_bin_type=True))

    assert error.reason == "invalid_msgpack"
    assert error.message == (f"a map key is bin data ({key}), not a string; field names are "
                             "msgpack strings (str, not bytes)")


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (as_json([1, 2, 3]), "list"),
        (as_json("a string"), "str"),
        (as_json(json_body(seq="3")), "'seq'"),
        (as_json(json_body(seq=True)), "'seq'"),
        (as_json(json_body(seq=3.0)), "'seq'"),
        (as_json(json_body(ts="now")), "'ts'"),
        (as_json(json_body(ts=False)), "'ts'"),
        (b'{"request_id":"r","device_id":"d","seq":1,"ts":NaN,"model":"m"}', "'ts'"),
        (as_json(json_body(request_id=7)), "'request_id'"),
        (as_json(json_body(model=["digits"])), "'model'"),
        (as_json(json_body(tensor=[1, 2])), "'tensor'"),
        (as_json(json_body(tensor=None, image=12)), "'image'"),
        (as_json(tensor_body(dtype=5)), "'dtype'"),
        (as_json(tensor_body(shape="8x8")), "'shape'"),
        (as_json(tensor_body(data=[0] * 64)), "'tensor.data'"),
    ],
    ids=[
        "top-level-list",
        "top-level-string",
        "seq-string",
        "seq-bool",
        "seq-float",
        "ts-string",
        "ts-bool",
        "ts-nan",
        "request_id-int",
        "model-list",
        "tensor-list",
        "image-int",
        "dtype-int",
        "shape-string",
        "data-list",
    ],
)
def test_wrong_type(value: bytes, named: str) -> None:
    error = rejection(value)

    assert error.reason == "wrong_type"
    assert named in error.message


def test_wrong_type_in_msgpack() -> None:
    body = json_body(seq="3")
    body["tensor"]["data"] = bytes(64)

    error = rejection(msgpack.packb(body, use_bin_type=True))

    assert error.reason == "wrong_type"
    assert "'seq'" in error.message


@pytest.mark.parametrize("field", ["request_id", "device_id", "seq", "ts", "model"])
def test_missing_required_field(field: str) -> None:
    error = rejection(as_json(json_body(**{field: None})))

    assert error.reason == "missing_field"
    assert repr(field) in error.message


def test_missing_tensor_and_image() -> None:
    error = rejection(as_json(json_body(tensor=None)))

    assert error.reason == "missing_field"
    assert "'tensor'" in error.message and "'image'" in error.message


@pytest.mark.parametrize(
    ("missing", "named"),
    [("data", "tensor.data"), ("dtype", "'dtype'"), ("shape", "'shape'")],
)
def test_tensor_without_a_field(missing: str, named: str) -> None:
    error = rejection(as_json(tensor_body(**{missing: None})))

    assert error.reason == "missing_field"
    assert named in error.message


def test_too_large() -> None:
    value = as_json(json_body())

    error = rejection(value, max_request_bytes=len(value) - 1)

    assert error.reason == "too_large"
    assert "max_request_bytes" in error.message and str(len(value)) in error.message
    assert decode_request(value, max_request_bytes=len(value)).seq == 3


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (tensor_body(data=base64.b64encode(bytes(63)).decode()), "63 bytes"),
        (tensor_body(dtype="float32"), "256 bytes"),  # 64 bytes given, float32[8, 8] needs 256
        (tensor_body(data="not base64!!"), "tensor.data"),
        (tensor_body(data="AAA"), "tensor.data"),  # bad padding
        (json_body(tensor=None, image="%%%"), "'image'"),
    ],
    ids=["short-data", "dtype-mismatch", "not-base64", "bad-padding", "image-not-base64"],
)
def test_bad_tensor(body: dict[str, Any], named: str) -> None:
    error = rejection(as_json(body))

    assert error.reason == "bad_tensor"
    assert named in error.message


def test_msgpack_tensor_byte_count_mismatch() -> None:
    body = json_body()
    body["tensor"]["data"] = bytes(65)

    error = rejection(msgpack.packb(body, use_bin_type=True))

    assert error.reason == "bad_tensor"
    assert "65 bytes" in error.message


def test_huge_claimed_shape_is_rejected_before_allocating() -> None:
    # 10^12 bytes claimed, 4 given: the size check must come before any array is built.
    value = as_json(tensor_body(shape=[100_000, 100_000, 100], data="AAAAAA=="))
    tracemalloc.start()
    try:
        started = time.perf_counter()
        error = rejection(value)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert error.reason == "bad_tensor"
    assert "1000000000000 bytes" in error.message
    assert elapsed < 1.0
    assert peak < 1 << 20


@pytest.mark.parametrize(
    "dtype", ["object", "<U4", "V8", "bool", "complex64", "float", "|f4", "<float32", "f16", ""]
)
def test_bad_dtype(dtype: str) -> None:
    error = rejection(as_json(tensor_body(dtype=dtype)))

    assert error.reason == "bad_dtype"
    assert repr(dtype) in error.message and "uint8" in error.message and "'<f4'" in error.message


@pytest.mark.parametrize("codec", ["json", "msgpack"])
@pytest.mark.parametrize(
    ("spelling", "name"),
    [("<f4", "float32"), ("=f4", "float32"), ("f4", "float32"), ("|u1", "uint8"),
     ("<u1", "uint8"), (">u1", "uint8"), ("<i8", "int64"), ("<f2", "float16"),
     (">f4", "float32"), (">i2", "int16"), (">f8", "float64")],
)
def test_numpy_dtype_spellings_give_the_same_tensor(codec: str, spelling: str, name: str) -> None:
    values = (np.arange(64) % 17).reshape(8, 8).astype(name)
    data = values.astype(np.dtype(spelling)).tobytes()  # in the spelling's own byte order
    carried = data if codec == "msgpack" else base64.b64encode(data).decode()
    body = json_body(tensor={"dtype": spelling, "shape": [8, 8], "data": carried})
    value = msgpack.packb(body, use_bin_type=True) if codec == "msgpack" else as_json(body)

    request = decode_request(value)

    assert request.tensor is not None and request.tensor.dtype == name
    np.testing.assert_array_equal(tensor_to_array(request.tensor), values)


@pytest.mark.parametrize("codec", ["json", "msgpack"])
def test_a_request_with_both_a_tensor_and_an_image_is_ambiguous(codec: str) -> None:
    png = b"\x89PNG\r\n\x1a\n" + bytes(16)
    body = json_body(image=png if codec == "msgpack" else base64.b64encode(png).decode())
    value = msgpack.packb(body, use_bin_type=True) if codec == "msgpack" else as_json(body)

    error = rejection(value)

    assert error.reason == "ambiguous_input"
    assert "both 'tensor' and 'image'" in error.message and "exactly one" in error.message
    assert error.fields["request_id"] == "r-1"  # the dead letter names the request


@pytest.mark.parametrize(
    ("device_id", "named"),
    [("tab\tdev", "U+0009 (a control character) at index 3"),
     ("nul\x00dev", "U+0000 (a control character) at index 3"),
     ("rtl-\u202e-abc", "U+202E (a format character) at index 4"),
     ("zw\u200bsp", "U+200B (a format character)"),
     ("line\u2028sep", "U+2028 (a line separator)"),
     ("d" * 257, "is 257 characters long; at most 256 are allowed"),
     ("", "'' is empty")],
    ids=["tab", "nul", "rtl-override", "zero-width-space", "line-separator", "257-chars",
         "empty"],
)
def test_a_device_id_no_view_could_answer_for_is_rejected(device_id: str, named: str) -> None:
    error = rejection(as_json(json_body(device_id=device_id)))

    assert error.reason == "bad_device_id"
    assert named in error.message and error.message.startswith("field 'device_id' ")


@pytest.mark.parametrize(
    "shape",
    [[-1, 8], [8, -64], [1] * 9, [8.0, 8], [True, 8], ["8", "8"]],
    ids=["negative", "negative-second", "rank-9", "float-dim", "bool-dim", "string-dims"],
)
def test_bad_shape(shape: list[Any]) -> None:
    error = rejection(as_json(tensor_body(shape=shape)))

    assert error.reason == "bad_shape"
    assert "shape" in error.message


def test_every_decode_reason_is_reachable() -> None:
    cases: dict[str, Callable[[], bytes]] = {
        "invalid_json": lambda: b"{",
        "invalid_msgpack": lambda: b"\x85\xa1",
        "wrong_type": lambda: b"[]",
        "missing_field": lambda: b"{}",
        "too_large": lambda: b"{" + b" " * (1 << 20) + b"}",
        "bad_tensor": lambda: as_json(tensor_body(data="")),
        "bad_dtype": lambda: as_json(tensor_body(dtype="object")),
        "bad_shape": lambda: as_json(tensor_body(shape=[-8, -8])),
        "bad_timestamp": lambda: as_json(json_body(ts=0)),
        "bad_device_id": lambda: as_json(json_body(device_id="tab\tdev")),
        "ambiguous_input": lambda: as_json(json_body(image="")),
        "bad_deadline": lambda: as_json({**json_body(), "deadline": 0}),
    }
    seen = {name: rejection(make()).reason for name, make in cases.items()}

    assert seen == {name: name for name in cases}
    # The rest are decided after decoding: by check_key, the pipeline or the model.
    assert set(REASONS) - set(cases) == {
        "empty_key",
        "key_mismatch",
        "unknown_model",
        "unknown_model_version",
        "unsupported_input",
        "non_finite",
            "out_of_range",
        "undecodable_image",
        "image_too_large",
        "duplicate_request_id",
        "inference_failed",
        "retries_exhausted",
        "invalid_retry_record",
        "unproducible_outcome",
        "undecodable_record_batch",
        "internal_error",
    }


# -- huge numbers ----------------------------------------------------------------------------------


def test_integer_literal_beyond_pythons_digit_limit_is_invalid_json() -> None:
    value = b'{"request_id":"r","seq":' + b"9" * 5000 + b"}"

    assert rejection(value).reason == "invalid_json"


def test_huge_integer_ts_is_wrong_type() -> None:
    value = as_json(json_body()).replace(b'"ts": 1700000000.5', b'"ts": ' + b"1" * 400)

    error = rejection(value)

    assert error.reason == "wrong_type"
    assert "'ts'" in error.message and len(error.message) < 200


@pytest.mark.parametrize("seq", [2**63, -(2**63) - 1, 10**30])
def test_seq_outside_int64_is_wrong_type(seq: int) -> None:
    error = rejection(as_json(json_body(seq=seq)))

    assert error.reason == "wrong_type"
    assert "'seq'" in error.message and "64-bit" in error.message


@pytest.mark.parametrize("seq", [0, 2**63 - 1, -(2**63)])
def test_seq_at_the_int64_bounds_is_accepted(seq: int) -> None:
    request = decode_request(as_json(json_body(seq=seq)))

    assert request.seq == seq
    assert decode_result(encode_result({"seq": request.seq}, "msgpack")) == {"seq": seq}


# -- extra-typed fields ----------------------------------------------------------------------------


def msgpack_body(**changes: Any) -> bytes:
    body = json_body(**changes)
    if isinstance(body.get("tensor"), dict) and isinstance(body["tensor"].get("data"), str):
        body["tensor"]["data"] = base64.b64decode(body["tensor"]["data"])
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (msgpack_body(tensor={"dtype": "uint8", "shape": "8,8", "data": bytes(64)}), "'shape'"),
        (msgpack_body(tensor={"dtype": "uint8", "shape": {"h": 8}, "data": bytes(64)}), "'shape'"),
        (msgpack_body(tensor={"dtype": b"uint8", "shape": [8, 8], "data": bytes(64)}), "'dtype'"),
        (msgpack_body(tensor={"dtype": "uint8", "shape": [8, 8], "data": 64}), "'tensor.data'"),
        (msgpack_body(tensor={"dtype": "uint8", "shape": [8, 8], "data": None}), "'tensor.data'"),
        (msgpack_body(tensor=None, image=[1, 2, 3]), "'image'"),
        (msgpack_body(tensor="AAAA"), "'tensor'"),
        (as_json(tensor_body(shape={"0": 8})), "'shape'"),
        (as_json(tensor_body(shape=8)), "'shape'"),
        (as_json(tensor_body(data=None) | {"tensor": {"dtype": "uint8", "shape": [8, 8],
                                                     "data": 7}}), "'tensor.data'"),
        (as_json(json_body(tensor=None, image={"png": "AAAA"})), "'image'"),
        (as_json(json_body(tensor=None, image=True)), "'image'"),
    ],
    ids=[
        "mp-shape-string", "mp-shape-map", "mp-dtype-bytes", "mp-data-int", "mp-data-nil",
        "mp-image-list", "mp-tensor-string", "json-shape-object", "json-shape-int",
        "json-data-int", "json-image-object", "json-image-bool",
    ],
)
def test_optional_fields_of_the_wrong_type(value: bytes, named: str) -> None:
    error = rejection(value)

    assert error.reason == "wrong_type"
    assert named in error.message


# -- timestamps ------------------------------------------------------------------------------------

NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("ts", "named"),
    [
        (0, "before 2001-01-01"),
        (-5.0, "before 2001-01-01"),
        (MIN_REQUEST_TS - 0.001, "before 2001-01-01"),
        (NOW + MAX_REQUEST_TS_AHEAD_S + 1, "ahead of the worker's clock"),
        (NOW * 1000, "milliseconds"),
    ],
    ids=["zero", "negative", "just-before-2001", "two-days-ahead", "milliseconds"],
)
@pytest.mark.parametrize("codec", CODECS)
def test_bad_timestamp(ts: float, named: str, codec: str) -> None:
    value = as_json(json_body(ts=ts)) if codec == "json" else msgpack_body(ts=ts)

    error = rejection(value, now=NOW)

    assert error.reason == "bad_timestamp"
    assert "'ts'" in error.message and named in error.message


@pytest.mark.parametrize("ts", [MIN_REQUEST_TS, 1.0e9, NOW - 86_400 * 365 * 20, NOW,
                                NOW + MAX_REQUEST_TS_AHEAD_S])
def test_timestamps_within_the_bounds_are_accepted(ts: float) -> None:
    assert decode_request(as_json(json_body(ts=ts)), now=NOW).ts == ts


def test_timestamp_bounds_are_2001_and_one_day() -> None:
    assert datetime.fromtimestamp(MIN_REQUEST_TS, UTC) == datetime(2001, 1, 1, tzinfo=UTC)
    assert MAX_REQUEST_TS_AHEAD_S == 24 * 3600


def test_timestamp_ahead_is_judged_against_the_current_clock() -> None:
    ahead = time.time() + 2 * MAX_REQUEST_TS_AHEAD_S

    assert rejection(as_json(json_body(ts=ahead))).reason == "bad_timestamp"
    assert decode_request(as_json(json_body(ts=time.time() + 60))).seq == 3


def test_structure_is_checked_before_the_timestamp() -> None:
    assert rejection(as_json(tensor_body(dtype="object") | {"ts": 0})).reason == "bad_dtype"


# -- record keys -----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [None, b""], ids=["null", "empty"])
def test_empty_key(key: bytes | None) -> None:
    request = make_request(np.ones((8, 8), dtype=np.uint8))

    with pytest.raises(InvalidRequestError) as info:
        check_key(key, request)

    assert info.value.reason == "empty_key"
    assert "'dev-7'" in info.value.message


@pytest.mark.parametrize(
    "key",
    [b"dev-8", b"DEV-7", b"dev-7 ", b"\"dev-7\"", b"dev-7\x00", b"\xff" * 1000],
    ids=["other", "case", "space", "json-quoted", "nul", "binary-long"],
)
def test_key_mismatch(key: bytes) -> None:
    request = make_request(np.ones((8, 8), dtype=np.uint8))

    with pytest.raises(InvalidRequestError) as info:
        check_key(key, request)

    assert info.value.reason == "key_mismatch"
    assert "'dev-7'" in info.value.message
    assert len(info.value.message) < 400  # a long key is shortened


def test_key_is_compared_as_utf8_bytes() -> None:
    request = InferenceRequest("r", "kamera-ö", 0, 1.7e9, "digits", image=b"x")

    check_key("kamera-ö".encode(), request)  # passes
    with pytest.raises(InvalidRequestError, match="not the request"):
        check_key("kamera-ö".encode("latin-1"), request)


# -- the optional deadline field (queue policy) --------------------------------------------------


@pytest.mark.parametrize("codec", ["json", "msgpack"])
def test_a_deadline_round_trips_and_its_absence_leaves_the_value_unchanged(codec: str) -> None:
    tensor = TensorPayload("uint8", (8, 8), bytes(64))
    plain = InferenceRequest("r-1", "dev-7", 3, 1_700_000_000.5, "digits", tensor=tensor)
    timed = dataclasses.replace(plain, deadline=200.0)

    assert decode_request(encode_request(timed, codec)).deadline == 200.0  # type: ignore[arg-type]
    value = encode_request(plain, codec)  # type: ignore[arg-type]
    assert b"deadline" not in value  # what an old worker or reader gets is unchanged
    assert decode_request(value).deadline is None
    # an old worker ignores the field; a new one reads an int or a null too
    assert decode_request(as_json({**json_body(), "deadline": 150})).deadline == 150.0
    assert decode_request(as_json({**json_body(), "deadline": None})).deadline is None


@pytest.mark.parametrize(
    ("deadline", "reason"),
    [(0, "bad_deadline"), (-5, "bad_deadline"), (86_400_001, "bad_deadline"),
     (10**400, "bad_deadline"), ("200", "wrong_type"), (True, "wrong_type"),
     ([200], "wrong_type")],
    ids=["zero", "negative", "over-a-day", "huge-int", "string", "bool", "list"],
)
def test_a_bad_deadline_is_rejected_with_a_reason(deadline: Any, reason: str) -> None:
    error = rejection(as_json({**json_body(), "deadline": deadline}))

    assert error.reason == reason and "'deadline'" in error.message
    assert error.fields["request_id"] == "r-1"
