"""The executor server and its client on CPU (ONNX Runtime, the bundled digits model): the
predictions equal the in-process executor's, sub-batches of two clients are merged into one
engine batch, a batch in flight when the server dies runs again on the restarted server, and
one whose server stays away longer than ``wait_s`` fails with the retriable error."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.base import Engine
from engines.exceptions import EngineRuntimeError, ExecutorUnavailableError, InputSpecError
from engines.executor import Item, ThreadExecutor
from engines.registry import load_engine
from engines.server import ExecutorServer, SharedExecutor, query_stats

DIGITS = Path(__file__).resolve().parents[3] / "streamapp" / "models" / "digits" / "model.onnx"


class CountingExecutor(ThreadExecutor):
    """A thread executor that records the size of every batch its engine runs."""

    def __init__(self, engine: Engine, **kwargs: Any) -> None:
        super().__init__(engine, **kwargs)
        self.sizes: list[int] = []

    async def run(self, items: Sequence[Item]) -> dict[str, np.ndarray]:
        self.sizes.append(len(items))
        return await super().run(items)


@pytest.fixture
def engine() -> Iterator[Engine]:
    with load_engine("onnxruntime", DIGITS, max_batch_size=16, intra_op_threads=1) as e:
        yield e


@pytest.fixture
def frames() -> np.ndarray:
    """Real digits as the engine takes them: float32[64, 1, 8, 8] (pixel / 16)."""
    from sklearn.datasets import load_digits

    return (load_digits().images[:64] / 16.0).astype(np.float32).reshape(64, 1, 8, 8)


def _items(x: np.ndarray) -> list[dict[str, np.ndarray]]:
    return [{"input": row} for row in x]


@contextmanager
def serving(executors: Mapping[str, Any], path: Path, **options: Any) -> Iterator[ExecutorServer]:
    """An :class:`ExecutorServer` on its own event loop in a thread (as in its own process)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = ExecutorServer(executors, path, **options)
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _client(path: Path, model: str = "digits", **kwargs: Any) -> SharedExecutor:
    return await asyncio.to_thread(SharedExecutor, path, model, **kwargs)


async def test_predictions_equal_the_in_process_executor(
    engine: Engine, frames: np.ndarray, tmp_path: Path,
) -> None:
    local = ThreadExecutor(engine)
    expected = [await local.run(_items(frames[i:i + 16])) for i in range(0, 64, 16)]
    with serving({"digits": ThreadExecutor(engine)}, tmp_path / "s.sock",
                 batch_delay_ms=0.0) as server:
        client = await _client(tmp_path / "s.sock")
        try:
            got = [await client.run(_items(frames[i:i + 16])) for i in range(0, 64, 16)]
            inline = await _client(tmp_path / "s.sock", shm=False)  # the socket fallback
            got_inline = await inline.run(_items(frames[:16]))
            await inline.close()
        finally:
            await client.close()
        assert client.engine.inputs == engine.inputs and client.max_batch == 16
        assert server.stats["digits"].rows == 64 + 16
    for want, have in zip(expected, got, strict=True):
        assert have["probs"].dtype == np.float32 and have["probs"].shape == (16, 10)
        np.testing.assert_array_equal(have["probs"], want["probs"])
    np.testing.assert_array_equal(got_inline["probs"], expected[0]["probs"])
    assert [int(p) for p in got[0]["probs"].argmax(axis=1)][:5] == [0, 1, 2, 3, 4]
    await local.close()


async def test_float16_items_are_widened_exactly_where_they_are_packed(
    engine: Engine, frames: np.ndarray, tmp_path: Path,
) -> None:
    # a gateway's float16 tensors: the digits' pixel / 16 values are exact in float16
    halves = frames.astype(np.float16)
    local = ThreadExecutor(engine, max_inflight=1)
    want = await local.run(_items(frames[:16]))
    got_local = await local.run(_items(halves[:16]))
    got_mixed = await local.run([*_items(frames[:8]), *_items(halves[8:16])])
    with serving({"digits": ThreadExecutor(engine)}, tmp_path / "s.sock",
                 batch_delay_ms=0.0):
        client = await _client(tmp_path / "s.sock")
        inline = await _client(tmp_path / "s.sock", shm=False)
        try:
            got_shared = await client.run(_items(halves[:16]))
            got_inline = await inline.run(_items(halves[:16]))
        finally:
            await client.close()
            await inline.close()
        with pytest.raises(InputSpecError, match="item 3 input 'input' is int8"):
            await local.run([*_items(frames[:3]), {"input": frames[3].astype(np.int8)}])
    for got in (got_local, got_mixed, got_shared, got_inline):
        np.testing.assert_array_equal(got["probs"], want["probs"])
    # outputs are the caller's: the next batch into the same staging buffer leaves them alone
    before = got_local["probs"].copy()
    await local.run(_items(frames[16:32]))
    np.testing.assert_array_equal(got_local["probs"], before)
    await local.close()


async def test_two_clients_batches_of_8_reach_the_engine_as_one_batch_of_16(
    engine: Engine, frames: np.ndarray, tmp_path: Path,
) -> None:
    """The merged batch can close only when full (a delay of 60 s), so the engine's one batch
    of 16 is both clients' sub-batches; each client gets its own rows back."""
    local = await ThreadExecutor(engine).run(_items(frames[:16]))
    counting = CountingExecutor(engine)
    path = tmp_path / "s.sock"
    with serving({"digits": counting}, path, batch_delay_ms=60_000.0):
        a, b = await _client(path), await _client(path)
        try:
            out_a, out_b = await asyncio.wait_for(asyncio.gather(
                a.run(_items(frames[:8])), b.run(_items(frames[8:16]))), 30)
            stats = query_stats(path)["digits"]
        finally:
            await a.close()
            await b.close()
    assert counting.sizes == [16]
    assert stats["batches"] == 1 and stats["sub_batches"] == 2 and stats["merged"] == 1
    assert stats["mean_batch"] == 16.0 and stats["sizes"] == {"16": 1}
    np.testing.assert_array_equal(out_a["probs"], local["probs"][:8])
    np.testing.assert_array_equal(out_b["probs"], local["probs"][8:])


class PoisonExecutor(CountingExecutor):
    """Fails every batch that holds a row whose first pixel is -1 (a stand-in for a request
    that breaks the engine), and records the rows of every batch it runs."""

    def __init__(self, engine: Engine, **kwargs: Any) -> None:
        super().__init__(engine, **kwargs)
        self.batches: list[list[float]] = []

    async def run(self, items: Sequence[Item]) -> dict[str, np.ndarray]:
        self.batches.append([float(np.asarray(i["input"]).flat[1]) for i in items])
        if any(float(np.asarray(i["input"]).flat[0]) == -1.0 for i in items):
            self.sizes.append(len(items))
            raise EngineRuntimeError(f"a poison row in a batch of {len(items)}")
        return await super().run(items)


async def _local(engine: Engine, x: np.ndarray) -> dict[str, np.ndarray]:
    """The in-process executor's outputs for ``x``, in batches of 16."""
    executor = ThreadExecutor(engine)
    try:
        parts = [await executor.run(_items(x[i:i + 16])) for i in range(0, len(x), 16)]
    finally:
        await executor.close()
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


async def _until_queued(path: Path, n: int, timeout_s: float = 10.0) -> None:
    """Wait until the server has received ``n`` sub-batches in all."""
    deadline = time.monotonic() + timeout_s
    while (await asyncio.to_thread(query_stats, path))["digits"]["sub_batches"] < n:
        assert time.monotonic() < deadline, f"the server did not get {n} sub-batches"
        await asyncio.sleep(0.005)


def _tagged(x: np.ndarray, first: int) -> np.ndarray:
    """``x`` with pixel 1 of each row set to its row number from ``first`` (which rows ran
    where), everything else as it was."""
    out = x.copy()
    out.reshape(len(x), -1)[:, 1] = np.arange(first, first + len(x))
    return out


async def test_sub_batches_that_do_not_fit_are_split_so_every_engine_batch_is_full(
    engine: Engine, frames: np.ndarray, tmp_path: Path,
) -> None:
    """Three clients send 12, 12 and 8 rows to a server of batches of 16: whatever order they
    arrive in, the engine runs two full batches of 16 (one sub-batch split across them), not
    three of 12, 12 and 8, and each client gets its own rows' predictions in its order."""
    x = _tagged(frames[:32], 0)
    local = await _local(engine, x)
    counting = CountingExecutor(engine)
    path = tmp_path / "s.sock"
    with serving({"digits": counting}, path, batch_delay_ms=60_000.0):
        clients = [await _client(path) for _ in range(3)]
        try:
            outs = await asyncio.wait_for(asyncio.gather(
                clients[0].run(_items(x[:12])), clients[1].run(_items(x[12:24])),
                clients[2].run(_items(x[24:32]))), 30)
            stats = query_stats(path)["digits"]
        finally:
            for c in clients:
                await c.close()
    assert counting.sizes == [16, 16]
    assert stats["batches"] == 2 and stats["sub_batches"] == 3 and stats["split"] == 1
    assert stats["merged"] == 2 and stats["sizes"] == {"16": 2}
    for out, rows in zip(outs, (slice(0, 12), slice(12, 24), slice(24, 32)), strict=True):
        np.testing.assert_array_equal(out["probs"], local["probs"][rows])


@pytest.mark.parametrize("poison_row", [2, 10])
async def test_a_split_sub_batch_with_a_poison_row_fails_alone_and_only_once_done(
    poison_row: int, engine: Engine, frames: np.ndarray, tmp_path: Path,
) -> None:
    """A client's 12 rows with a poison row (in the first piece or in the rest of a split),
    between two clients' good rows, on batches of 16: the merged batch that holds the poison
    row fails, its pieces run alone, the poisoned client gets the engine's error, the others
    their predictions, no batch that starts after that error holds any of the poisoned
    client's rows, and the server keeps serving (a failed first piece once left its queued
    rest with a negative row count, and the batcher spun forever: a new-user trial)."""
    good_a, bad, good_c = _tagged(frames[:12], 0), _tagged(frames[12:24], 100), \
        _tagged(frames[24:32], 200)
    bad.reshape(12, -1)[poison_row, 0] = -1.0
    local = await _local(engine, np.concatenate([good_a, good_c]))
    poison = PoisonExecutor(engine)
    path = tmp_path / "s.sock"
    # a delay, not only full batches: a failed piece drops its sub-batch's queued rest, so
    # what follows it may not fill a batch
    with serving({"digits": poison}, path, batch_delay_ms=2_000.0):
        clients = [await _client(path) for _ in range(3)]
        try:
            # in this order (each queued before the next is sent), so that the poisoned
            # sub-batch is split: A's 12 rows and B's first 4, then B's other 8 and C's 8
            runs = []
            for n, (client, x) in enumerate(zip(clients, (good_a, bad, good_c), strict=True)):
                runs.append(asyncio.ensure_future(client.run(_items(x))))
                await _until_queued(path, n + 1)
            outs = await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 30)
            again = await asyncio.wait_for(asyncio.gather(  # the server still serves
                clients[0].run(_items(good_a)), clients[1].run(_items(good_a)),
                clients[2].run(_items(good_c))), 30)
            stats = query_stats(path)["digits"]
        finally:
            for c in clients:
                await c.close()
    a, b, c = outs
    assert isinstance(b, EngineRuntimeError) and "a poison row" in str(b)
    assert isinstance(a, dict) and isinstance(c, dict)
    np.testing.assert_array_equal(a["probs"], local["probs"][:12])
    np.testing.assert_array_equal(c["probs"], local["probs"][12:])
    np.testing.assert_array_equal(again[0]["probs"], local["probs"][:12])
    np.testing.assert_array_equal(again[1]["probs"], local["probs"][:12])
    np.testing.assert_array_equal(again[2]["probs"], local["probs"][12:])
    assert stats["split"] >= 1
    # the poisoned client's rows (tags 100-111) ran only up to the batch that failed alone
    failed_alone = next(i for i, rows in enumerate(poison.batches)
                        if 100.0 + poison_row in rows and all(100 <= r < 112 for r in rows))
    assert not any(100 <= r < 112 for rows in poison.batches[failed_alone + 1:] for r in rows)


async def test_closing_the_server_with_a_client_connected_logs_no_traceback(
    engine: Engine, frames: np.ndarray, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A new-user trial's SIGTERM to `streamapp gpu-server` with a worker connected logged
    one asyncio CancelledError traceback per connection."""
    path = tmp_path / "s.sock"
    with caplog.at_level(logging.ERROR), serving({"digits": ThreadExecutor(engine)}, path,
                                                 batch_delay_ms=1.0):
        client = await _client(path)
        await client.run(_items(frames[:4]))
    try:
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == []
    finally:
        await client.close()


async def test_a_lone_sub_batch_runs_after_the_delay(
    engine: Engine, frames: np.ndarray, tmp_path: Path,
) -> None:
    counting = CountingExecutor(engine)
    with serving({"digits": counting}, tmp_path / "s.sock", batch_delay_ms=5.0):
        client = await _client(tmp_path / "s.sock")
        try:
            await client.run(_items(frames[:8]))
            with pytest.raises(InputSpecError, match="expects float32"):
                await client.run([{"input": frames[0].astype(np.float64)}])
        finally:
            await client.close()
    assert counting.sizes == [8]


# -- a server in its own process, killed -----------------------------------------------------------


def _start_server(path: Path, log: Path, delay_ms: float) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMAPP_")}
    env.update({"STREAMAPP_BACKEND": "onnxruntime", "STREAMAPP_MAX_BATCH_SIZE": "32",
                "STREAMAPP_GPU_SERVER_SOCKET": str(path),
                "STREAMAPP_GPU_SERVER_BATCH_DELAY_MS": str(delay_ms)})
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "streamapp", "gpu-server"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


async def _until(what: str, check: Callable[[], bool], log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s:\n" + \
            log.read_text(errors="replace")[-3000:]
        await asyncio.sleep(0.05)


def _listening(path: Path) -> bool:
    try:
        query_stats(path, timeout_s=1.0)
    except ExecutorUnavailableError:
        return False
    return True


@pytest.mark.slow
async def test_a_batch_pending_when_the_server_dies_completes_once_it_is_restarted(
    frames: np.ndarray, tmp_path: Path,
) -> None:
    """A killed server is not the batch's fault: the client waits for the restarted server
    and sends the batch again (its outputs died with the server); a client whose
    ``wait_s`` runs out first fails its batch with the retriable error."""
    path, log = tmp_path / "s.sock", tmp_path / "server.log"
    # a delay of 60 s: both clients' batches of 8 wait in the server's batcher until the kill
    server = _start_server(path, log, 60_000.0)
    client = short = None
    try:
        await _until("listening", lambda: _listening(path), log)
        client, short = await _client(path), await _client(path, wait_s=0.5)
        pending = asyncio.ensure_future(client.run(_items(frames[:8])))
        sent_at = time.monotonic()
        doomed = asyncio.ensure_future(short.run(_items(frames[8:16])))
        await _until("both batches queued in the server",
                     lambda: query_stats(path)["digits"]["sub_batches"] == 2, log)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        await _until("disconnected", lambda: not client.connected, log)  # type: ignore[union-attr]

        with pytest.raises(ExecutorUnavailableError, match=r"waited 0\.5 s") as failed:
            await asyncio.wait_for(doomed, 10)
        assert time.monotonic() - sent_at >= 0.5  # wait_s counts from the call
        assert failed.value.retriable is True and failed.value.reason == "executor_unavailable"
        assert not pending.done()  # the default client still waits (60 s)
        later = asyncio.ensure_future(client.run(_items(frames[16:24])))  # sent while down

        server = _start_server(path, log, 0.0)  # the supervisor's restart
        out = await asyncio.wait_for(pending, 60)
        assert [int(p) for p in out["probs"].argmax(axis=1)] == [0, 1, 2, 3, 4, 5, 6, 7]
        out_later = await asyncio.wait_for(later, 30)
        assert [int(p) for p in out_later["probs"].argmax(axis=1)] == [
            6, 7, 8, 9, 0, 1, 2, 3]
        assert client.connected and client.disconnects == 1 and client.resubmits == 1
        assert query_stats(path)["digits"]["rows"] >= 16  # the restarted server ran both
    finally:
        for c in (client, short):
            if c is not None:
                await c.close()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            assert server.wait(30) == 0, log.read_text(errors="replace")[-3000:]


@pytest.mark.slow
async def test_without_a_server_for_longer_than_the_wait_a_batch_fails_retriably(
    frames: np.ndarray, tmp_path: Path,
) -> None:
    """``wait_s`` bounds the wait from the call's start; 0 fails at once."""
    path, log = tmp_path / "s.sock", tmp_path / "server.log"
    server = _start_server(path, log, 0.0)
    client = None
    try:
        await _until("listening", lambda: _listening(path), log)
        client = await _client(path, wait_s=1.0)
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
        await _until("disconnected", lambda: not client.connected, log)  # type: ignore[union-attr]
        started = time.monotonic()
        with pytest.raises(ExecutorUnavailableError, match=r"waited 1 s") as failed:
            await asyncio.wait_for(client.run(_items(frames[:8])), 10)
        assert 1.0 <= time.monotonic() - started < 5.0
        assert failed.value.retriable is True and failed.value.reason == "executor_unavailable"
        client.wait_s = 0.0
        with pytest.raises(ExecutorUnavailableError):  # at once, not after a timeout
            await asyncio.wait_for(client.run(_items(frames[:8])), 0.5)
    finally:
        if client is not None:
            await client.close()
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
