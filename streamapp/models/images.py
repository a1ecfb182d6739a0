"""The CPU implementation of a model's image declaration: Pillow, images as devices make them.

A request's ``image`` (PNG/JPEG bytes, untrusted) becomes a request-shaped array in this order:

1. the header is read and the pixel count checked before any pixel is decoded (decompression
   bombs: DLQ ``image_too_large``);
2. the EXIF orientation is applied (``ImageOps.exif_transpose``: phones and some cameras store
   pixels as the sensor read them and say in EXIF how to turn them);
3. the pixels are converted to the declared colour: 16-bit grey (``I;16``, ``I;16B``, ``I``) is
   scaled by 1/257 to 0..255 (not clipped: 65535 → 255); palette images with transparency,
   grey+alpha and RGBA are composited over the declared background; CMYK → RGB; grey ↔ RGB by
   Pillow (ITU-R 601-2 luma);
4. resized, scaled, normalized, laid out and ordered per the declaration
   (:class:`~engines.preprocess.ImageSpec`, which the GPU path implements too).

Truncated or corrupt data, and formats the model does not accept, are DLQ ``undecodable_image``.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from engines.preprocess import EncodedImage, ImageSpec, inspect_jpeg
from streamapp.exceptions import InvalidRequestError

__all__ = [
    "DEFAULT_IMAGE_FORMATS",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ImageConfig",
    "header_size",
    "to_declared_mode",
]

#: Largest image (width × height, from its header) decoded when a model's metadata sets no
#: ``max_pixels``: 2048 × 2048. The worker's ``max_image_pixels`` setting and Pillow's own
#: ``Image.MAX_IMAGE_PIXELS`` (decompression-bomb guard, about 89 M pixels) apply as well,
#: whichever is smallest.
DEFAULT_MAX_IMAGE_PIXELS = 2048 * 2048

#: Image formats a model accepts unless its metadata says otherwise. Restricting Pillow to these
#: keeps its many other decoders (some of which run external programs, e.g. EPS → Ghostscript)
#: away from untrusted bytes.
DEFAULT_IMAGE_FORMATS = ("PNG", "JPEG")

#: Pillow modes holding more than 8 bits per sample, read as 0..65535 (PNG 16-bit grey opens as
#: ``I;16``/``I;16B``, older Pillows and some writers give ``I``).
_WIDE_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})


@dataclass(frozen=True)
class ImageConfig:
    """How a request's ``image`` (PNG/JPEG bytes) becomes a request-shaped array.

    Read from the ``image`` object of ``metadata.json``; for ``digits``::

        {"mode": "L", "size": [8, 8], "scale": 0.0627451, "resample": "box"}

    The image is oriented per EXIF, converted to ``mode`` (alpha composited over
    ``background``), resized to ``size`` with ``resample``, and each pixel ``p`` becomes
    ``p * scale + offset`` — the units of a request tensor (0..16 for digits: a white pixel is
    16, full ink). With ``mean``/``std`` (one value per band, in those units) it then becomes
    ``(p * scale + offset - mean[band]) / std[band]``; ``layout: "CHW"`` puts the bands first;
    ``channel_order: "BGR"`` reverses them (OpenCV-trained models). An RGB ImageNet model
    (torchvision's normalization)::

        {"mode": "RGB", "size": [224, 224], "scale": 0.00392157, "resample": "bilinear",
         "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "layout": "CHW"}

    The model's normal pre-processing (``preprocessing.scale``/``offset``) and the cast to the
    engine input's dtype follow; :meth:`~streamapp.models.ModelConfig.image_spec` folds all of
    it into the one :class:`~engines.preprocess.ImageSpec` the GPU path implements.

    Attributes:
        mode: Pillow mode, ``"L"`` (8-bit grayscale) or ``"RGB"``.
        size: ``(width, height)`` in pixels after resizing.
        scale / offset: Pixel (0..255) → request units.
        resample: Pillow filter name: ``"box"`` (area average; for digits it matches how the
            8×8 data set was made, counting ink in 4×4 blocks of 32×32 bitmaps), ``"bilinear"``,
            ``"bicubic"``, ``"lanczos"``, ``"hamming"``, ``"nearest"``.
        formats: Pillow format names accepted, e.g. ``("PNG", "JPEG")``.
        max_pixels: Largest width × height accepted, checked from the header before decoding.
        mean / std: Per-band normalization after scale and offset, one value per band of
            ``mode``; None: none.
        layout: ``"HWC"`` (default: Pillow's order) or ``"CHW"`` (bands first) for
            multi-band modes.
        channel_order: ``"RGB"`` (default) or ``"BGR"`` for ``mode: "RGB"``; mean/std are
            given in this order.
        background: What transparent pixels are composited over, 0..255: one value (grey, or
            the same for every band) or one per band of ``mode``. Default 0 (black).
    """

    mode: str
    size: tuple[int, int]
    scale: float = 1.0
    offset: float = 0.0
    resample: str = "box"
    formats: tuple[str, ...] = DEFAULT_IMAGE_FORMATS
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    layout: str = "HWC"
    channel_order: str = "RGB"
    background: tuple[int, ...] = (0,)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> ImageConfig:
        """Build from the metadata's ``image`` object.

        Raises:
            ValueError / KeyError / TypeError: A field is missing or invalid (the caller turns
                it into :class:`ConfigError`).
        """
        width, height = (int(d) for d in meta["size"])
        background = meta.get("background", 0)
        config = cls(
            mode=str(meta["mode"]),
            size=(width, height),
            scale=float(meta.get("scale", 1.0)),
            offset=float(meta.get("offset", 0.0)),
            resample=str(meta.get("resample", "box")),
            formats=tuple(str(f).upper() for f in meta.get("formats", DEFAULT_IMAGE_FORMATS)),
            max_pixels=int(meta.get("max_pixels", DEFAULT_MAX_IMAGE_PIXELS)),
            mean=_floats(meta["mean"]) if meta.get("mean") is not None else None,
            std=_floats(meta["std"]) if meta.get("std") is not None else None,
            layout=str(meta.get("layout", "HWC")).upper(),
            channel_order=str(meta.get("channel_order", "RGB")).upper(),
            background=tuple(int(v) for v in (
                background if isinstance(background, list) else [background]
            )),
        )
        if width < 1 or height < 1 or config.max_pixels < width * height:
            raise ValueError(
                f"image size {[width, height]} / max_pixels {config.max_pixels}: the size must be "
                "positive and width × height at most max_pixels"
            )
        Image.Resampling[config.resample.upper()]  # KeyError names a bad filter
        if config.mode not in ("L", "RGB"):
            raise ValueError(f"image mode {config.mode!r}: use 'L' (grey) or 'RGB'")
        bands = Image.getmodebands(config.mode)
        if not config.formats:
            raise ValueError("image formats is empty")
        if config.layout not in ("HWC", "CHW"):
            raise ValueError(f"image layout {config.layout!r}: use 'HWC' or 'CHW'")
        if config.channel_order not in ("RGB", "BGR"):
            raise ValueError(f"image channel_order {config.channel_order!r}: use 'RGB' or 'BGR'")
        for name, values in (("mean", config.mean), ("std", config.std)):
            if values is not None and len(values) != bands:
                raise ValueError(
                    f"image {name} has {len(values)} values, mode {config.mode!r} has {bands} "
                    "band(s): give one per band"
                )
        if config.std is not None and not all(v > 0 for v in config.std):
            raise ValueError(f"image std {list(config.std)} must be positive")
        if len(config.background) not in (1, bands) or not all(
            0 <= v <= 255 for v in config.background
        ):
            raise ValueError(
                f"image background {list(config.background)}: give one value 0..255, or one "
                f"per band of mode {config.mode!r}"
            )
        return config

    @property
    def array_shape(self) -> tuple[int, ...]:
        """Shape of the decoded array: ``(height, width)``, or ``(height, width, bands)``."""
        width, height = self.size
        bands = Image.getmodebands(self.mode)
        if bands == 1:
            return (height, width)
        return (bands, height, width) if self.layout == "CHW" else (height, width, bands)

    def pixel_limit(self, max_image_pixels: int | None = None) -> int:
        """The pixel count above which an image is refused: the smallest of :attr:`max_pixels`,
        ``max_image_pixels`` (the worker's setting; None: none) and Pillow's
        ``Image.MAX_IMAGE_PIXELS``."""
        limit = self.max_pixels
        if max_image_pixels is not None:
            limit = min(limit, max_image_pixels)
        if Image.MAX_IMAGE_PIXELS:
            limit = min(limit, int(Image.MAX_IMAGE_PIXELS))
        return limit

    def spec(self, *, scale: float = 1.0, offset: float = 0.0, dtype: str = "float32"
             ) -> ImageSpec:
        """This declaration as the :class:`~engines.preprocess.ImageSpec` an engine implements,
        with the model's ``x * scale + offset`` after it and the cast to ``dtype`` folded in.

        ``((p·s + o - m) / d)·S + O`` equals ``(p·s + o - m') / d'`` with ``m' = m - O·d/S`` and
        ``d' = d / S``; without mean/std it is ``p·(s·S) + (o·S + O)``.

        Raises:
            ValueError: ``scale`` is 0 with mean/std declared (nothing to fold into).
        """
        color = "L" if self.mode == "L" else self.channel_order
        if self.mean is None and self.std is None:
            return ImageSpec(self.size, self.resample, color, self.layout,  # type: ignore[arg-type]
                             self.scale * scale, self.offset * scale + offset, None, None, dtype,
                             self.background)
        if scale == 0:
            raise ValueError("preprocessing.scale 0 cannot be folded into the image mean/std")
        bands = Image.getmodebands(self.mode)
        mean = self.mean or (0.0,) * bands
        std = self.std or (1.0,) * bands
        return ImageSpec(
            self.size, self.resample, color, self.layout,  # type: ignore[arg-type]
            self.scale, self.offset,
            tuple(m - offset * d / scale for m, d in zip(mean, std, strict=True)),
            tuple(d / scale for d in std), dtype, self.background,
        )

    def for_gpu(self, data: bytes, max_image_pixels: int | None = None) -> EncodedImage | None:
        """``data`` as a frame for an engine that decodes JPEGs itself, or None when the CPU
        path must decode it (not a JPEG, not accepted, too large — the CPU path then says so —
        or a JPEG nvJPEG cannot decode: see :attr:`~engines.preprocess.JpegInfo.gpu_unsupported`).
        Reads the header only."""
        if "JPEG" not in self.formats:
            return None
        info = inspect_jpeg(data)
        if info is None or info.gpu_unsupported is not None:
            return None
        if info.pixels > self.pixel_limit(max_image_pixels):
            return None
        return EncodedImage.from_bytes(data, info)

    def to_array(self, data: bytes, max_image_pixels: int | None = None) -> np.ndarray:
        """Decode, orient, convert, resize and scale one image.

        The pixel count is read from the image header and checked before any pixel is decoded,
        so a small file that claims a huge image (a decompression bomb) costs nothing.

        Args:
            data: PNG or JPEG bytes (any format in :attr:`formats`), untrusted.
            max_image_pixels: The worker's limit (``Settings.max_image_pixels``), or None.

        Returns:
            ``float32[*array_shape]`` in request units (pixel × scale + offset, then
            ``(· - mean) / std`` per band), e.g. ``float32[8, 8]`` with values 0..16 for digits,
            ``float32[3, 224, 224]`` for an RGB model with ``layout: "CHW"``.

        Raises:
            InvalidRequestError: ``image_too_large`` (more than :meth:`pixel_limit`) or
                ``undecodable_image``.
        """
        limit = self.pixel_limit(max_image_pixels)
        accepted = " or ".join(self.formats)
        claimed = header_size(data)
        if claimed is not None and claimed[0] * claimed[1] > limit:
            # Refused before Pillow opens it, so Pillow's DecompressionBombWarning (emitted by
            # Image.open itself) never fires for PNG/JPEG.
            raise self._too_large(*claimed, limit)
        try:
            # Image.open reads only the header (lazy); pixels are decoded by load().
            with Image.open(io.BytesIO(data), formats=list(self.formats)) as image:
                width, height = image.size
                if width * height > limit:
                    raise self._too_large(width, height, limit)
                if image.format == "JPEG" and image.mode in ("L", "RGB", "YCbCr"):
                    # Let libjpeg decode at a reduced scale (1/2, 1/4, 1/8) while the result
                    # stays at least the target size; orientations 5–8 swap the axes.
                    target = self.size
                    if image.getexif().get(0x0112, 1) in (5, 6, 7, 8):
                        target = (target[1], target[0])
                    image.draft(self.mode, target)
                image.load()
                oriented = ImageOps.exif_transpose(image)
                converted = to_declared_mode(oriented, self.mode, self.background)
                if converted.size != self.size:
                    converted = converted.resize(
                        self.size, Image.Resampling[self.resample.upper()]
                    )
                array = np.asarray(converted, dtype=np.float32)
        except InvalidRequestError:
            raise
        # Pillow's own guard: an error above 2 × MAX_IMAGE_PIXELS, a warning (an error under
        # "-W error") above MAX_IMAGE_PIXELS; the check above already refuses both, so this
        # only fires when a warning filter turned the warning into an error first.
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise InvalidRequestError(
                "image_too_large", f"the image has too many pixels: {exc}"
            ) from exc
        # Pillow's decoders raise many unrelated types on hostile bytes (OSError, SyntaxError,
        # ValueError, struct.error, EOFError, ...); none of them may escape as a worker crash.
        except Exception as exc:
            message = str(exc).split(" <_io.BytesIO", 1)[0]
            raise InvalidRequestError(
                "undecodable_image",
                f"the image cannot be decoded as {accepted}: {type(exc).__name__}: {message}",
            ) from exc
        if self.mode == "RGB" and self.channel_order == "BGR":
            array = array[..., ::-1]
        if self.layout == "CHW" and array.ndim == 3:
            array = np.ascontiguousarray(array.transpose(2, 0, 1))
        else:
            array = np.ascontiguousarray(array)
        if array.shape != self.array_shape:  # e.g. a mode Pillow converted differently
            raise InvalidRequestError(
                "undecodable_image",
                f"the image decoded to shape {list(array.shape)}, expected "
                f"{list(self.array_shape)}",
            )
        if self.scale != 1.0:
            array *= np.float32(self.scale)
        if self.offset != 0.0:
            array += np.float32(self.offset)
        if self.mean is not None or self.std is not None:
            # One value per band, broadcast along the band axis of the layout.
            shape = (-1, 1, 1) if self.layout == "CHW" else (1, 1, -1)
            if self.mean is not None:
                array -= np.asarray(self.mean, dtype=np.float32).reshape(shape)
            if self.std is not None:
                array /= np.asarray(self.std, dtype=np.float32).reshape(shape)
        return array

    def _too_large(self, width: int, height: int, limit: int) -> InvalidRequestError:
        return InvalidRequestError(
            "image_too_large",
            f"the image is {width}×{height} = {width * height} pixels, more than the {limit} "
            f"this worker accepts for this model (settings max_image_pixels, metadata "
            f"image.max_pixels); send it resized to {self.size[0]}×{self.size[1]}",
        )


def header_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` from a PNG's IHDR or a JPEG's frame header, or None for anything
    else (Pillow then reads the header)."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        return width, height
    info = inspect_jpeg(data) if data[:2] == b"\xff\xd8" else None
    if info is not None and info.width and info.height:
        return info.width, info.height
    return None


def to_declared_mode(image: Image.Image, mode: str, background: tuple[int, ...] = (0,)
                     ) -> Image.Image:
    """Convert any PNG/JPEG mode to ``"L"`` or ``"RGB"`` without losing what it shows.

    Args:
        image: A loaded Pillow image of any mode.
        mode: ``"L"`` or ``"RGB"``.
        background: 0..255, one value or one per band of ``mode``: what transparent pixels
            are composited over.

    Returns:
        An 8-bit image of ``mode``: 16-bit samples scaled by 1/257 (rounded), alpha composited
        over ``background``, palette/CMYK/YCbCr/bilevel converted by Pillow.
    """
    if image.mode in _WIDE_MODES:
        wide = np.asarray(image).astype(np.float32)
        image = Image.fromarray(np.rint(np.clip(wide, 0, 65535) / 257.0).astype(np.uint8), "L")
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        "transparency" in image.info and image.mode in ("P", "L", "RGB", "1")
    )
    if has_alpha:
        rgba = np.asarray(image.convert("RGBA"), dtype=np.float32)
        alpha = rgba[..., 3:] / 255.0
        if mode == "L":
            colour = np.asarray(image.convert("RGBA").convert("L"), dtype=np.float32)[..., None]
            ground = np.asarray(background[:1], dtype=np.float32)
        else:
            colour = rgba[..., :3]
            ground = np.asarray(
                background if len(background) == 3 else background * 3, dtype=np.float32
            )
        flat = np.rint(colour * alpha + ground * (1.0 - alpha)).astype(np.uint8)
        return Image.fromarray(flat[..., 0] if mode == "L" else flat, mode)
    if image.mode == mode:
        return image
    if image.mode == "CMYK" and mode == "L":
        image = image.convert("RGB")
    return image.convert(mode)


def _floats(values: Any) -> tuple[float, ...]:
    if not isinstance(values, list | tuple) or not values:
        raise TypeError(f"expected a non-empty list of numbers, got {values!r}")
    return tuple(float(v) for v in values)
