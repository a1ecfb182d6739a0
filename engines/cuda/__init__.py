"""The CUDA layer: the only package that talks to cuda-python.

Streams, events, pinned host buffers and device buffers with explicit ``close()`` and context
managers; CUDA errors translated into the :class:`~engines.exceptions.EngineError` tree. Nothing
else in the project touches raw CUDA handles: backends and the GPU executor use these objects
and pass ``int`` handles/pointers to vendor libraries (TensorRT, PyTorch).

Importing this package never imports cuda-python; the first CUDA call does. Without cuda-python
or a GPU, :func:`is_available` is False. ``ENGINES_CUDA_STANDIN=1`` (or :func:`use_runtime`)
runs everything on :mod:`engines.testing.fake_cuda`, a CPU stand-in with the same API.
"""

from __future__ import annotations

from engines.cuda.core import (
    DeviceBuffer,
    DeviceInfo,
    Event,
    PinnedBuffer,
    Stream,
    device_count,
    device_info,
    live_handles,
    mem_get_info,
    memcpy_dtod_async,
    memcpy_dtoh,
    memcpy_dtoh_async,
    memcpy_htod,
    memcpy_htod_async,
    set_device,
    stream_host_call,
    versions,
)
from engines.cuda.exceptions import CudaError, CudaOutOfMemoryError, CudaUnavailableError
from engines.cuda.runtime import ENV_STANDIN, use_runtime, using_standin

__all__ = [
    "ENV_STANDIN",
    "CudaError",
    "CudaOutOfMemoryError",
    "CudaUnavailableError",
    "DeviceBuffer",
    "DeviceInfo",
    "Event",
    "PinnedBuffer",
    "Stream",
    "device_count",
    "device_info",
    "is_available",
    "live_handles",
    "mem_get_info",
    "memcpy_dtod_async",
    "memcpy_dtoh",
    "memcpy_dtoh_async",
    "memcpy_htod",
    "memcpy_htod_async",
    "set_device",
    "stream_host_call",
    "use_runtime",
    "using_standin",
    "versions",
]


def is_available() -> bool:
    """True when a CUDA device can be used here (cuda-python importable, a GPU visible), or the
    stand-in runtime is selected."""
    from engines.exceptions import EngineError

    try:
        return device_count() > 0
    except EngineError:
        return False
