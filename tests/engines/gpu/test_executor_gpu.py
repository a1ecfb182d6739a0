"""The GPU executor on a real GPU: ordering, bounded in-flight work, bad input, clean shutdown.

Run on the H200 through the ``device`` tool (see run_h200.sh); skipped without a GPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from engines import cuda
from engines.exceptions import InputSpecError
from engines.executor.cuda import CudaExecutor
from tests.engines.executor.stream_engines import AffineEngine, CopyEngine, items

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("real_cuda")]


def test_results_come_back_in_submission_order() -> None:
    engine = CopyEngine(max_batch=16)

    async def main() -> list[dict[str, np.ndarray]]:
        async with CudaExecutor(engine, streams=2, depth=2) as ex:
            batches = [items(1 + k % 16, start=1000 * k) for k in range(200)]
            return [out async for out in ex.map(batches, ordered=True)]

    outputs = asyncio.run(main())
    assert len(outputs) == 200
    for k, out in enumerate(outputs):
        n = 1 + k % 16
        expected = np.repeat(np.arange(1000 * k, 1000 * k + n, dtype=np.float32)[:, None], 4, 1)
        np.testing.assert_array_equal(out["y"], expected)


def test_inflight_is_bounded_and_submit_waits_for_a_slot() -> None:
    engine = AffineEngine(max_batch=4, delay_s=0.02)
    seen: list[int] = []

    async def main() -> None:
        async with CudaExecutor(engine, streams=2, depth=1) as ex:
            futures = []
            for k in range(8):
                futures.append(await ex.submit(items(4, start=k)))
                seen.append(ex.inflight)
            results = await asyncio.gather(*futures)
            for k, out in enumerate(results):
                np.testing.assert_array_equal(
                    out["y"][:, 0], 2 * np.arange(k, k + 4, dtype=np.float32) + 1
                )

    asyncio.run(main())
    assert max(seen) == 2  # streams * depth


def test_bad_shape_is_an_input_error_and_the_executor_keeps_working() -> None:
    engine = CopyEngine(max_batch=8)

    async def main() -> dict[str, np.ndarray]:
        async with CudaExecutor(engine) as ex:
            with pytest.raises(InputSpecError, match="expects float32\\[4\\]"):
                await ex.run([{"x": np.zeros(5, np.float32)}])
            with pytest.raises(InputSpecError, match="max batch"):
                await ex.run(items(9))
            return await ex.run(items(3, start=7))

    out = asyncio.run(main())
    np.testing.assert_array_equal(out["y"][:, 0], [7, 8, 9])


def test_close_frees_every_stream_and_buffer(report: Callable[[str, dict[str, Any]], None]) -> None:
    cuda.set_device(0)
    with cuda.Stream():  # make sure the CUDA context exists before measuring
        pass
    free_before, _ = cuda.mem_get_info()
    handles_before = cuda.live_handles()
    engine = CopyEngine(max_batch=1 << 18)  # 4 MiB per device buffer

    async def main() -> int:
        ex = CudaExecutor(engine, streams=2, depth=2)
        held = ex.device_bytes
        await ex.run(items(1000))
        await ex.close()
        await ex.close()  # idempotent
        return held

    held = asyncio.run(main())
    free_after, _ = cuda.mem_get_info()
    report(
        "executor_memory",
        {
            "free_before": free_before,
            "free_after": free_after,
            "device_bytes_held": held,
            "live_handles_after": cuda.live_handles(),
        },
    )
    assert cuda.live_handles() == handles_before
    assert engine.contexts_open == 0
    assert free_before - free_after <= 2 << 20  # nothing of ours left (2 MiB: driver slack)
