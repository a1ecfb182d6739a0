"""Which ``tensorrt`` module the backend uses: the real one, or the in-repo stand-in.

Code in this package writes ``from engines.tensorrt._api import trt`` and then ``trt.Builder``,
``trt.Runtime`` ... For mypy, ``trt`` *is* the ``tensorrt`` module (checked against the
``tensorrt-stubs`` package); at run time it is a proxy that forwards every attribute to the
module chosen on first use: an override set with :func:`use_tensorrt`, the stand-in
(:mod:`engines.testing.fake_trt`) when ``ENGINES_TENSORRT_STANDIN=1``, else ``import tensorrt``.
Like Polygraphy's lazy imports, nothing is imported when ``engines`` is.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from engines._switch import ModuleSwitch
from engines.exceptions import BackendUnavailableError

__all__ = [
    "ENV_STANDIN",
    "is_standin",
    "real_tensorrt_available",
    "trt",
    "trt_module",
    "use_tensorrt",
]

#: Set to ``1`` to run the TensorRT backend on the stand-in (with the CUDA stand-in on CPU).
ENV_STANDIN = "ENGINES_TENSORRT_STANDIN"



def _import_real() -> ModuleType:
    try:
        module = importlib.import_module("tensorrt")
    except ImportError as exc:
        raise BackendUnavailableError(
            "TensorRT is not installed; install the GPU extra (pip install 'streamapp[gpu]') "
            "on a machine with an NVIDIA GPU"
        ) from exc
    # The tensorrt-stubs package installs a namespace package named ``tensorrt`` holding only
    # .pyi files: importable, but without the API.
    if not hasattr(module, "Builder"):
        raise BackendUnavailableError(
            "the importable 'tensorrt' has no API (only type stubs are installed); install "
            "TensorRT 10+ (pip install tensorrt)"
        )
    return module


_SWITCH = ModuleSwitch(ENV_STANDIN, "engines.testing.fake_trt", lambda: _import_real())


def trt_module() -> ModuleType:
    """The module ``trt`` forwards to now.

    Raises:
        BackendUnavailableError: Neither real TensorRT nor the stand-in is available.
    """
    return _SWITCH.current()


def is_standin() -> bool:
    """True when ``trt`` is the stand-in (never ran on real TensorRT)."""
    return _SWITCH.is_standin(BackendUnavailableError)


def real_tensorrt_available() -> bool:
    """True when a real TensorRT (with its API, not only stubs) imports here."""
    try:
        _import_real()
    except BackendUnavailableError:
        return False
    return True


def use_tensorrt(module: ModuleType | None) -> contextlib.AbstractContextManager[None]:
    """Make ``trt`` forward to ``module`` inside the ``with`` block (e.g. the stand-in)."""
    return _SWITCH.use(module)


class _TensorRTProxy:
    """Forwards attribute access to :func:`trt_module` (chosen at each access, so tests can
    switch modules; objects created earlier keep their module)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(trt_module(), name)

    def __repr__(self) -> str:
        return "<lazy tensorrt proxy>"


if TYPE_CHECKING:
    import tensorrt as trt
else:
    trt = _TensorRTProxy()
