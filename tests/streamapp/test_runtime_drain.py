"""A stopping worker's drain: what it waited for when it gave up is in the log line."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from streamapp import runtime
from streamapp.runtime import WorkerRuntime


class _Pipeline:
    def __init__(self, *, drain_hangs: bool = False, acks_hang: bool = False) -> None:
        self.drain_hangs, self.acks_hang = drain_hangs, acks_hang
        self.batcher = SimpleNamespace(drain=self._drain)
        self.flushed = False

    async def _drain(self) -> None:
        if self.drain_hangs:
            await asyncio.Event().wait()

    async def wait_acknowledged(self) -> None:
        if self.acks_hang:
            await asyncio.Event().wait()

    async def flush_state(self) -> None:
        self.flushed = True


@pytest.mark.parametrize(("pipeline", "named"), [
    (_Pipeline(drain_hangs=True), "the batches in flight did not end within"),
    (_Pipeline(acks_hang=True), "the broker's acknowledgements did not end within"),
])
async def test_a_drain_that_times_out_says_what_it_waited_for(
    pipeline: _Pipeline, named: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A new-user trial saw 'stopping with requests in flight ()': a timeout has no message."""
    monkeypatch.setattr(runtime, "DRAIN_TIMEOUT_S", 0.05)
    host: Any = SimpleNamespace(_scheduler=None, _host=None)
    with caplog.at_level(logging.WARNING, logger="streamapp.runtime"):
        await WorkerRuntime._drain(host, pipeline)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records if "requests in flight" in r.getMessage()]
    assert len(lines) == 1 and named in lines[0] and "()" not in lines[0]
    assert pipeline.flushed  # the device state of what was answered is still written
