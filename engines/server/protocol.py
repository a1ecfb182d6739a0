"""The wire format between :class:`~engines.server.SharedExecutor` clients and the
:class:`~engines.server.ExecutorServer`: small msgpack headers on a Unix domain socket, payloads
in shared memory.

Frames: a 4-byte little-endian length, then one msgpack map (``op`` names it). Decoded with
msgpack only (no pickle), with a frame limit of :data:`MAX_FRAME_BYTES`.

Payloads: each client creates ``max_inflight`` shared-memory *slots* (``multiprocessing.
shared_memory``), sized by :func:`slot_bytes` for the engine's largest batch, and names them
in its ``hello``. A ``run`` request writes its rows into one of its slots and sends only their
offsets; the server answers with the outputs written into the same slot (the inputs are no
longer needed by then). A payload that does not fit its slot travels inline in the frame
(``data``), with the same offsets into that blob.

Layout of one request's inputs (:func:`write_items`), per engine input in ``spec`` order:

* ``{"name": n, "block": [offset, rows]}`` — every row an array of the spec's item shape and
  dtype, stored contiguously (``dtype[rows, *item_shape]`` at ``offset``);
* ``{"name": n, "rows": [[kind, offset, nbytes, info?], ...]}`` — a mix of arrays
  (``kind`` 0) and still-encoded JPEG frames (``kind`` 1, ``info`` the fields of
  :class:`~engines.preprocess.JpegInfo`) for an engine that decodes images itself.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import astuple
from typing import Any

import msgpack
import numpy as np

from engines import exceptions as errors
from engines.base import TensorSpec, item_fits, put_item
from engines.exceptions import EngineError, EngineRuntimeError, InputSpecError
from engines.preprocess.base import EncodedImage
from engines.preprocess.jpeg import JpegInfo

__all__ = [
    "ALIGN",
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "error_from_wire",
    "error_to_wire",
    "frame",
    "item_bytes",
    "read_items",
    "read_outputs",
    "slot_bytes",
    "spec_from_wire",
    "spec_to_wire",
    "unpack",
    "write_items",
    "write_outputs",
]

#: Bumped on any incompatible change; a ``hello`` with another version is refused.
PROTOCOL_VERSION = 1
#: Largest frame accepted (bytes): headers are small, inline payloads at most a batch.
MAX_FRAME_BYTES = 1 << 28
#: Alignment of every array in a slot (bytes): a cache line, and numpy's SIMD loads.
ALIGN = 64
LENGTH = struct.Struct("<I")

_ROW_ARRAY, _ROW_JPEG = 0, 1


class ProtocolError(EngineError):
    """A frame broke the protocol (bad length, not msgpack, a field of the wrong type, an
    offset outside the payload). The connection is closed; not retriable."""

    reason = "executor_protocol_error"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def frame(message: Mapping[str, Any]) -> bytes:
    """One frame: length prefix + msgpack of ``message`` (bytes values as msgpack bin)."""
    body = msgpack.packb(message, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


def unpack(body: bytes | memoryview) -> dict[str, Any]:
    """Decode one frame's body into a map with a string ``op``.

    Raises:
        ProtocolError: Not msgpack, or not a map with an ``op``.
    """
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as exc:
        raise ProtocolError(f"a frame is not valid msgpack: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ProtocolError("a frame is not a map with an 'op' field")
    return message


def spec_to_wire(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "dtype": spec.dtype.str, "shape": list(spec.shape)}


def _dtype(value: Any) -> np.dtype[Any]:
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise ProtocolError(f"{value!r} is not a numpy dtype") from None
    if dtype.hasobject:
        raise ProtocolError(f"dtype {value!r} holds Python objects; only plain numbers travel")
    return dtype


def spec_from_wire(value: Mapping[str, Any]) -> TensorSpec:
    """Raises: ProtocolError: a field is missing or of the wrong type."""
    try:
        return TensorSpec(str(value["name"]), _dtype(value["dtype"]),
                          tuple(int(d) for d in value["shape"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad tensor spec {value!r}: {exc}") from None


def item_bytes(spec: TensorSpec) -> int:
    """Bytes of one item of ``spec`` (no batch dimension)."""
    return int(spec.dtype.itemsize * np.prod(spec.item_shape, dtype=np.int64))


def slot_bytes(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
               max_batch: int) -> int:
    """Size of one slot: the larger of a full batch of inputs (every row aligned, as the mixed
    layout stores it) and a full batch of outputs, in bytes."""
    ins = sum(max_batch * _align(item_bytes(s)) for s in inputs)
    outs = sum(_align(max_batch * item_bytes(s)) for s in outputs)
    return _align(max(ins, outs, ALIGN))


# -- requests ------------------------------------------------------------------------------------


def _check_array(i: int, spec: TensorSpec, value: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray) or not item_fits(spec, value):
        got = (f"{value.dtype}{list(value.shape)}" if isinstance(value, np.ndarray)
               else type(value).__name__)
        raise InputSpecError(f"item {i} input {spec.name!r} is {got}, the engine expects "
                             f"{spec.dtype}{list(spec.item_shape)}")
    return value


def write_items(items: Sequence[Mapping[str, Any]], inputs: Sequence[TensorSpec],
                buffer: memoryview | None) -> tuple[list[dict[str, Any]], bytes | None]:
    """Lay ``items`` out for a ``run`` request (module docstring).

    Args:
        items: Input name → ``spec.dtype[*item_shape]`` array (float16 for a wider float
            input is widened as it is written: :func:`engines.base.put_item`), or an
            :class:`EncodedImage`.
        inputs: The engine's input specs.
        buffer: The request's shared-memory slot, or None to lay the payload out inline.

    Returns:
        ``(layout, inline)``: the ``inputs`` field of the request, and the inline payload
        (None when it was written into ``buffer``). A payload larger than ``buffer`` goes
        inline.

    Raises:
        InputSpecError: An item lacks an input or does not fit its spec.
    """
    plans: list[tuple[TensorSpec, list[Any], bool]] = []
    total = 0
    for spec in inputs:
        values = []
        for i, item in enumerate(items):
            try:
                values.append(item[spec.name])
            except KeyError:
                raise InputSpecError(f"item {i} has no input {spec.name!r}") from None
        block = not any(isinstance(v, EncodedImage) for v in values)
        if block:
            for i, v in enumerate(values):
                _check_array(i, spec, v)
            total += _align(len(values) * item_bytes(spec))
        else:
            total += sum(_align(v.data.nbytes if isinstance(v, EncodedImage)
                                else item_bytes(spec)) for v in values)
        plans.append((spec, values, block))
    inline = buffer is None or total > len(buffer)
    target: memoryview = memoryview(bytearray(total)) if inline else buffer  # type: ignore
    layout: list[dict[str, Any]] = []
    offset = 0
    for spec, values, block in plans:
        if block:
            out = np.ndarray((len(values), *spec.item_shape), spec.dtype, target, offset)
            for i, v in enumerate(values):
                put_item(out[i], v)
            layout.append({"name": spec.name, "block": [offset, len(values)]})
            offset += _align(out.nbytes)
            continue
        rows: list[list[Any]] = []
        for i, v in enumerate(values):
            if isinstance(v, EncodedImage):
                n = v.data.nbytes
                np.ndarray((n,), np.uint8, target, offset)[:] = v.data
                rows.append([_ROW_JPEG, offset, n, list(astuple(v.info))])
            else:
                array = _check_array(i, spec, v)
                n = item_bytes(spec)
                put_item(np.ndarray(spec.item_shape, spec.dtype, target, offset), array)
                rows.append([_ROW_ARRAY, offset, n])
            offset += _align(n)
        layout.append({"name": spec.name, "rows": rows})
    return layout, (bytes(target) if inline else None)


def _view(buffer: memoryview, shape: tuple[int, ...], dtype: np.dtype[Any], offset: Any,
          nbytes: int) -> np.ndarray:
    if not isinstance(offset, int) or offset < 0 or offset + nbytes > len(buffer):
        raise ProtocolError(f"payload at offset {offset!r} ({nbytes} bytes) lies outside the "
                            f"{len(buffer)}-byte buffer")
    return np.ndarray(shape, dtype, buffer, offset)


def _jpeg_info(value: Any) -> JpegInfo:
    try:
        info = JpegInfo(*value)
    except TypeError:
        raise ProtocolError(f"bad JPEG header fields {value!r}") from None
    if not all(isinstance(getattr(info, f), int) for f in
               ("width", "height", "components", "precision", "orientation")):
        raise ProtocolError(f"bad JPEG header fields {value!r}")
    return info


def read_items(layout: Any, inputs: Sequence[TensorSpec], buffer: memoryview,
               rows: int, *, images: bool) -> list[dict[str, Any]]:
    """The server side of :func:`write_items`: ``rows`` items whose arrays are views of
    ``buffer`` (no copy; valid while the slot is not reused, i.e. until the answer is sent).

    Args:
        layout: The request's ``inputs`` field.
        inputs: The engine's input specs.
        buffer: The slot or the inline payload.
        rows: Items in the request.
        images: Whether the engine decodes JPEG frames itself (else a frame is refused).

    Raises:
        ProtocolError: Malformed layout or an offset outside ``buffer``.
        InputSpecError: The inputs are not the engine's, a row has the wrong size, or a
            frame was sent to an engine that does not decode images.
    """
    if not isinstance(layout, list) or not all(isinstance(e, dict) for e in layout):
        raise ProtocolError("a run request's 'inputs' is not a list of maps")
    by_name = {e.get("name"): e for e in layout}
    names = [s.name for s in inputs]
    if sorted(map(str, by_name)) != sorted(names) or len(layout) != len(names):
        raise InputSpecError(f"the request names inputs {sorted(map(str, by_name))}, the "
                             f"engine's are {sorted(names)}")
    items: list[dict[str, Any]] = [{} for _ in range(rows)]
    for spec in inputs:
        entry = by_name[spec.name]
        size = item_bytes(spec)
        if "block" in entry:
            try:
                offset, count = entry["block"]
            except (TypeError, ValueError):
                raise ProtocolError(f"bad block {entry['block']!r}") from None
            if count != rows:
                raise ProtocolError(f"input {spec.name!r} has {count!r} rows, expected {rows}")
            batch = _view(buffer, (rows, *spec.item_shape), spec.dtype, offset, rows * size)
            for i in range(rows):
                items[i][spec.name] = batch[i]
            continue
        row_list = entry.get("rows")
        if not isinstance(row_list, list) or len(row_list) != rows:
            raise ProtocolError(f"input {spec.name!r} does not list {rows} rows")
        for i, row in enumerate(row_list):
            if not isinstance(row, list) or len(row) < 3 or not isinstance(row[2], int):
                raise ProtocolError(f"bad row {row!r}")
            kind, offset, nbytes = row[:3]
            if kind == _ROW_JPEG:
                if not images:
                    raise InputSpecError(f"row {i} of input {spec.name!r} is a JPEG frame and "
                                         "this engine does not decode images")
                data = _view(buffer, (nbytes,), np.dtype(np.uint8), offset, nbytes)
                items[i][spec.name] = EncodedImage(data, _jpeg_info(row[3] if len(row) > 3
                                                                    else None))
            elif kind == _ROW_ARRAY and nbytes == size:
                items[i][spec.name] = _view(buffer, spec.item_shape, spec.dtype, offset, size)
            else:
                raise InputSpecError(f"row {i} of input {spec.name!r} has {nbytes} bytes, the "
                                     f"engine expects {size} ({spec.dtype}"
                                     f"{list(spec.item_shape)})")
    return items


# -- answers -------------------------------------------------------------------------------------


def write_outputs(outputs: Mapping[str, np.ndarray], buffer: memoryview | None
                  ) -> tuple[list[dict[str, Any]], bytes | None]:
    """Lay a sub-batch's outputs out into ``buffer`` (or inline when None or too small).

    Returns:
        ``(layout, inline)``: the answer's ``outputs`` field (name, dtype, shape, offset) and
        the inline payload or None.
    """
    arrays = [(name, np.ascontiguousarray(a)) for name, a in outputs.items()]
    total = sum(_align(a.nbytes) for _, a in arrays)
    inline = buffer is None or total > len(buffer)
    target: memoryview = memoryview(bytearray(total)) if inline else buffer  # type: ignore
    layout, offset = [], 0
    for name, a in arrays:
        np.ndarray(a.shape, a.dtype, target, offset)[...] = a
        layout.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape),
                       "offset": offset})
        offset += _align(a.nbytes)
    return layout, (bytes(target) if inline else None)


def read_outputs(layout: Any, buffer: memoryview) -> dict[str, np.ndarray]:
    """Copy an answer's outputs out of ``buffer`` (the caller owns the arrays).

    Raises:
        ProtocolError: Malformed layout or an offset outside ``buffer``.
    """
    if not isinstance(layout, list):
        raise ProtocolError("an answer's 'outputs' is not a list")
    out: dict[str, np.ndarray] = {}
    for entry in layout:
        try:
            dtype = _dtype(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            name, offset = str(entry["name"]), entry["offset"]
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"bad output entry {entry!r}") from None
        nbytes = int(dtype.itemsize * np.prod(shape, dtype=np.int64))
        out[name] = _view(buffer, shape, dtype, offset, nbytes).copy()
    return out


def error_to_wire(exc: BaseException) -> dict[str, Any]:
    """An error as an answer carries it: type name, reason, retriable, message."""
    return {"type": type(exc).__name__, "reason": str(getattr(exc, "reason", "engine_error")),
            "retriable": bool(getattr(exc, "retriable", False)), "message": str(exc)}


def _error_types() -> dict[str, type[EngineError]]:
    from engines.preprocess.gpu import ImageDecodeError  # imports torch only when used

    found: dict[str, type[EngineError]] = {"ImageDecodeError": ImageDecodeError}
    for name in errors.__all__:
        cls = getattr(errors, name)
        if isinstance(cls, type) and issubclass(cls, EngineError):
            found[name] = cls
    return found


def error_from_wire(value: Any, *, where: str) -> EngineError:
    """The engine error an answer carries, as the class of the same name in
    :mod:`engines.exceptions` (unknown types: :class:`EngineRuntimeError` when retriable, else
    :class:`EngineError`, with the server's reason kept)."""
    if not isinstance(value, dict):
        return ProtocolError(f"{where}: an error answer without an error map")
    retriable = bool(value.get("retriable", False))
    cls = _error_types().get(str(value.get("type")))
    if cls is None or cls.retriable != retriable:
        cls = EngineRuntimeError if retriable else EngineError
    error = cls(f"{where}: {value.get('message', '')}")
    reason = value.get("reason")
    if isinstance(reason, str) and reason != cls.reason:
        error.reason = reason
    return error
