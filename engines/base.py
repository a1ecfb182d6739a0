"""The engine interface: IO tensor specs and the :class:`Engine` base class.

Backends implement only the ``*_impl`` hooks; the public methods here validate inputs, keep the
lifecycle (``close()``, context manager) and translate nothing themselves — each backend
translates its vendor's errors into :mod:`engines.exceptions`. Modelled on Polygraphy's
``BaseRunner`` (``infer()`` validates, ``infer_impl()`` runs).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.exceptions import EngineClosedError, InputSpecError

__all__ = [
    "DYNAMIC",
    "Engine",
    "EngineInfo",
    "StreamContext",
    "StreamEngine",
    "TensorSpec",
    "format_shape",
    "item_fits",
    "put_item",
    "widen_half",
]

#: Marker for a dynamic dimension in :attr:`TensorSpec.shape`.
DYNAMIC = -1

_HALF = np.dtype(np.float16)
#: Every float16 bit pattern's value in a wider float dtype, by dtype (see :func:`widen_half`).
_HALF_TABLES: dict[np.dtype[Any], np.ndarray] = {}


def widen_half(raw: np.ndarray, dtype: np.dtype[Any], out: np.ndarray | None = None,
               ) -> np.ndarray:
    """``raw.astype(dtype)`` for a native float16 array and a wider float ``dtype``, through a
    table of all 65,536 float16 values: the same values bit for bit (the table holds numpy's
    own conversions, which are exact), NaN payloads and signed zeros included.

    numpy converts float16 one element at a time: 250–310 µs for a float16[3, 224, 224]
    ResNet-50 tensor, against 120–180 µs to gather it from the table (256 KiB for float32,
    L2-resident; 2-core development machine, numpy 2.4, 2026-12-07). ``mode="wrap"`` skips
    the bounds check: a uint16 index cannot leave the table.

    Args:
        raw: ``float16[...]`` in native byte order.
        dtype: ``float32`` or ``float64``.
        out: Where to write, ``dtype`` of ``raw``'s shape (e.g. a row of a staging buffer);
            None for a new array.

    Returns:
        ``out``, or a new C-contiguous ``dtype`` array of ``raw``'s shape.
    """
    table = _HALF_TABLES.get(dtype)
    if table is None:
        codes = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
        with np.errstate(all="ignore"):
            table = _HALF_TABLES[dtype] = codes.astype(dtype)
    return np.take(table, raw.view(np.uint16), mode="wrap", out=out)


def item_fits(spec: TensorSpec, array: np.ndarray) -> bool:
    """Whether ``array`` can be packed as one item of ``spec``: its item shape, and its dtype
    or float16 for a wider float input (widened exactly as it is packed: :func:`put_item`;
    a float16 request tensor then travels as its own bytes up to the staging buffer)."""
    return array.shape == spec.item_shape and (
        array.dtype == spec.dtype
        or (array.dtype == _HALF and spec.dtype.kind == "f" and spec.dtype.itemsize > 2))


def put_item(row: np.ndarray, array: np.ndarray) -> None:
    """Copy one item that :func:`item_fits` into its ``row`` of a batch (a staging buffer's,
    say), widening a float16 item on the way."""
    if array.dtype == row.dtype:
        row[...] = array
    else:
        widen_half(array, row.dtype, out=row)


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one IO tensor.

    Attributes:
        name: Tensor name as in the model graph (e.g. ``"input"``).
        dtype: Element type, e.g. ``np.dtype("float32")``.
        shape: Dimensions; ``-1`` (:data:`DYNAMIC`) marks a dynamic one. By convention the first
            dimension is the batch dimension and is dynamic, e.g. ``(-1, 1, 8, 8)``.
    """

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]

    @property
    def item_shape(self) -> tuple[int, ...]:
        """Shape of one item, without the batch dimension (e.g. ``(1, 8, 8)``)."""
        return self.shape[1:]

    def check(self, array: np.ndarray, *, max_batch_size: int | None = None) -> None:
        """Check one batched input array against this spec.

        Args:
            array: The batch, ``dtype[batch, *item_shape]``.
            max_batch_size: Largest batch the engine accepts, or None for no limit.

        Raises:
            InputSpecError: dtype, rank, a static dimension or the batch size does not fit.
        """
        if array.dtype != self.dtype:
            raise InputSpecError(
                f"input {self.name!r} has dtype {array.dtype}, the engine expects {self.dtype}; "
                f"convert it with array.astype(np.{self.dtype})"
            )
        if array.ndim != len(self.shape):
            raise InputSpecError(
                f"input {self.name!r} has shape {array.shape}, the engine expects rank "
                f"{len(self.shape)} {_fmt_shape(self.shape)}"
            )
        for got, want in zip(array.shape, self.shape, strict=True):
            if want != DYNAMIC and got != want:
                raise InputSpecError(
                    f"input {self.name!r} has shape {array.shape}, the engine expects "
                    f"{_fmt_shape(self.shape)}"
                )
        if array.shape[0] < 1:
            raise InputSpecError(f"input {self.name!r} is an empty batch")
        if max_batch_size is not None and array.shape[0] > max_batch_size:
            raise InputSpecError(
                f"input {self.name!r} has batch {array.shape[0]}, larger than the engine's "
                f"maximum {max_batch_size}; split the batch or rebuild with a larger profile"
            )


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("batch" if d == DYNAMIC else str(d) for d in shape) + "]"


def format_shape(shape: tuple[int, ...]) -> str:
    """A tensor shape as ``engines inspect`` and ``streamapp models check`` print it:
    ``[batch, 1, 8, 8]``, ``batch`` for a dynamic first dimension, ``?`` for other dynamic
    ones."""
    dims = [("batch" if i == 0 else "?") if d == DYNAMIC else str(d) for i, d in enumerate(shape)]
    return "[" + ", ".join(dims) + "]"


@dataclass(frozen=True)
class EngineInfo:
    """What an engine tells operators about itself (shown by ``/engines`` and in results).

    Attributes:
        backend: Registry name of the backend, e.g. ``"onnxruntime"``.
        model_path: Path of the loaded model or plan file.
        model_sha256: sha256 hex digest of that file.
        version: Backend library version, e.g. ONNX Runtime ``"1.20.1"``.
        device: Where it runs, e.g. ``"cpu"`` or ``"cuda:0 (NVIDIA H200)"``.
        precision: ``"fp32"``, ``"fp16"`` or ``"int8"``.
        max_batch_size: Largest batch accepted.
        extra: Backend-specific details (providers, profiles, ...).
    """

    backend: str
    model_path: str
    model_sha256: str
    version: str
    device: str
    precision: str
    max_batch_size: int
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def tag(self) -> str:
        """Short identifier put in every result, e.g. ``"onnxruntime-1.20.1:3f2a9c1b"``."""
        return f"{self.backend}-{self.version}:{self.model_sha256[:8]}"


class Engine(abc.ABC):
    """A loaded model that runs batches.

    Subclasses implement :meth:`infer_impl` (and optionally :meth:`close_impl`) and set
    ``inputs``, ``outputs`` and ``info`` in ``__init__``. Engines are not thread-safe unless a
    backend says so; the executor gives each thread or CUDA stream its own engine context.
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    info: EngineInfo

    _closed: bool = False

    @property
    def max_batch_size(self) -> int:
        """Largest batch :meth:`infer` accepts."""
        return self.info.max_batch_size

    def input_spec(self, name: str | None = None) -> TensorSpec:
        """Spec of the input called ``name``, or of the only input when ``name`` is None.

        Raises:
            InputSpecError: No such input, or ``name`` is None and there are several.
        """
        if name is None:
            if len(self.inputs) != 1:
                raise InputSpecError(
                    f"the engine has {len(self.inputs)} inputs "
                    f"({', '.join(s.name for s in self.inputs)}); name one"
                )
            return self.inputs[0]
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise InputSpecError(
            f"the engine has no input {name!r}; its inputs are "
            f"{', '.join(s.name for s in self.inputs)}"
        )

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch synchronously.

        Args:
            feeds: One array per input name, each ``dtype[batch, *item_shape]`` as in
                :attr:`inputs`, all with the same batch size.

        Returns:
            One array per output name, ``dtype[batch, ...]``. Arrays are freshly allocated (never
            reused by the next call).

        Raises:
            InputSpecError: A feed is missing, unknown, or does not fit its spec.
            EngineRuntimeError: The backend failed (retriable).
            EngineClosedError: The engine was closed.
        """
        if self._closed:
            raise EngineClosedError("the engine is closed; load it again")
        self.check_feeds(feeds)
        return self.infer_impl(feeds)

    def check_feeds(self, feeds: Mapping[str, np.ndarray]) -> int:
        """Validate a batch of feeds and return its batch size.

        Raises:
            InputSpecError: A feed is missing, unknown, or does not fit its spec.
        """
        names = {s.name for s in self.inputs}
        if set(feeds) != names:
            raise InputSpecError(
                f"feeds name {sorted(feeds)}, the engine's inputs are {sorted(names)}"
            )
        batch = None
        for spec in self.inputs:
            array = feeds[spec.name]
            spec.check(array, max_batch_size=self.max_batch_size)
            if batch is None:
                batch = array.shape[0]
            elif array.shape[0] != batch:
                raise InputSpecError(
                    f"inputs have different batch sizes ({batch} and {array.shape[0]})"
                )
        assert batch is not None
        return batch

    @abc.abstractmethod
    def infer_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run a validated batch. See :meth:`infer`."""

    def close(self) -> None:
        """Release the engine's resources. Idempotent."""
        if not self._closed:
            self._closed = True
            self.close_impl()

    def close_impl(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Release backend resources (sessions, contexts, device memory)."""

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamContext(abc.ABC):
    """One execution context of a :class:`StreamEngine`, bound to one CUDA stream and to fixed
    device buffers (see :meth:`StreamEngine.bind_stream`).

    Not thread-safe: one context per stream, used by one thread at a time. Work enqueued on the
    same stream runs in order, so a new batch may be enqueued before the previous one finished.
    """

    @abc.abstractmethod
    def enqueue(self, batch_size: int) -> None:
        """Enqueue one batch on the bound stream and return without waiting.

        Reads rows ``[0, batch_size)`` of every bound input buffer and writes rows
        ``[0, batch_size)`` of every bound output buffer, in stream order.

        Args:
            batch_size: 1..``engine.max_batch_size`` (the caller has validated it).

        Raises:
            EngineRuntimeError: The backend refused to enqueue (retriable).
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the context (the bound buffers belong to the caller). Idempotent."""

    def __enter__(self) -> StreamContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamEngine(Engine):
    """An engine that can also enqueue batches on a caller's CUDA stream with device pointers.

    The optional extension of :class:`Engine` that the GPU executor
    (:class:`engines.executor.cuda.CudaExecutor`) needs; TensorRT and the PyTorch CUDA backend
    implement it. ``infer()`` still works synchronously from host arrays.
    """

    @abc.abstractmethod
    def bind_stream(self, stream: int, addresses: Mapping[str, int]) -> StreamContext:
        """Create an execution context that runs on ``stream`` with fixed IO buffers.

        Args:
            stream: A ``cudaStream_t`` handle as an int (``engines.cuda.Stream.handle``).
            addresses: Device pointer for every input and output name. Each buffer holds
                ``max_batch_size`` C-contiguous rows of that tensor's item shape and dtype
                (``dtype[max_batch_size, *item_shape]``); the caller owns and frees them after
                closing the context.

        Returns:
            A context; close it before freeing the buffers or closing the engine.

        Raises:
            InputSpecError: ``addresses`` does not name exactly the engine's IO tensors.
            EngineRuntimeError: The backend could not create the context (e.g. out of memory).
        """

    def check_addresses(self, addresses: Mapping[str, int]) -> None:
        """Raise :class:`InputSpecError` unless ``addresses`` names exactly the IO tensors."""
        names = {s.name for s in (*self.inputs, *self.outputs)}
        if set(addresses) != names:
            raise InputSpecError(
                f"bind_stream got buffers for {sorted(addresses)}, the engine's IO tensors are "
                f"{sorted(names)}"
            )
