"""``streamapp.replies.ReplyWaiter``'s matching, record by record (no broker): results by
``request_id``, dead letters by ``request_id`` or by ``source`` — also when the dead letter is
read before the producer's acknowledgement says where the request went."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from streamapp.codecs import encode_dead_letter, encode_result
from streamapp.exceptions import BrokerError
from streamapp.records import DeadLetter
from streamapp.replies import ReplyWaiter

REQUESTS = "inference-request"


def result(request_id: str, label: str) -> bytes:
    return encode_result({"request_id": request_id, "device_id": "cam1", "seq": 0,
                          "model": "digits", "engine": "fake", "e2e_ms": 1.0,
                          "outputs": {"top_k": [{"label": label, "score": 0.9}]}})


def letter(request_id: str | None, offset: int, reason: str = "too_large") -> bytes:
    return encode_dead_letter(DeadLetter(
        value=b"{}", key=b"cam1", error={"reason": reason, "type": "InvalidRequestError",
                                         "message": "m", "stage": "decode"},
        attempts=1, first_failed_ts=1.8e9, last_failed_ts=1.8e9, request_id=request_id,
        source={"topic": REQUESTS, "partition": 2, "offset": offset}))


@pytest.fixture
async def waiter() -> AsyncIterator[ReplyWaiter]:
    """A waiter whose consumer never starts (the records are handed to it directly)."""
    waiter = ReplyWaiter("127.0.0.1:1", "inference-result", "inference-dlq")
    yield waiter
    await waiter.stop()


async def test_results_by_request_id_first_one_wins(waiter: ReplyWaiter) -> None:
    first, second = waiter.expect("r1"), waiter.expect("r2")
    waiter._on_result(result("someone-else", "7"))
    waiter._on_result(result("r2", "3"))
    waiter._on_result(result("r2", "5"))  # a duplicate after a restart
    waiter._on_result(b"\xc1 not a result")

    assert not first.done() and second.result().label == "3"
    assert second.result().score == 0.9 and second.result().ok
    assert waiter.skipped == 1


async def test_dead_letters_by_request_id_and_by_source(waiter: ReplyWaiter) -> None:
    by_id, by_source, early = waiter.expect("r1"), waiter.expect("r2"), waiter.expect("r3")
    waiter.published("r2", REQUESTS, 2, 41)
    waiter._on_dead_letter(letter("r1", 40, "bad_shape"))
    waiter._on_dead_letter(letter(None, 41))
    waiter._on_dead_letter(letter(None, 42))  # read before r3's acknowledgement
    assert not early.done()
    waiter.published("r3", REQUESTS, 2, 42)

    assert by_id.result().reason == "bad_shape" and not by_id.result().ok
    assert by_source.result().reason == "too_large" and by_source.result().label is None
    assert early.result().reason == "too_large"


async def test_a_second_wait_for_one_id_and_stop(waiter: ReplyWaiter) -> None:
    pending = waiter.expect("r1")
    with pytest.raises(ValueError, match="request_id 'r1' is awaited already"):
        waiter.expect("r1")
    await waiter.stop()
    with pytest.raises(BrokerError, match="the client was closed before the answer arrived"):
        pending.result()
