"""The request decoder's fast path (``codecs._plain_request``) against the careful one
(``codecs._checked_request``), and the JSON written for results and dead letters (orjson).

The fast path may only ever answer with the very request the careful path builds; for anything
the careful path rejects it must step aside, so that the error (reason and message) is the
careful path's. Checked over the bad-input catalogue and over every field of a good request
replaced by each of a list of odd values.
"""

from __future__ import annotations

import base64
import json
import math
import time
from typing import Any

import msgpack
import numpy as np
import pytest

from streamapp import codecs
from streamapp.codecs import (
    MAX_DEADLINE_MS,
    MAX_REQUEST_TS_AHEAD_S,
    MIN_REQUEST_TS,
    canonical_dtype,
    decode_dead_letter,
    decode_request,
    decode_result,
    encode_dead_letter,
    encode_result,
)
from streamapp.exceptions import InvalidRequestError
from streamapp.records import DeadLetter, InferenceRequest
from tests.bad_inputs import bad_input_records

NOW = 1_796_000_000.0


class Text(str):
    """A str subclass: the fast path leaves it to the careful one."""


def body_of(value: bytes) -> tuple[Any, bool]:
    binary = value[:1] != b"" and value[0] in codecs._CONTAINER_HEADERS
    if binary:
        return msgpack.unpackb(value, raw=False, strict_map_key=True), True
    return json.loads(value.decode("utf-8")), False


def careful(body: dict[str, Any], binary: bool) -> InferenceRequest | tuple[str, str]:
    try:
        return codecs._checked_request(body, binary=binary, now=NOW)
    except InvalidRequestError as exc:
        return exc.reason, str(exc)


def assert_same(body: dict[str, Any], binary: bool) -> InferenceRequest | None:
    """The fast path gives the careful path's request, or None where that one raises; and
    the public decoder answers as the careful path. Returns the fast path's request."""
    expected = careful(body, binary)
    fast = codecs._plain_request(body, binary, NOW)
    if isinstance(expected, tuple):
        assert fast is None, f"the fast path accepted what the careful one rejects: {expected}"
        with pytest.raises(InvalidRequestError) as caught:
            codecs._request_from_body(body, binary=binary, now=NOW)
        assert (caught.value.reason, str(caught.value)) == expected
    else:
        if fast is not None:
            assert fast == expected
            assert type(fast.ts) is float and type(fast.tensor.shape) is tuple  # type: ignore
        assert codecs._request_from_body(body, binary=binary, now=NOW) == expected
    return fast


def good_body(binary: bool, dtype: str = "uint8") -> dict[str, Any]:
    pixels = (np.arange(64) % 17).astype(dtype).reshape(8, 8)
    data: Any = pixels.tobytes() if binary else base64.b64encode(pixels.tobytes()).decode()
    return {"request_id": "r-1", "device_id": "cam 7", "seq": 3, "ts": NOW - 1.5,
            "model": "digits", "tensor": {"dtype": dtype, "shape": [8, 8], "data": data}}


ODD_VALUES: list[Any] = [
    None, True, False, 0, 1, -1, 2**63 - 1, 2**63, -(2**63) - 1, 10**400, 0.0, -0.0, 1.5,
    float("nan"), float("inf"), -float("inf"), MIN_REQUEST_TS, MIN_REQUEST_TS - 1e-6,
    NOW + MAX_REQUEST_TS_AHEAD_S, NOW + MAX_REQUEST_TS_AHEAD_S + 1e-3, int(NOW), 2**53 + 1,
    MAX_DEADLINE_MS, MAX_DEADLINE_MS + 1, int(MAX_DEADLINE_MS), "", "x", "2", "d" * 64,
    "d" * 65, "d" * 256, "d" * 257, "tab\tdev", "\u202e", "\ud800", Text("text"), b"raw",
    b"", [], [8, 8], [8, -8], [8, True], [8.0, 8], [64], [1] * 9, [0, 8], {}, {"a": 1},
    "float32", ">f4", "<u1", "|u1", "|f4", "=f4", "u1", "object", "AAAA", "!!",
]


@pytest.mark.parametrize("binary", [False, True])
def test_the_fast_path_takes_good_requests(binary: bool) -> None:
    for dtype in ("uint8", "float32", "int16", "float64"):
        body = good_body(binary, dtype)
        for extra in ({}, {"deadline": 250}, {"deadline": 0.5}, {"model_version": "2"},
                      {"ts": int(NOW)}, {"image": None}, {"unknown": [1, 2]}):
            fast = assert_same({**body, **extra}, binary)
            assert fast is not None, f"a plain request took the slow path: {dtype} {extra}"
            assert fast.tensor is not None and fast.tensor.dtype == dtype


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("name", [
    "request_id", "device_id", "seq", "ts", "model", "tensor", "image", "model_version",
    "deadline", "tensor.dtype", "tensor.shape", "tensor.data",
])
def test_every_odd_value_of_a_field_decodes_as_the_careful_path_says(
    binary: bool, name: str
) -> None:
    base = good_body(binary)
    for value in [*ODD_VALUES, "MISSING"]:
        body = {**base, "tensor": dict(base["tensor"])}
        target, field = (body["tensor"], name[7:]) if name.startswith("tensor.") else (body, name)
        if value == "MISSING":
            target.pop(field, None)
        else:
            target[field] = value
        assert_same(body, binary)


def test_the_bad_input_catalogue_gets_the_careful_paths_reasons_and_messages() -> None:
    checked = 0
    for record in bad_input_records(now=NOW):
        if not record.value or len(record.value) > 1 << 20:
            continue
        try:
            body, binary = body_of(record.value)
        except (ValueError, msgpack.UnpackException):
            continue  # not a map: rejected before either path
        if isinstance(body, dict):
            assert_same(body, binary)
            checked += 1
    assert checked >= 30


def test_the_dtype_table_answers_as_canonical_dtype_parses() -> None:
    for spelling, answer in codecs._SPELLINGS.items():
        assert canonical_dtype(spelling) == answer
    assert canonical_dtype(">f4") == ("float32", True)
    assert canonical_dtype("|u1") == ("uint8", False)
    for bad in ("|f4", "object", "<U4", ">", ""):
        with pytest.raises(InvalidRequestError) as caught:
            canonical_dtype(bad)
        assert caught.value.reason == "bad_dtype"


def test_a_big_endian_tensor_takes_the_careful_path_and_is_swapped() -> None:
    pixels = (np.arange(64, dtype=np.float32).reshape(8, 8) / 8).astype(">f4")
    value = msgpack.packb({**good_body(True), "tensor": {
        "dtype": ">f4", "shape": [8, 8], "data": pixels.tobytes()}}, use_bin_type=True)
    request = decode_request(value, now=NOW)
    assert request.tensor is not None and request.tensor.data == pixels.astype("<f4").tobytes()


# -- result and dead-letter JSON -----------------------------------------------------------------


def _result(**changes: Any) -> dict[str, Any]:
    return {"request_id": "r-1", "device_id": "cam7", "seq": 3, "model": "digits",
            "outputs": {"top_k": [{"label": "3", "score": 0.998712}]}, "ts": 1796000000.26,
            "clock_skew_ms": None, **changes}


def _strict(value: bytes) -> Any:
    def refuse(token: str) -> Any:
        raise ValueError(f"not strict JSON: {token}")

    return json.loads(value, parse_constant=refuse)


def test_result_json_holds_the_same_values_as_json_dumps() -> None:
    floats = [0.0, -0.0, 1e16, 1e-7, 0.1 + 0.2, 5e-324, 1.7976931348623157e308, 123456789.123,
              time.time(), 0.998712, 1 / 3]
    result = _result(floats=floats, ints=[0, -(2**63), 2**64 - 1], text="ünïcødé ✓ \u2028",
                     nested={"a": [None, True, False]})
    value = encode_result(result)
    assert b" " not in encode_result(_result(floats=floats))  # compact, as separators=(",", ":")
    decoded = _strict(value)
    assert decoded == json.loads(json.dumps(result))
    # the same floats bit for bit, -0.0 included
    assert [math.copysign(1, f) for f in decoded["floats"]] == [math.copysign(1, f)
                                                                for f in floats]
    assert [f.hex() for f in decoded["floats"]] == [f.hex() for f in floats]
    assert decode_result(value) == decoded


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_score_is_written_as_null_and_the_result_stays_strict_json(
    bad: float
) -> None:
    result = _result(outputs={"top_k": [{"label": "3", "score": bad}]})
    decoded = _strict(encode_result(result))
    assert decoded["outputs"]["top_k"] == [{"label": "3", "score": None}]


@pytest.mark.parametrize("odd", [
    {"request_id": "\ud800-lone-surrogate"},  # valid in a JSON request, not UTF-8
    {"seq": 2**64},  # beyond orjson's 64 bits
    {"outputs": {1: "int key"}},
])
def test_what_orjson_refuses_is_written_as_before(odd: dict[str, Any]) -> None:
    result = _result(**odd, score=float("nan"))
    value = encode_result(result)
    expected = json.loads(json.dumps({**result, "score": None}))
    assert _strict(value) == expected


def test_msgpack_results_are_unchanged() -> None:
    result = _result(score=float("nan"))
    value = encode_result(result, "msgpack")
    assert value == msgpack.packb(result, use_bin_type=True)
    assert math.isnan(decode_result(value)["score"])


def test_a_dead_letter_round_trips_through_orjson() -> None:
    letter = DeadLetter(
        value=bytes(range(256)), key=b"cam\xff",
        error={"reason": "wrong_type", "type": "X", "message": "field 'seq' ✗", "stage": "decode"},
        attempts=1, first_failed_ts=NOW, last_failed_ts=NOW + 0.25, source={"topic": "t"},
        request_id="\ud800", device_id="cam", worker="w",
        errors=[{"attempt": 0, "ts": float("nan")}], extra={"value_omitted": {"bytes": 3}},
    )
    value = encode_dead_letter(letter)
    decoded = decode_dead_letter(value)
    assert decoded.value == letter.value and decoded.key == letter.key
    assert decoded.request_id == "\ud800" and decoded.error == letter.error
    assert decoded.errors == [{"attempt": 0, "ts": None}]
    _strict(value)
