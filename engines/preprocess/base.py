"""The pre-processing declaration and the small interface between the pipeline and an engine
that decodes images itself."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from engines.base import TensorSpec
from engines.preprocess.jpeg import JpegInfo

__all__ = [
    "GPU_RESIZE",
    "EncodedImage",
    "ImageDecodingEngine",
    "ImageSpec",
    "StagedBatch",
    "stage_encoded",
    "supports_gpu_images",
]

Color = Literal["L", "RGB", "BGR"]
Layout = Literal["HWC", "CHW"]

#: Resize filters both paths implement: Pillow's filter name → PyTorch ``interpolate`` mode
#: (with ``antialias=True`` where PyTorch has it, which follows Pillow's convolution-based
#: downscaling — torchvision's documentation of ``antialias`` says so — except for box, where
#: ``area`` is an exact area average for integer factors).
GPU_RESIZE: dict[str, str] = {
    "bilinear": "bilinear",
    "bicubic": "bicubic",
    "box": "area",
    "nearest": "nearest-exact",
}


@dataclass(frozen=True)
class ImageSpec:
    """How an image becomes one engine input item — declared once, in ``metadata.json``.

    Both implementations follow the same steps: apply the EXIF orientation; convert to
    ``color`` (alpha composited over ``background``, 16-bit samples scaled by 1/257 to 0..255);
    resize to ``size`` with ``resize``; ``p * scale + offset``; then ``(· - mean) / std`` per
    band; channels ``layout``; cast to ``dtype``.

    Attributes:
        size: ``(width, height)`` in pixels after resizing.
        resize: Pillow filter name (``"box"``, ``"bilinear"``, ``"bicubic"``, ``"nearest"``,
            ``"lanczos"``, ``"hamming"``); the GPU path implements those in :data:`GPU_RESIZE`.
        color: ``"L"`` (grey, ITU-R 601-2 luma), ``"RGB"`` or ``"BGR"`` (channel order).
        layout: ``"HWC"`` or ``"CHW"`` (ignored for grey).
        scale / offset: Pixel (0..255) → model units.
        mean / std: One value per channel in model units (in ``color`` order), or None.
        dtype: numpy dtype name of the result, e.g. ``"float32"`` or ``"float16"``.
        background: 0..255 per channel of ``color``, what transparent pixels become.
    """

    size: tuple[int, int]
    resize: str = "bilinear"
    color: Color = "RGB"
    layout: Layout = "HWC"
    scale: float = 1.0
    offset: float = 0.0
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    dtype: str = "float32"
    background: tuple[int, ...] = (0,)

    @property
    def channels(self) -> int:
        return 1 if self.color == "L" else 3

    @property
    def array_shape(self) -> tuple[int, ...]:
        """``(height, width)`` for grey, else ``(3, height, width)`` or ``(height, width, 3)``."""
        width, height = self.size
        if self.channels == 1:
            return (height, width)
        return (3, height, width) if self.layout == "CHW" else (height, width, 3)

    @property
    def gpu_unsupported(self) -> str | None:
        """Why the GPU path cannot implement this declaration, or None when it can."""
        if self.resize not in GPU_RESIZE:
            return (f"resize {self.resize!r} has no GPU implementation (use one of "
                    f"{', '.join(GPU_RESIZE)})")
        return None


@dataclass(frozen=True)
class EncodedImage:
    """A frame handed to the engine still compressed: it decodes and pre-processes it itself.

    Attributes:
        data: The JPEG bytes, ``uint8[n]`` (a view of the received record: no copy).
        info: Its header (:func:`~engines.preprocess.inspect_jpeg`).
    """

    data: np.ndarray
    info: JpegInfo

    @classmethod
    def from_bytes(cls, data: bytes, info: JpegInfo) -> EncodedImage:
        return cls(np.frombuffer(data, dtype=np.uint8), info)


@dataclass
class StagedBatch:
    """A batch split for an image-decoding engine.

    Attributes:
        items: The items with every :class:`EncodedImage` replaced by a zero placeholder (no
            memory: a broadcast view), ready for ``pack_items``.
        images: Input name → ``(row, frame)`` of the rows the engine fills in itself.
    """

    items: list[Mapping[str, np.ndarray]]
    images: dict[str, list[tuple[int, EncodedImage]]]

    def filled(self, rows: int) -> frozenset[str]:
        """The inputs whose every one of ``rows`` rows is a frame: the engine writes them
        whole on its device, so the executor neither packs their placeholders nor copies
        them host → device."""
        return frozenset(name for name, frames in self.images.items() if len(frames) == rows)


def stage_encoded(items: Sequence[Mapping[str, Any]], inputs: Sequence[TensorSpec]) -> StagedBatch:
    """Take the :class:`EncodedImage` values out of a batch's items (see :class:`StagedBatch`)."""
    images: dict[str, list[tuple[int, EncodedImage]]] = {}
    staged: list[Mapping[str, np.ndarray]] = []
    placeholders = {
        s.name: np.broadcast_to(np.zeros((), dtype=s.dtype), s.item_shape) for s in inputs
    }
    for row, item in enumerate(items):
        if not any(isinstance(v, EncodedImage) for v in item.values()):
            staged.append(item)
            continue
        plain = dict(item)
        for name, value in item.items():
            if isinstance(value, EncodedImage) and name in placeholders:
                images.setdefault(name, []).append((row, value))
                plain[name] = placeholders[name]
        staged.append(plain)
    return StagedBatch(staged, images)


@runtime_checkable
class ImageDecodingEngine(Protocol):
    """An engine that decodes and pre-processes JPEG frames on its device.

    The executor passes each batch's frames to the stream context with
    ``context.stage_images(images)`` (:attr:`StagedBatch.images`) just before
    ``context.enqueue``; the context writes the pre-processed rows into its input buffer on its
    stream, after the host→device copy of the other rows and before the model runs.
    """

    def configure_images(self, input_name: str, spec: ImageSpec) -> str | None:
        """Decode frames for ``input_name`` per ``spec`` from now on.

        Returns:
            None when enabled, else why not (e.g. torchvision missing, a resize filter without
            a GPU implementation); the caller then keeps decoding on the CPU.
        """
        ...


def supports_gpu_images(engine: object) -> bool:
    """Whether ``engine`` advertises GPU image decoding."""
    return isinstance(engine, ImageDecodingEngine)
