"""Retry records are input too (issue 10, item 2): every field is validated before anything is
scheduled, and the delay scheduler survives a failing item and always stops."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import msgpack
import pytest

from streamapp.exceptions import InvalidRequestError
from streamapp.retry import DelayScheduler, RetryRecord

NOW = 1_800_000_000.0


def record() -> RetryRecord:
    return RetryRecord(
        request_id="rr-nb", device_id="cam-1", model="digits", attempt=1, not_before=NOW + 0.2,
        errors=[{"attempt": 0, "reason": "engine_runtime_error", "type": "EngineRuntimeError",
                 "message": "boom", "ts": NOW}],
        first_failed_ts=NOW, source={"topic": "inference-request", "partition": 2, "offset": 7},
        key=b"cam-1", value=b'{"request_id": "rr-nb"}',
    )


def changed(**changes: Any) -> bytes:
    body = json.loads(record().encode())
    for name, value in changes.items():
        if value is _DROP:
            del body[name]
        else:
            body[name] = value
    return json.dumps(body).encode()


_DROP = object()

#: One of each kind of wrong field, and wrong values as a whole: (value, words in the message).
INVALID: dict[str, tuple[bytes | None, str]] = {
    "not_before-text": (changed(not_before="soon"), "not_before"),
    "request_id-int": (changed(request_id=123), "request_id"),
    "request_id-empty": (changed(request_id=""), "request_id"),
    "device_id-null": (changed(device_id=None), "device_id"),
    "model-list": (changed(model=["digits"]), "model"),
    "attempt-zero": (changed(attempt=0), "attempt"),
    "attempt-bool": (changed(attempt=True), "attempt"),
    "attempt-text": (changed(attempt="1"), "attempt"),
    "attempt-float": (changed(attempt=1.5), "attempt"),
    "not_before-far-ahead": (changed(not_before=NOW + 10 * 86_400), "not_before"),
    "not_before-negative": (changed(not_before=-1.0), "not_before"),
    "first_failed_ts-text": (changed(first_failed_ts="yesterday"), "first_failed_ts"),
    "errors-not-list": (changed(errors={"reason": "x"}), "errors"),
    "errors-entry-text": (changed(errors=["boom"]), "errors.0"),
    "errors-entry-missing-reason": (
        changed(errors=[{"attempt": 0, "type": "E", "message": "m", "ts": NOW}]), "reason"
    ),
    "source-missing-offset": (changed(source={"topic": "t", "partition": 0}), "source.offset"),
    "source-negative-partition": (
        changed(source={"topic": "t", "partition": -1, "offset": 0}), "source.partition"
    ),
    "key-not-base64": (changed(key="%%%"), "key"),
    "value-missing": (changed(value=_DROP), "value"),
    "value-number": (changed(value=5), "value"),
    "extra-list": (changed(extra=[1]), "extra"),
    "missing-everything": (b"{}", "request_id"),
    "json-list": (b"[1, 2]", "list"),
    "json-string": (b'"retry"', "str"),
    "not-json": (b"\x00\xff", "JSON"),
    "msgpack-map": (bytes(msgpack.packb(json.loads(record().encode()))), "JSON"),
    "empty": (b"", "JSON"),
    "tombstone": (None, "JSON"),
    "nan-time": (changed(not_before=float("nan")), "not_before"),
}


def test_a_record_written_by_encode_decodes_to_the_same_record() -> None:
    assert RetryRecord.decode(record().encode(), now=NOW) == record()


@pytest.mark.parametrize("case", list(INVALID), ids=list(INVALID))
def test_every_wrong_field_is_an_invalid_retry_record_naming_it(case: str) -> None:
    value, words = INVALID[case]
    with pytest.raises(InvalidRequestError) as info:
        RetryRecord.decode(value, now=NOW)
    assert info.value.reason == "invalid_retry_record"
    assert words in info.value.message
    assert "only streamapp workers should write to the retry topic" in info.value.message


def test_the_readable_ids_of_an_invalid_record_are_kept_for_its_dead_letter() -> None:
    with pytest.raises(InvalidRequestError) as info:
        RetryRecord.decode(changed(not_before="soon"), now=NOW)
    assert info.value.fields == {"request_id": "rr-nb", "device_id": "cam-1", "model": "digits"}
    with pytest.raises(InvalidRequestError) as info:
        RetryRecord.decode(changed(request_id=123), now=NOW)
    assert info.value.fields == {"device_id": "cam-1", "model": "digits"}


def test_a_huge_invalid_value_gives_a_short_message() -> None:
    with pytest.raises(InvalidRequestError) as info:
        RetryRecord.decode(changed(errors=[{"x": "y" * 100_000}] * 50), now=NOW)
    assert len(info.value.message) < 1_000


async def test_a_failing_item_does_not_stop_the_scheduler_and_stop_never_raises() -> None:
    ran: list[str] = []

    async def run(item: str) -> None:
        if item == "poison":
            raise TypeError("a bug in the callback")
        ran.append(item)

    clock = [NOW]
    scheduler = DelayScheduler(run, clock=lambda: clock[0])
    scheduler.start()
    await scheduler.add(NOW - 2, "first")
    await scheduler.add(NOW - 1, "poison")
    await scheduler.add(NOW, "after")
    async with asyncio.timeout(10):
        while ran != ["first", "after"]:
            await asyncio.sleep(0)
    await scheduler.stop()
    await scheduler.stop()  # idempotent


@pytest.mark.parametrize("due", ["soon", None, float("nan"), float("inf"), True])
async def test_a_due_time_that_is_not_a_finite_number_is_refused(due: Any) -> None:
    async def run(item: str) -> None:
        return None

    scheduler = DelayScheduler(run)
    with pytest.raises((TypeError, ValueError)):
        await scheduler.add(due, "x")
    assert len(scheduler) == 0


def test_base64_round_trip_of_binary_key_and_value() -> None:
    r = record()
    r.key, r.value = None, bytes(range(256))
    body = json.loads(r.encode())
    assert body["key"] is None and base64.b64decode(body["value"]) == bytes(range(256))
    assert RetryRecord.decode(r.encode(), now=NOW) == r
