"""Where the CUDA runtime API comes from, and the translation of its errors.

This module is the only place that imports cuda-python (``cuda.bindings.runtime``, or
``cuda.cudart`` from cuda-python 12.x). The import happens on first use, never at import time, so
``engines`` imports on machines without cuda-python. Tests and CPU-only demos can swap in the
in-repo stand-in (:mod:`engines.testing.fake_cuda`) with :func:`use_runtime` or the environment
variable ``ENGINES_CUDA_STANDIN=1``.

cuda-python's runtime functions return a tuple ``(cudaError_t, *values)``; :func:`check` unpacks
it and raises a :class:`~engines.cuda.exceptions.CudaError` (or a subclass) for any error code.
"""

from __future__ import annotations

import contextlib
import functools
from types import ModuleType
from typing import Any

from engines._switch import ModuleSwitch
from engines.cuda.exceptions import CudaError, CudaOutOfMemoryError, CudaUnavailableError

__all__ = ["ENV_STANDIN", "check", "runtime", "use_runtime", "using_standin"]

#: Set to ``1`` to run the CUDA layer on the CPU stand-in (for demos and tests without a GPU).
ENV_STANDIN = "ENGINES_CUDA_STANDIN"


# cudaError_t values that mean "no usable CUDA here" rather than "this call failed".
_UNAVAILABLE = {
    35,  # cudaErrorInsufficientDriver
    100,  # cudaErrorNoDevice
    3,  # cudaErrorInitializationError
    999,  # cudaErrorUnknown at first use usually means no driver in a container
}
_OOM = {2}  # cudaErrorMemoryAllocation


@functools.cache
def _import_cudart() -> ModuleType:
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6 / cuda-bindings 13
    except ImportError:
        try:
            from cuda import cudart  # type: ignore[no-redef]  # cuda-python 12.x before 12.6
        except ImportError as exc:
            raise CudaUnavailableError(
                "cuda-python is not installed; install the GPU extra "
                "(pip install 'streamapp[gpu]') on a machine with an NVIDIA driver"
            ) from exc
    return cudart


_SWITCH = ModuleSwitch(ENV_STANDIN, "engines.testing.fake_cuda", lambda: _import_cudart())


def runtime() -> Any:
    """The CUDA runtime API module in use: the override, the stand-in, or cuda-python's.

    Raises:
        CudaUnavailableError: cuda-python is not installed (and no stand-in is selected).
    """
    return _SWITCH.current()


def using_standin() -> bool:
    """True when the CUDA layer runs on :mod:`engines.testing.fake_cuda` (no real GPU)."""
    return _SWITCH.is_standin(CudaUnavailableError)


def use_runtime(module: ModuleType | None) -> contextlib.AbstractContextManager[None]:
    """Run the CUDA layer on ``module`` (e.g. the stand-in) inside the ``with`` block.

    Buffers and streams made inside the block must be closed inside it.
    """
    return _SWITCH.use(module)


def _error_name(rt: Any, err: Any) -> str:
    try:
        code, name = rt.cudaGetErrorName(err)
        if int(code) == 0:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        pass
    return f"cudaError {int(err)}"


def _error_string(rt: Any, err: Any) -> str:
    try:
        code, text = rt.cudaGetErrorString(err)
        if int(code) == 0:
            return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:
        pass
    return ""


def error_from(err: Any, call: str, rt: Any | None = None) -> CudaError | CudaUnavailableError:
    """The exception for error code ``err`` returned by runtime call ``call``."""
    rt = rt if rt is not None else runtime()
    code = int(err)
    name = _error_name(rt, err)
    text = _error_string(rt, err)
    message = f"{call} failed: {name}" + (f" ({text})" if text else "")
    if code in _UNAVAILABLE:
        return CudaUnavailableError(
            f"{message}; no usable NVIDIA GPU/driver here (check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES)"
        )
    if code in _OOM:
        return CudaOutOfMemoryError(
            f"{message}; free memory (fewer streams, a smaller max batch) and retry",
            code=code,
            name=name,
            call=call,
        )
    return CudaError(message, code=code, name=name, call=call)


def check(result: Any, call: str) -> Any:
    """Unpack a cuda-python result tuple ``(err, *values)``, raising on any error.

    Args:
        result: What the runtime function returned: a tuple ``(cudaError_t, *values)``.
        call: Name of the call, for the error message.

    Returns:
        None for no values, the value for one, a tuple for several.

    Raises:
        CudaError: ``err`` is not ``cudaSuccess`` (``CudaOutOfMemoryError`` for OOM).
        CudaUnavailableError: ``err`` says there is no driver or device.
    """
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if int(err) != 0:
        raise error_from(err, call)
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return values
