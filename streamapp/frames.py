"""One's own frames as requests: numpy arrays, PNG/JPEG bytes, image files, ``.npy`` files and
PIL images become :class:`~streamapp.records.InferenceRequest` inputs.

Used by :mod:`streamapp.client` (``AsyncClient.send`` / ``infer``) and ``streamapp publish
--file/--dir``. What the worker would reject for the frame alone (a dtype no request may carry,
bytes that are neither PNG nor JPEG) is refused here, before anything is sent, with
:class:`~streamapp.exceptions.FrameError`; what depends on the model (its shape, its dtypes) is
the worker's to check, and comes back as a dead letter.
"""

from __future__ import annotations

import io
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Union

import numpy as np

from streamapp.codecs import ALLOWED_DTYPES, canonical_dtype, check_deadline
from streamapp.exceptions import FrameError, InvalidRequestError
from streamapp.records import InferenceRequest, TensorPayload

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "FRAME_SUFFIXES",
    "Frame",
    "checked_deadline",
    "frame_files",
    "frame_input",
    "image_format",
    "iter_frames",
    "make_request",
    "read_frame_bytes",
    "read_stdin",
]

#: A frame the client takes: an array (a tensor request), PNG/JPEG bytes, a path to a
#: ``.png``/``.jpg``/``.jpeg``/``.npy`` file, or a PIL image (sent as PNG).
Frame = Union[np.ndarray, bytes, bytearray, memoryview, str, os.PathLike, "Image.Image"]

#: File name endings ``streamapp publish --dir`` picks up (case-insensitive).
FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".npy")

_NPY_MAGIC = b"\x93NUMPY"
_MAX_RANK = 8
#: Pillow modes a PNG holds as they are; other modes (CMYK, YCbCr, LAB, HSV, F) become RGB.
_PNG_MODES = frozenset({"1", "L", "LA", "P", "RGB", "RGBA", "I", "I;16", "I;16B"})


def image_format(data: bytes) -> str | None:
    """``"PNG"`` or ``"JPEG"`` from the file signature of ``data``, else None."""
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    return None


def _tensor(array: np.ndarray, what: str) -> TensorPayload:
    if array.dtype.kind not in "uif" or array.dtype.name not in ALLOWED_DTYPES:
        raise FrameError(
            f"{what} has dtype {array.dtype}; a request tensor is one of "
            f"{', '.join(sorted(ALLOWED_DTYPES))} (convert it with .astype(...))"
        )
    if array.ndim > _MAX_RANK:
        raise FrameError(f"{what} has {array.ndim} dimensions; a request tensor has at most "
                         f"{_MAX_RANK}")
    try:
        name, _ = canonical_dtype(array.dtype.str)
    except InvalidRequestError as exc:  # cannot happen for the kinds above; kept as a guard
        raise FrameError(f"{what}: {exc}") from None
    # the wire format is little-endian C order (docs/records.md)
    data = np.ascontiguousarray(array, dtype=np.dtype(name).newbyteorder("<")).tobytes()
    return TensorPayload(dtype=name, shape=tuple(int(d) for d in array.shape), data=data)


def _image_bytes(data: bytes, what: str) -> bytes:
    if image_format(data) is None:
        head = data[:8].hex(" ") if data else "nothing"
        raise FrameError(
            f"{what} is not a PNG or JPEG (it starts with {head}); send PNG/JPEG bytes, or a "
            "numpy array as a tensor"
        )
    return data


def _pil_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    (image if image.mode in _PNG_MODES else image.convert("RGB")).save(buffer, format="PNG")
    return buffer.getvalue()


def read_frame_bytes(data: bytes, what: str) -> TensorPayload | bytes:
    """A frame from the bytes of a file: a ``.npy`` array (read without pickle) or PNG/JPEG.

    Args:
        data: The file's bytes (``.npy``, PNG or JPEG, told apart by their signature).
        what: How to name the source in an error (``"frame.npy"``, ``"stdin"``).

    Returns:
        A tensor (from ``.npy``) or the image bytes, unchanged.

    Raises:
        FrameError: Neither, a ``.npy`` that does not load, or an array no request may carry.
    """
    if data.startswith(_NPY_MAGIC):
        try:
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise FrameError(f"{what} is not a readable .npy array ({exc}); save it with "
                             "numpy.save, without object dtypes") from None
        return _tensor(array, what)
    if image_format(data) is None:
        head = data[:8].hex(" ") if data else "nothing"
        raise FrameError(f"{what} is neither a PNG, a JPEG nor a .npy array (it starts with "
                         f"{head})")
    return data


def _read_path(path: Path) -> TensorPayload | bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FrameError(f"cannot read {path}: {exc.strerror or exc}") from None
    return read_frame_bytes(data, str(path))


def read_stdin(stream: BinaryIO | None = None) -> TensorPayload | bytes:
    """One frame from standard input (``streamapp publish --file -``): PNG, JPEG or ``.npy``.

    Raises:
        FrameError: As :func:`read_frame_bytes`.
    """
    return read_frame_bytes((stream or sys.stdin.buffer).read(), "stdin")


def frame_input(frame: Frame) -> TensorPayload | bytes:
    """The request input of a frame: a tensor, or PNG/JPEG bytes.

    Args:
        frame: A numpy array (any allowed dtype and shape, rank <= 8; sent little-endian, C
            order), PNG/JPEG bytes, a path (``str`` or ``os.PathLike``) to a PNG, JPEG or
            ``.npy`` file, or a PIL image (sent as a lossless PNG; modes a PNG cannot hold,
            such as CMYK or F, are converted to RGB first).

    Returns:
        :class:`TensorPayload` for arrays and ``.npy`` files, ``bytes`` for images.

    Raises:
        FrameError: The frame cannot become a request (which value, and why).
    """
    if isinstance(frame, np.ndarray):
        return _tensor(frame, f"the array of shape {list(frame.shape)}")
    if isinstance(frame, bytes | bytearray | memoryview):
        return _image_bytes(bytes(frame), "the frame's bytes")
    if isinstance(frame, str | os.PathLike):
        return _read_path(Path(frame))
    from PIL import Image

    if isinstance(frame, Image.Image):
        return _pil_bytes(frame)
    raise FrameError(
        f"a frame is a numpy array, PNG/JPEG bytes, a file path or a PIL image; got "
        f"{type(frame).__name__} {_clip_repr(frame)}"
    )


def make_request(
    device_id: str,
    frame: Frame | TensorPayload,
    *,
    model: str,
    seq: int,
    request_id: str | None = None,
    ts: float | None = None,
    deadline: float | None = None,
) -> InferenceRequest:
    """The request for one frame of a device.

    Args:
        device_id: The device (also the record key).
        frame: See :func:`frame_input` (or a ready :class:`TensorPayload`).
        model: The model's name in the worker's repository.
        seq: The device's sequence number for this frame.
        request_id: Default: a random 32-hex-digit id.
        ts: Capture time, epoch seconds; default: now.
        deadline: Relative deadline, milliseconds (:func:`checked_deadline`); None: the
            model's queue policy, if any.

    Raises:
        FrameError: See :func:`frame_input`, or ``deadline`` is out of range.
    """
    deadline = checked_deadline(deadline)
    value = frame if isinstance(frame, TensorPayload) else frame_input(frame)
    return InferenceRequest(
        request_id=request_id or uuid.uuid4().hex,
        device_id=device_id,
        seq=seq,
        ts=time.time() if ts is None else ts,
        model=model,
        tensor=value if isinstance(value, TensorPayload) else None,
        image=value if isinstance(value, bytes) else None,
        deadline=deadline,
    )


def checked_deadline(deadline: float | None, what: str = "deadline",
                     unset: str = "None") -> float | None:
    """A request deadline as the worker would take it, refused here when the worker would
    dead-letter the request for it (:func:`streamapp.codecs.check_deadline`, the one rule).

    Args:
        deadline: Milliseconds: how old the request may be when its batch would start,
            measured from when it reached Kafka (docs/delivery.md, "Queue policy"); None: none.
        what: How the message names it (``"deadline"``, ``"--deadline"``).
        unset: How the message says "no deadline" (``"None"``, ``"leave it out"``).

    Returns:
        ``float(deadline)`` (finite, > 0, at most one day), or None.

    Raises:
        FrameError: Not a number, not finite, 0 or less, or more than 86,400,000 ms (one day);
            the worker would answer a ``wrong_type`` or ``bad_deadline`` dead letter.
    """
    if deadline is None:
        return None
    try:
        return check_deadline(deadline, what=what, unset=unset)
    except InvalidRequestError as exc:
        raise FrameError(exc.message) from None


def frame_files(directory: Path) -> list[Path]:
    """The frame files of a directory (not its subdirectories), by name.

    Args:
        directory: A directory holding ``.png``/``.jpg``/``.jpeg``/``.npy`` files.

    Returns:
        Their paths, sorted by name; other files are left out.

    Raises:
        FrameError: Not a readable directory, or none of its files is a frame.
    """
    try:
        entries = sorted(p for p in directory.iterdir() if p.is_file())
    except OSError as exc:
        raise FrameError(f"cannot list {directory}: {exc.strerror or exc}") from None
    found = [p for p in entries if p.suffix.lower() in FRAME_SUFFIXES]
    if not found:
        raise FrameError(
            f"{directory} holds no frame files ({', '.join(FRAME_SUFFIXES)}) among its "
            f"{len(entries)} files"
        )
    return found


def iter_frames(paths: list[Path]) -> Iterator[tuple[Path, TensorPayload | bytes]]:
    """``(path, input)`` of each file, read one at a time.

    Raises:
        FrameError: At the first file that is not a frame (see :func:`read_frame_bytes`).
    """
    for path in paths:
        yield path, _read_path(path)


def _clip_repr(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

