"""The GPU executor on the CUDA stand-in: results, order, bounds, failures, shutdown.

The same executor code runs on the H200 in tests/engines/gpu (marker ``gpu``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import numpy as np
import pytest

from engines import cuda
from engines.exceptions import EngineClosedError, EngineRuntimeError, InputSpecError
from engines.executor.cuda import CudaExecutor
from engines.testing import FakeEngine, fake_cuda
from tests.engines.executor.stream_engines import AffineEngine, CopyEngine, items


@pytest.fixture(autouse=True)
def standin() -> Iterator[None]:
    fake_cuda.reset()
    with cuda.use_runtime(fake_cuda):
        yield
    assert cuda.live_handles() == {}, "the test leaked CUDA objects"
    fake_cuda.reset()


def _x(batch: list[dict[str, np.ndarray]]) -> np.ndarray:
    return np.stack([item["x"] for item in batch])


async def test_run_returns_the_outputs_of_its_own_items() -> None:
    engine = AffineEngine(max_batch=8)
    async with CudaExecutor(engine, streams=2, depth=2) as ex:
        batches = [items(1 + k % 8, start=10 * k) for k in range(12)]
        outs = await asyncio.gather(*(ex.run(b) for b in batches))
    for batch, out in zip(batches, outs, strict=True):
        np.testing.assert_array_equal(out["y"], engine.expected(_x(batch)))
    assert sorted(engine.enqueued) == sorted(len(b) for b in batches)
    assert engine.contexts_open == 0


async def test_map_yields_in_submission_order_even_when_later_batches_finish_first() -> None:
    engine = CopyEngine(max_batch=4)
    async with CudaExecutor(engine, streams=3, depth=2) as ex:
        batches = [items(1 + k % 4, start=100 * k) for k in range(30)]
        ordered = [out["y"][0, 0] async for out in ex.map(batches)]
        unordered = sorted([out["y"][0, 0] async for out in ex.map(batches, ordered=False)])
    assert ordered == [100.0 * k for k in range(30)]
    assert unordered == ordered


async def test_inflight_is_bounded_and_streams_run_concurrently() -> None:
    engine = AffineEngine(max_batch=4, delay_s=0.03)
    async with CudaExecutor(engine, streams=2, depth=2) as ex:
        futures = [await ex.submit(items(4, start=k)) for k in range(4)]
        assert ex.inflight == 4 == ex.max_inflight
        with pytest.raises(TimeoutError):  # no free slot: submit waits
            await asyncio.wait_for(ex.submit(items(1)), timeout=0.01)
        await asyncio.gather(*futures)
        assert ex.inflight == 0
    assert engine.max_running == 2  # one batch computing per stream at a time


async def test_the_event_loop_keeps_running_while_batches_compute() -> None:
    engine = AffineEngine(max_batch=4, delay_s=0.05)
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    async with CudaExecutor(engine, streams=1, depth=1) as ex:
        beat = asyncio.create_task(heartbeat())
        started = time.perf_counter()
        for _ in range(3):
            await ex.run(items(4))
        elapsed = time.perf_counter() - started
        beat.cancel()
    assert elapsed >= 0.15
    assert ticks >= 10  # the loop was free while it waited for three 50 ms batches


async def test_timeline_shows_h2d_of_the_next_batch_overlapping_compute() -> None:
    engine = AffineEngine(max_batch=4, delay_s=0.02)
    async with CudaExecutor(engine, streams=2, depth=2, record_timeline=True) as ex:
        async for _ in ex.map([items(4, start=k) for k in range(6)]):
            pass
        report = ex.overlap_report()
        timeline = list(ex.timeline)
    assert len(timeline) == 6
    assert {e.stream for e in timeline} == {0, 1}
    for e in timeline:
        assert e.h2d[0] <= e.h2d[1] <= e.compute[1] <= e.d2h[1]
    assert report["h2d_overlaps_compute"]
    assert report["total_pairs"] == 5


async def test_a_failing_batch_fails_alone() -> None:
    engine = AffineEngine(max_batch=4, poison=13.0)
    async with CudaExecutor(engine, streams=2) as ex:
        good, bad, after = items(4, start=0), items(4, start=12), items(4, start=20)
        results = await asyncio.gather(
            ex.run(good), ex.run(bad), ex.run(after), return_exceptions=True
        )
    assert isinstance(results[1], EngineRuntimeError)
    assert results[1].retriable
    np.testing.assert_array_equal(results[0]["y"], engine.expected(_x(good)))
    np.testing.assert_array_equal(results[2]["y"], engine.expected(_x(after)))


async def test_a_cuda_error_while_enqueueing_fails_that_batch_only() -> None:
    engine = CopyEngine(max_batch=4)
    async with CudaExecutor(engine, streams=1, depth=1) as ex:
        fake_cuda.fail_next("cudaMemcpyAsync", fake_cuda.cudaError_t.cudaErrorLaunchFailure)
        with pytest.raises(cuda.CudaError, match="cudaMemcpyAsync"):
            await ex.run(items(2))
        out = await ex.run(items(2, start=5))
    np.testing.assert_array_equal(out["y"][:, 0], [5, 6])


async def test_bad_input_is_an_input_error() -> None:
    async with CudaExecutor(CopyEngine(max_batch=4)) as ex:
        with pytest.raises(InputSpecError, match="expects float32\\[4\\]"):
            await ex.run([{"x": np.zeros(3, np.float32)}])
        with pytest.raises(InputSpecError, match="no input 'x'"):
            await ex.run([{"z": np.zeros(4, np.float32)}])
        with pytest.raises(InputSpecError, match="empty"):
            await ex.run([])
        with pytest.raises(InputSpecError, match="max batch 4"):
            await ex.run(items(5))
        assert ex.inflight == 0


async def test_close_waits_for_inflight_batches_and_frees_everything() -> None:
    engine = AffineEngine(max_batch=4, delay_s=0.02)
    ex = CudaExecutor(engine, streams=2, depth=2)
    free_before = cuda.mem_get_info()[0] + ex.device_bytes
    futures = [await ex.submit(items(4, start=k)) for k in range(4)]
    await ex.close()
    assert all(f.done() and f.exception() is None for f in futures)
    assert engine.contexts_open == 0
    assert cuda.live_handles() == {}
    assert cuda.mem_get_info()[0] == free_before
    await ex.close()  # idempotent
    with pytest.raises(EngineClosedError):
        await ex.run(items(1))


async def test_allocation_failure_leaks_nothing() -> None:
    fake_cuda.configure(total_memory=1000)
    with pytest.raises(cuda.CudaOutOfMemoryError):
        CudaExecutor(CopyEngine(max_batch=64), streams=2)
    assert cuda.live_handles() == {}


def test_engines_without_stream_support_are_refused() -> None:
    with pytest.raises(TypeError, match="ThreadExecutor"):
        CudaExecutor(FakeEngine())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="streams"):
        CudaExecutor(CopyEngine(), streams=0)


@pytest.mark.parametrize("inline_pack_bytes", [0, 1 << 30])
async def test_batches_packed_on_the_loop_or_in_a_pool_thread_give_the_same_outputs(
    inline_pack_bytes: int,
) -> None:
    # 0: every batch crosses to a pack thread; 1 GiB: every batch is packed on the event loop
    engine = AffineEngine(max_batch=8)
    async with CudaExecutor(engine, streams=2, depth=2,
                            inline_pack_bytes=inline_pack_bytes) as ex:
        batches = [items(1 + k % 8, start=10 * k) for k in range(10)]
        outs = await asyncio.gather(*(ex.run(b) for b in batches))
        with pytest.raises(InputSpecError):
            await ex.run([{"x": np.zeros(3, np.float64)}])
    for batch, out in zip(batches, outs, strict=True):
        np.testing.assert_array_equal(out["y"], engine.expected(_x(batch)))


async def test_small_batches_are_answered_by_polling_on_the_loop() -> None:
    # inline packing (the default for small inputs) + polling: no waiter thread involved
    engine = AffineEngine(max_batch=8)
    async with CudaExecutor(engine, streams=2, depth=2, inline_poll_s=5.0) as ex:
        batches = [items(1 + k % 8, start=10 * k) for k in range(12)]
        outs = await asyncio.gather(*(ex.run(b) for b in batches))
        assert (ex.polled, ex.poll_handoffs) == (12, 0)
    for batch, out in zip(batches, outs, strict=True):
        np.testing.assert_array_equal(out["y"], engine.expected(_x(batch)))


async def test_a_batch_still_running_after_the_poll_budget_goes_to_the_waiter_thread() -> None:
    engine = AffineEngine(max_batch=4, delay_s=0.05)
    async with CudaExecutor(engine, streams=1, depth=2, inline_poll_s=0.001) as ex:
        batches = [items(4, start=k) for k in range(3)]
        outs = await asyncio.gather(*(ex.run(b) for b in batches))
        assert ex.poll_handoffs >= 1
        assert ex.polled + ex.poll_handoffs == 3
    for batch, out in zip(batches, outs, strict=True):
        np.testing.assert_array_equal(out["y"], engine.expected(_x(batch)))


@pytest.mark.parametrize("inline_poll_s", [0.0, 5.0])
async def test_a_failing_batch_fails_alone_whether_polled_or_waited_for(
    inline_poll_s: float,
) -> None:
    engine = AffineEngine(max_batch=4, poison=-1.0)
    async with CudaExecutor(engine, streams=1, depth=2, inline_poll_s=inline_poll_s) as ex:
        bad = [{"x": np.full(4, -1.0, np.float32)}]
        good = items(2, start=3)
        results = await asyncio.gather(ex.run(bad), ex.run(good), return_exceptions=True)
        assert isinstance(results[0], EngineRuntimeError)
        assert isinstance(results[1], dict)
        np.testing.assert_array_equal(results[1]["y"], engine.expected(_x(good)))
        assert ex.inflight == 0
