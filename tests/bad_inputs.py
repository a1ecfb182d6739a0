"""A catalogue of bad input, as raw Kafka records, shared by unit and integration tests.

:func:`bad_input_records` gives ``(kind, expected reason, key, value)`` records: one or more per
reason that a record's key and value alone decide, for the bundled ``digits`` model.
"""

from __future__ import annotations

import base64
import io
import json
import time
from dataclasses import dataclass

import msgpack
import numpy as np
from PIL import Image


@dataclass(frozen=True)
class BadInput:
    kind: str
    reason: str
    key: bytes | None
    value: bytes


def bad_input_records(device: str = "dev-bad", now: float | None = None) -> list[BadInput]:
    """One record per kind of bad input, for the digits model, keyed by ``device``.

    Args:
        device: The device id put in the key and value.
        now: The clock the timestamps are relative to (default: now).
    """
    ts = time.time() if now is None else now
    digit = np.arange(64, dtype=np.uint8).reshape(8, 8) % 17
    tensor = {"dtype": "uint8", "shape": [8, 8], "data": base64.b64encode(digit.tobytes()).decode()}
    base = {"request_id": "bad", "device_id": device, "seq": 0, "ts": ts, "model": "digits",
            "tensor": tensor}
    key = device.encode()

    def js(kind: str, **changes: object) -> bytes:
        body = {**base, "request_id": f"bad-{kind}", **changes}
        return json.dumps({k: v for k, v in body.items() if v is not None}).encode()

    def mp(kind: str, **changes: object) -> bytes:
        body = {**base, "request_id": f"bad-{kind}",
                "tensor": {**tensor, "data": digit.tobytes()}, **changes}
        return msgpack.packb({k: v for k, v in body.items() if v is not None}, use_bin_type=True)

    nan = digit.astype(np.float32)
    nan[2, 3] = np.nan
    png = io.BytesIO()
    Image.new("L", (32, 32)).save(png, format="PNG")
    gif = io.BytesIO()
    Image.new("L", (32, 32)).save(gif, format="GIF")
    bomb = io.BytesIO()
    Image.new("1", (4000, 4000)).save(bomb, format="PNG")

    records = [
        ("not-json", "invalid_json", key, b"{this is not json"),
        ("empty-value", "invalid_json", key, b""),
        ("not-msgpack", "invalid_msgpack", key, b"\x85\xa3abc\xc1"),
        ("top-level-list", "wrong_type", key, b"[1, 2, 3]"),
        ("seq-string", "wrong_type", key, js("seq-string", seq="7")),
        ("shape-not-list", "wrong_type", key, js("shape-not-list",
                                                 tensor={**tensor, "shape": "8x8"})),
        ("missing-field", "missing_field", key, js("missing-field", model=None)),
        ("no-input", "missing_field", key, js("no-input", tensor=None)),
        ("too-large", "too_large", key, js("too-large", padding="x" * (1 << 20))),
        ("image-bomb", "image_too_large", key, js("image-bomb", tensor=None,
                                            image=base64.b64encode(bomb.getvalue()).decode())),
        ("count-mismatch", "bad_tensor", key, js("count-mismatch", tensor={
            **tensor, "data": base64.b64encode(bytes(63)).decode()})),
        ("not-base64", "bad_tensor", key, js("not-base64", tensor={**tensor, "data": "!!"})),
        ("dtype-not-allowed", "bad_dtype", key, js("dtype-not-allowed", tensor={
            **tensor, "dtype": "object"})),
        ("dtype-not-the-models", "bad_dtype", key, js("dtype-not-the-models", tensor={
            "dtype": "int32", "shape": [8, 8],
            "data": base64.b64encode(digit.astype(np.int32).tobytes()).decode()})),
        ("shape-mismatch", "bad_shape", key, mp("shape-mismatch", tensor={
            "dtype": "uint8", "shape": [4, 16], "data": digit.tobytes()})),
        ("nan", "non_finite", key, mp("nan", tensor={
            "dtype": "float32", "shape": [8, 8], "data": nan.tobytes()})),
        ("undecodable-image", "undecodable_image", key, js("undecodable-image", tensor=None,
            image=base64.b64encode(png.getvalue()[:40]).decode())),
        ("gif-image", "undecodable_image", key, mp("gif-image", tensor=None,
                                                    image=gif.getvalue())),
        ("null-key", "empty_key", None, js("null-key")),
        ("empty-key", "empty_key", b"", js("empty-key")),
        ("other-key", "key_mismatch", b"dev-other", js("other-key")),
        ("ts-zero", "bad_timestamp", key, js("ts-zero", ts=0)),
        ("ts-milliseconds", "bad_timestamp", key, js("ts-milliseconds", ts=ts * 1000)),
        ("unknown-model", "unknown_model", key, js("unknown-model", model="resnet-9000")),
        ("version-not-loaded", "unknown_model_version", key, js("version-not-loaded",
                                                                model_version="99")),
        ("deadline-zero", "bad_deadline", key, js("deadline-zero", deadline=0)),
        ("deadline-inf", "bad_deadline", key, mp("deadline-inf", deadline=float("inf"))),
        *((f"device-{kind}", "bad_device_id", bad_id.encode(), js(f"device-{kind}",
                                                                device_id=bad_id))
          for kind, bad_id in (("tab", "tab\tdev"), ("nul", "nul\x00dev"),
                               ("rtl", "rtl-\u202e-abc"), ("257-chars", "d" * 257))),
        ("tensor-and-image", "ambiguous_input", key, js("tensor-and-image",
            image=base64.b64encode(png.getvalue()).decode())),
        ("mp-tensor-and-image", "ambiguous_input", key, mp("mp-tensor-and-image",
                                                          image=png.getvalue())),
        ("raw-pixels", "out_of_range", key, mp("raw-pixels", tensor={
            "dtype": "uint8", "shape": [8, 8], "data": bytes([255] * 64)})),
        ("float-out-of-range", "out_of_range", key, js("float-out-of-range", tensor={
            "dtype": "<f4", "shape": [8, 8],
            "data": base64.b64encode((digit.astype("<f4") - 1).tobytes()).decode()})),
    ]
    return [BadInput(*record) for record in records]
