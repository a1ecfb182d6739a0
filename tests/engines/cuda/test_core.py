"""Streams, events, pinned/device buffers and error translation of :mod:`engines.cuda`."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from engines import cuda
from engines.exceptions import EngineClosedError, InputSpecError, OutOfMemoryError
from engines.testing import fake_cuda


def test_round_trip_through_device_memory(runtime: str) -> None:
    data = np.arange(256, dtype=np.float32)
    with (
        cuda.Stream() as stream,
        cuda.PinnedBuffer(data.nbytes) as host_in,
        cuda.PinnedBuffer(data.nbytes) as host_out,
        cuda.DeviceBuffer(data.nbytes) as dev_a,
        cuda.DeviceBuffer(data.nbytes) as dev_b,
        cuda.Event(timing=True) as start,
        cuda.Event(timing=True) as end,
    ):
        host_in.view(np.float32, (256,))[:] = data
        start.record(stream)
        cuda.memcpy_htod_async(dev_a.ptr, host_in.ptr, data.nbytes, stream)
        cuda.memcpy_dtod_async(dev_b.ptr, dev_a.ptr, data.nbytes, stream)
        cuda.memcpy_dtoh_async(host_out.ptr, dev_b.ptr, data.nbytes, stream)
        end.record(stream)
        end.synchronize()
        assert end.query()
        assert end.elapsed_ms(start) >= 0.0
        np.testing.assert_array_equal(host_out.view(np.float32, (256,)), data)
        # synchronous copies
        back = cuda.memcpy_dtoh(np.empty(256, np.float32), dev_b.ptr)
        np.testing.assert_array_equal(back, data)
        cuda.memcpy_htod(dev_a.ptr, data[::-1].copy())
        np.testing.assert_array_equal(
            cuda.memcpy_dtoh(np.empty(256, np.float32), dev_a.ptr), data[::-1]
        )


def test_close_is_idempotent_and_nothing_stays_open(runtime: str) -> None:
    before = cuda.live_handles()
    stream, event = cuda.Stream(), cuda.Event()
    pinned, device = cuda.PinnedBuffer(64), cuda.DeviceBuffer(64)
    assert cuda.live_handles() != before
    for obj in (stream, event, pinned, device):
        obj.close()
        obj.close()
        assert obj.closed
    assert cuda.live_handles() == before
    with pytest.raises(EngineClosedError):
        stream.synchronize()
    with pytest.raises(EngineClosedError):
        event.record(0)


def test_device_info_and_memory(runtime: str) -> None:
    info = cuda.device_info(0)
    assert info.name
    assert info.compute_capability[0] >= 1
    free, total = cuda.mem_get_info()
    with cuda.DeviceBuffer(64 << 20):
        free_held, _ = cuda.mem_get_info()
    assert 0 < free <= total
    assert free - free_held >= 64 << 20
    assert set(cuda.versions()) == {"driver", "runtime", "bindings"}


def test_pinned_view_must_fit(runtime: str) -> None:
    with cuda.PinnedBuffer(16) as buf:
        assert buf.view(np.float32, (2, 2)).shape == (2, 2)
        with pytest.raises(InputSpecError, match="needs 20 bytes"):
            buf.view(np.float32, (5,))
    with pytest.raises(ValueError, match="nbytes"):
        cuda.DeviceBuffer(0)


def test_out_of_memory_is_a_retriable_engine_error(standin: None) -> None:
    fake_cuda.configure(total_memory=1 << 20)
    with pytest.raises(cuda.CudaOutOfMemoryError) as info:
        cuda.DeviceBuffer(2 << 20)
    assert isinstance(info.value, OutOfMemoryError)
    assert info.value.retriable
    assert info.value.name == "cudaErrorMemoryAllocation"
    assert "cudaMalloc" in str(info.value)


def test_failed_calls_name_the_call_and_the_error(standin: None) -> None:
    with cuda.Stream() as stream, cuda.DeviceBuffer(16) as dev, cuda.PinnedBuffer(16) as host:
        with pytest.raises(cuda.CudaError, match="cudaMemcpyAsync failed: cudaErrorInvalidValue"):
            cuda.memcpy_htod_async(dev.ptr, host.ptr, 17, stream)  # one byte past the end
        fake_cuda.fail_next("cudaMemcpyAsync", fake_cuda.cudaError_t.cudaErrorLaunchFailure)
        with pytest.raises(cuda.CudaError) as info:
            cuda.memcpy_htod_async(dev.ptr, host.ptr, 16, stream)
        assert info.value.retriable
        assert info.value.code == 719


def test_async_failure_is_reported_by_the_next_event(standin: None) -> None:
    def boom() -> None:
        raise RuntimeError("kernel fault")

    with cuda.Stream() as stream, cuda.Event() as event:
        cuda.stream_host_call(stream.handle, boom)
        event.record(stream)
        with pytest.raises(cuda.CudaError, match="cudaErrorLaunchFailure"):
            event.synchronize()


def test_no_device_makes_cuda_unavailable(standin: None) -> None:
    fake_cuda.fail_next("cudaGetDeviceCount", fake_cuda.cudaError_t.cudaErrorNoDevice)
    assert not cuda.is_available()
    assert cuda.is_available()  # the injected failure was used up


def test_importing_engines_loads_no_gpu_library() -> None:
    code = (
        "import sys, engines, engines.cuda, engines.executor.cuda, engines.bench;"
        "from engines import registry; registry.registered_backends();"
        "bad = [m for m in ('cuda.bindings', 'cuda.cudart', 'torch', 'onnx2torch')"
        " if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
