"""Errors of the CUDA layer, translated from cuda-python's ``cudaError_t`` codes.

All derive from :class:`engines.exceptions.EngineError`, so the stream processor routes them by
their ``retriable`` flag like any other engine error.
"""

from __future__ import annotations

from engines.exceptions import BackendUnavailableError, EngineRuntimeError, OutOfMemoryError

__all__ = ["CudaError", "CudaOutOfMemoryError", "CudaUnavailableError"]


class CudaError(EngineRuntimeError):
    """A CUDA runtime call failed. Retriable: most failures (a busy device, a timeout) pass.

    Attributes:
        code: The ``cudaError_t`` value as an int (e.g. ``2`` for ``cudaErrorMemoryAllocation``).
        name: Its name, e.g. ``"cudaErrorMemoryAllocation"``.
        call: The runtime call that failed, e.g. ``"cudaMemcpyAsync"``.
    """

    reason = "cuda_error"

    def __init__(self, message: str, *, code: int = -1, name: str = "", call: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.name = name
        self.call = call


class CudaOutOfMemoryError(CudaError, OutOfMemoryError):
    """``cudaErrorMemoryAllocation``: device or pinned host memory ran out."""

    reason = "out_of_memory"


class CudaUnavailableError(BackendUnavailableError):
    """cuda-python is not installed, no driver is loaded, or no GPU is visible."""

    reason = "cuda_unavailable"
