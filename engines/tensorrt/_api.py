"""Which ``tensorrt`` module the backend uses: the real one, or the in-repo stand-in.

Code in this package writes ``from engines.tensorrt._api import trt`` and then ``trt.Builder``,
``trt.Runtime`` ... For mypy, ``trt`` *is* the ``tensorrt`` module (checked against the
``tensorrt-stubs`` package); at run time it is a proxy that forwards every attribute to the
module chosen on first use: an override set with :func:`use_tensorrt`, the stand-in
(:mod:`engines.tensorrt.fake_trt`) when ``ENGINES_TENSORRT_STANDIN=1``, else ``import tensorrt``.
Like Polygraphy's lazy imports, nothing is imported when ``engines`` is.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

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

_override: ModuleType | None = None


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


def trt_module() -> ModuleType:
    """The module ``trt`` forwards to now.

    Raises:
        BackendUnavailableError: Neither real TensorRT nor the stand-in is available.
    """
    if _override is not None:
        return _override
    if os.environ.get(ENV_STANDIN, "") == "1":
        from engines.tensorrt import fake_trt

        return fake_trt
    return _import_real()


def is_standin() -> bool:
    """True when ``trt`` is the stand-in (never ran on real TensorRT)."""
    try:
        return bool(getattr(trt_module(), "IS_STANDIN", False))
    except BackendUnavailableError:
        return False


def real_tensorrt_available() -> bool:
    """True when a real TensorRT (with its API, not only stubs) imports here."""
    try:
        _import_real()
    except BackendUnavailableError:
        return False
    return True


@contextlib.contextmanager
def use_tensorrt(module: ModuleType | None) -> Iterator[None]:
    """Make ``trt`` forward to ``module`` inside the ``with`` block (e.g. the stand-in)."""
    global _override
    previous = _override
    _override = module
    try:
        yield
    finally:
        _override = previous


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
