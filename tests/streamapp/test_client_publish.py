"""``streamapp.client.publish`` when the broker stops answering part way (issue: a broker
frozen with SIGSTOP): the error says how many frames were sent and acknowledged; a client whose
broker does not answer at all says so in the CLI's words."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from aiokafka.errors import RequestTimedOutError

from streamapp import client
from streamapp.exceptions import BrokerError, PublishError


class _StallingProducer:
    """Acknowledges the first ``acked`` sends; the later ones time out."""

    def __init__(self, acked: int) -> None:
        self.acked, self.sends = acked, 0

    async def send(self, *_args: Any, **_kwargs: Any) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.sends < self.acked:
            future.set_result(None)
        else:
            future.set_exception(RequestTimedOutError("RequestTimedOutError: no answer"))
        self.sends += 1
        return future

    async def stop(self) -> None:
        pass


async def test_a_failed_publish_says_how_many_were_sent_and_acknowledged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    producer = _StallingProducer(acked=3_120)

    async def nothing(*_args: Any, **_kwargs: Any) -> None:
        return None

    monkeypatch.setattr(client, "_ensure_topic", nothing)
    monkeypatch.setattr(client, "start_or_close", nothing)
    monkeypatch.setattr(client, "_producer", lambda *_args: producer)
    images = np.zeros((10, 8, 8), dtype=np.uint8)
    requests = client.digits_requests(images, devices=4, model="digits",
                                      indices=[i % 10 for i in range(4_000)])

    with pytest.raises(PublishError) as raised:
        await client.publish("127.0.0.1:9092", "inference-request", requests)

    error = raised.value
    assert (error.sent, error.acknowledged, error.total) == (4_000, 3_120, 4_000)
    assert str(error) == (
        "publishing to inference-request on 127.0.0.1:9092 failed after 4,000 of 4,000 frames "
        "were sent: 3,120 of 4,000 acknowledged; the rest may or may not have arrived "
        "(RequestTimedOutError: no answer). Read the topic (or the results) before publishing "
        "them again")


async def test_a_client_without_a_broker_says_so_in_one_clean_line() -> None:
    nowhere = client.AsyncClient("kafka://127.0.0.1:1")
    try:
        with pytest.raises(BrokerError) as raised:
            await nowhere.send("cam-1", np.zeros((8, 8), np.uint8))
    finally:
        await nowhere.close()
    # not the admin client's "Cannot create topics [...] KafkaConnectionError: Unable to ..."
    assert str(raised.value) == (
        "cannot talk to the broker at 127.0.0.1:1: no broker answered (connection refused or "
        "timed out). Is it running (streamapp broker), and are the broker argument / "
        "STREAMAPP_BROKER and the security settings right?")
