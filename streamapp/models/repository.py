"""The model repository: a folder per model with ``model.onnx`` and ``metadata.json``.

The metadata says how a request becomes an engine input (allowed dtypes, item shape, scale and
offset, whether NaN/Inf are allowed, how an ``image`` is decoded) and how engine outputs become a
result (labels, top-k). The bundled repository holds the ``digits`` model trained by
``scripts/train_digits.py``.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from streamapp.codecs import tensor_to_array
from streamapp.exceptions import ConfigError, InvalidRequestError, ModelNotFoundError
from streamapp.records import InferenceRequest

__all__ = [
    "BUNDLED_MODELS_DIR",
    "DEFAULT_IMAGE_FORMATS",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ImageConfig",
    "ModelConfig",
    "ModelRepository",
]

#: The models shipped inside the package.
BUNDLED_MODELS_DIR = Path(__file__).resolve().parent

#: Largest image (width × height, from its header) decoded when a model's metadata sets no
#: ``max_pixels``: 2048 × 2048. Pillow's own ``Image.MAX_IMAGE_PIXELS`` (decompression-bomb
#: guard, about 89 M pixels) applies as well, whichever is smaller.
DEFAULT_MAX_IMAGE_PIXELS = 2048 * 2048

#: Image formats a model accepts unless its metadata says otherwise. Restricting Pillow to these
#: keeps its many other decoders (some of which run external programs, e.g. EPS → Ghostscript)
#: away from untrusted bytes.
DEFAULT_IMAGE_FORMATS = ("PNG", "JPEG")


@dataclass(frozen=True)
class ImageConfig:
    """How a request's ``image`` (PNG/JPEG bytes) becomes a request-shaped array.

    Read from the ``image`` object of ``metadata.json``; for ``digits``::

        {"mode": "L", "size": [8, 8], "scale": 0.0627451, "resample": "box"}

    The image is converted to ``mode``, resized to ``size`` with ``resample``, and each pixel
    ``p`` becomes ``p * scale + offset`` — the units of a request tensor (0..16 for digits: a
    white pixel is 16, full ink). With ``mean``/``std`` (one value per band, in those units) it
    then becomes ``(p * scale + offset - mean[band]) / std[band]``; ``layout: "CHW"`` puts the
    bands first. An RGB ImageNet model (torchvision's normalization)::

        {"mode": "RGB", "size": [224, 224], "scale": 0.00392157, "resample": "bilinear",
         "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "layout": "CHW"}

    The model's normal pre-processing follows.

    Attributes:
        mode: Pillow mode, e.g. ``"L"`` (8-bit grayscale) or ``"RGB"``.
        size: ``(width, height)`` in pixels after resizing.
        scale / offset: Pixel (0..255) → request units.
        resample: Pillow filter name: ``"box"`` (area average; for digits it matches how the
            8×8 data set was made, counting ink in 4×4 blocks of 32×32 bitmaps), ``"bilinear"``,
            ``"bicubic"``, ``"lanczos"``, ``"nearest"``, ``"hamming"``.
        formats: Pillow format names accepted, e.g. ``("PNG", "JPEG")``.
        max_pixels: Largest width × height accepted, checked from the header before decoding.
        mean / std: Per-band normalization after scale and offset, one value per band of
            ``mode``; None: none.
        layout: ``"HWC"`` (default: Pillow's order) or ``"CHW"`` (bands first) for
            multi-band modes.
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

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> ImageConfig:
        """Build from the metadata's ``image`` object.

        Raises:
            ValueError / KeyError / TypeError: A field is missing or invalid (the caller turns
                it into :class:`ConfigError`).
        """
        width, height = (int(d) for d in meta["size"])
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
        )
        if width < 1 or height < 1 or config.max_pixels < width * height:
            raise ValueError(
                f"image size {[width, height]} / max_pixels {config.max_pixels}: the size must be "
                "positive and width × height at most max_pixels"
            )
        Image.Resampling[config.resample.upper()]  # KeyError names a bad filter
        bands = Image.getmodebands(config.mode)  # KeyError names a bad mode
        if not config.formats:
            raise ValueError("image formats is empty")
        if config.layout not in ("HWC", "CHW"):
            raise ValueError(f"image layout {config.layout!r}: use 'HWC' or 'CHW'")
        for name, values in (("mean", config.mean), ("std", config.std)):
            if values is not None and len(values) != bands:
                raise ValueError(
                    f"image {name} has {len(values)} values, mode {config.mode!r} has {bands} "
                    "band(s): give one per band"
                )
        if config.std is not None and not all(v > 0 for v in config.std):
            raise ValueError(f"image std {list(config.std)} must be positive")
        return config

    @property
    def array_shape(self) -> tuple[int, ...]:
        """Shape of the decoded array: ``(height, width)``, or ``(height, width, bands)``."""
        width, height = self.size
        bands = Image.getmodebands(self.mode)
        if bands == 1:
            return (height, width)
        return (bands, height, width) if self.layout == "CHW" else (height, width, bands)

    def to_array(self, data: bytes) -> np.ndarray:
        """Decode, convert, resize and scale one image.

        The pixel count is read from the image header and checked before any pixel is decoded,
        so a small file that claims a huge image (a decompression bomb) costs nothing.

        Args:
            data: PNG or JPEG bytes (any format in :attr:`formats`), untrusted.

        Returns:
            ``float32[*array_shape]`` in request units (pixel × scale + offset, then
            ``(· - mean) / std`` per band), e.g. ``float32[8, 8]`` with values 0..16 for digits,
            ``float32[3, 224, 224]`` for an RGB model with ``layout: "CHW"``.

        Raises:
            InvalidRequestError: ``too_large`` (more than :attr:`max_pixels` or Pillow's
                ``Image.MAX_IMAGE_PIXELS``) or ``undecodable_image``.
        """
        limit = self.max_pixels
        if Image.MAX_IMAGE_PIXELS:
            limit = min(limit, int(Image.MAX_IMAGE_PIXELS))
        accepted = " or ".join(self.formats)
        try:
            # Image.open reads only the header (lazy); pixels are decoded by load().
            with Image.open(io.BytesIO(data), formats=list(self.formats)) as image:
                width, height = image.size
                if width * height > limit:
                    raise InvalidRequestError(
                        "too_large",
                        f"the image is {width}×{height} = {width * height} pixels, more than the "
                        f"{limit} this model accepts; send it resized to {self.size[0]}×"
                        f"{self.size[1]}",
                    )
                if image.format == "JPEG":
                    image.draft(self.mode, self.size)  # let libjpeg decode at a reduced scale
                image.load()
                converted = image.convert(self.mode)
                if converted.size != self.size:
                    converted = converted.resize(
                        self.size, Image.Resampling[self.resample.upper()]
                    )
                array = np.asarray(converted, dtype=np.float32)
        except InvalidRequestError:
            raise
        # Pillow's own guard: an error above 2 × MAX_IMAGE_PIXELS, a warning (an error under
        # "-W error") above MAX_IMAGE_PIXELS.
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise InvalidRequestError(
                "too_large", f"the image has too many pixels: {exc}"
            ) from exc
        # Pillow's decoders raise many unrelated types on hostile bytes (OSError, SyntaxError,
        # ValueError, struct.error, EOFError, ...); none of them may escape as a worker crash.
        except Exception as exc:
            message = str(exc).split(" <_io.BytesIO", 1)[0]
            raise InvalidRequestError(
                "undecodable_image",
                f"the image cannot be decoded as {accepted}: {type(exc).__name__}: {message}",
            ) from exc
        if self.layout == "CHW" and array.ndim == 3:
            array = np.ascontiguousarray(array.transpose(2, 0, 1))
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


@dataclass(frozen=True)
class ModelConfig:
    """One model's contract, read from ``metadata.json``.

    Attributes:
        name / version: Model name (the request's ``model`` field) and version.
        path: The ONNX file.
        labels: Class labels, index = output column.
        input_name / input_dtype / input_shape: The engine input, e.g. ``float32[-1, 1, 8, 8]``.
        output_name: The engine output with per-class probabilities, ``float32[batch, classes]``.
        request_shape: Shape of a request tensor, e.g. ``(8, 8)``.
        request_dtypes: dtypes a request tensor may have.
        scale / offset: Pre-processing ``x.astype(input_dtype) * scale + offset``.
        metadata: The whole metadata document.
        allow_non_finite: Whether NaN/±Inf may reach the engine (metadata
            ``request.allow_non_finite``, default false).
        image: How an ``image`` input is decoded (metadata ``image``), or None when the model
            takes tensors only.
    """

    name: str
    version: str
    path: Path
    labels: tuple[str, ...]
    input_name: str
    input_dtype: np.dtype[Any]
    input_shape: tuple[int, ...]
    output_name: str
    request_shape: tuple[int, ...]
    request_dtypes: frozenset[str]
    scale: float
    offset: float
    metadata: dict[str, Any]
    allow_non_finite: bool = False
    image: ImageConfig | None = None

    @classmethod
    def from_dir(cls, directory: Path) -> ModelConfig:
        """Read ``directory/metadata.json``.

        Raises:
            ConfigError: The file is missing or lacks a field.
        """
        meta_path = directory / "metadata.json"
        try:
            meta = json.loads(meta_path.read_text())
            image = ImageConfig.from_metadata(meta["image"]) if "image" in meta else None
            config = cls(
                name=meta["name"],
                version=str(meta.get("version", "1")),
                path=directory / meta.get("file", "model.onnx"),
                labels=tuple(meta["labels"]),
                input_name=meta["input"]["name"],
                input_dtype=np.dtype(meta["input"]["dtype"]),
                input_shape=tuple(meta["input"]["shape"]),
                output_name=meta["output"]["name"],
                request_shape=tuple(meta["request"]["shape"]),
                request_dtypes=frozenset(meta["request"]["dtypes"]),
                scale=float(meta["preprocessing"].get("scale", 1.0)),
                offset=float(meta["preprocessing"].get("offset", 0.0)),
                metadata=meta,
                allow_non_finite=_strict_bool(meta["request"].get("allow_non_finite", False)),
                image=image,
            )
        except FileNotFoundError as exc:
            raise ConfigError(f"model folder {directory} has no metadata.json") from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{meta_path} is invalid: missing or bad field {exc}") from exc
        if image is not None and image.array_shape != config.request_shape:
            raise ConfigError(
                f"{meta_path} is invalid: image mode {image.mode!r} and size {list(image.size)} "
                f"give arrays of shape {list(image.array_shape)}, but request.shape is "
                f"{list(config.request_shape)}"
            )
        return config

    def engine_options(self, backend: str) -> dict[str, Any]:
        """Backend options from the metadata's ``engine`` object, e.g.
        ``{"engine": {"torch": {"precision": "fp16"}}}`` gives ``{"precision": "fp16"}`` for the
        ``torch`` backend and ``{}`` for any other.

        Raises:
            ConfigError: ``engine`` or ``engine.<backend>`` is not an object.
        """
        engine = self.metadata.get("engine", {})
        options = engine.get(backend, {}) if isinstance(engine, dict) else None
        if not isinstance(options, dict):
            raise ConfigError(
                f"metadata of model {self.name!r}: 'engine' must map backend names to option "
                f"objects, e.g. {{\"torch\": {{\"precision\": \"fp16\"}}}}; got {engine!r}"
            )
        return dict(options)

    @property
    def item_shape(self) -> tuple[int, ...]:
        """Engine input shape of one item, e.g. ``(1, 8, 8)``."""
        return self.input_shape[1:]

    def preprocess(self, request: InferenceRequest) -> np.ndarray:
        """Turn a request's tensor or image into one engine input item.

        A tensor is used when the request has one, else the image (models with an ``image``
        config only).

        Args:
            request: A decoded request for this model.

        Returns:
            ``input_dtype[*item_shape]``, e.g. ``float32[1, 8, 8]`` = pixels × scale + offset.

        Raises:
            InvalidRequestError: ``unsupported_input`` (an image for a tensor-only model),
                ``bad_dtype``, ``bad_shape``, ``non_finite`` (NaN/Inf given, or produced by the
                conversion, where the model forbids them), ``undecodable_image`` or
                ``too_large`` (image pixels).
        """
        tensor = request.tensor
        if tensor is None:
            if self.image is None or request.image is None:
                raise InvalidRequestError(
                    "unsupported_input",
                    f"model {self.name!r} takes a tensor {list(self.request_shape)}, not an image",
                )
            return self._to_input(self.image.to_array(request.image))
        if tensor.dtype not in self.request_dtypes:
            raise InvalidRequestError(
                "bad_dtype",
                f"model {self.name!r} accepts tensors of dtype "
                f"{' or '.join(sorted(self.request_dtypes))}, got {tensor.dtype}",
            )
        if tensor.shape != self.request_shape:
            raise InvalidRequestError(
                "bad_shape",
                f"model {self.name!r} expects a tensor of shape {list(self.request_shape)}, "
                f"got {list(tensor.shape)}",
            )
        raw = tensor_to_array(tensor)
        if not self.allow_non_finite and raw.dtype.kind == "f":
            if self._may_overflow(raw.dtype):
                self._check_finite(raw, raw)
            else:
                # Non-finite values stay exactly where they were through the conversion, so
                # one check of the converted array does (numpy's isfinite on float16 cost
                # 100 µs of the 250 µs a float16[3, 224, 224] tensor took).
                array = self._convert(raw)
                if not bool(np.isfinite(array).all()):
                    self._check_finite(array, raw)
                return array.reshape(self.item_shape)
        return self._to_input(raw)

    def _check_finite(self, values: np.ndarray, raw: np.ndarray) -> None:
        finite = np.isfinite(values)
        bad = np.size(values) - int(np.count_nonzero(finite))
        if bad:
            first = tuple(int(i) for i in np.argwhere(~finite)[0])
            raise InvalidRequestError(
                "non_finite",
                f"the tensor holds {bad} NaN/infinite value(s) (first at index "
                f"{list(first)}: {raw[first]}); model {self.name!r} accepts finite values "
                "only",
            )

    def _may_overflow(self, dtype: np.dtype[Any]) -> bool:
        """Whether finite values of ``dtype`` can become NaN/Inf on the way to the input dtype
        with this scale and offset: floats that are not narrowed, times |scale| ≤ 1, plus
        |offset| ≤ 1e6, cannot pass the largest finite value of their type."""
        return not (dtype.kind == "f" and dtype.itemsize <= self.input_dtype.itemsize
                    and self.input_dtype.kind == "f" and abs(self.scale) <= 1.0
                    and abs(self.offset) <= 1e6)

    def _convert(self, raw: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported by the caller
            array = raw.astype(self.input_dtype)
            if self.scale != 1.0:
                array *= self.input_dtype.type(self.scale)
            if self.offset != 0.0:
                array += self.input_dtype.type(self.offset)
        return array

    def _to_input(self, raw: np.ndarray) -> np.ndarray:
        array = self._convert(raw)
        if (
            not self.allow_non_finite
            and array.dtype.kind == "f"
            and not bool(np.isfinite(array).all())
        ):
            raise InvalidRequestError(
                "non_finite",
                f"the tensor's values overflow {self.input_dtype} after pre-processing "
                f"(× {self.scale} + {self.offset}); model {self.name!r} accepts values within "
                f"{self.metadata['request'].get('value_range', 'its value range')}",
            )
        return array.reshape(self.item_shape)

    def top_k(self, probs: np.ndarray, k: int) -> list[dict[str, Any]]:
        """The ``k`` most likely labels of one item's probabilities ``float32[classes]``."""
        order = np.argsort(-probs, kind="stable")[:k]
        return [{"label": self.labels[i], "score": round(float(probs[i]), 6)} for i in order]


def _floats(values: Any) -> tuple[float, ...]:
    if not isinstance(values, list | tuple) or not values:
        raise TypeError(f"expected a non-empty list of numbers, got {values!r}")
    return tuple(float(v) for v in values)


def _strict_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"allow_non_finite must be true or false, got {value!r}")
    return value


class ModelRepository:
    """The models in one folder, by name.

    Args:
        root: Folder with one sub-folder per model; None means the bundled models.
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else BUNDLED_MODELS_DIR

    def names(self) -> list[str]:
        """Names of the models found (folders with a ``metadata.json``)."""
        return sorted(p.parent.name for p in self.root.glob("*/metadata.json"))

    def get(self, name: str) -> ModelConfig:
        """The config of model ``name``.

        Raises:
            ModelNotFoundError: No such model folder; the message lists the models there are.
        """
        directory = self.root / name
        if not (directory / "metadata.json").is_file():
            raise ModelNotFoundError(
                f"model {name!r} is not in {self.root}; models there: "
                f"{', '.join(self.names()) or 'none'}"
            )
        return ModelConfig.from_dir(directory)
