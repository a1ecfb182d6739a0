"""The model repository: a folder per model with ``model.onnx`` and ``metadata.json``.

A model may hold several **versions** side by side, Triton-like: ``NAME/<V>/metadata.json``
(+ its model file) for each version ``V`` (digits only, e.g. ``NAME/2/``). A flat folder
(``NAME/metadata.json``) stays valid: it is one version, the one its metadata names (default
``"1"``). The version a worker serves at start is the one named in ``NAME/current`` (one line,
written by a successful ``streamapp models load``), else the highest version there is.

The metadata says how a request becomes an engine input (allowed dtypes, item shape, scale and
offset, whether NaN/Inf are allowed, how an ``image`` is decoded) and how engine outputs become a
result (labels, top-k). The bundled repository holds the ``digits`` model trained by
``scripts/train_digits.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import widen_half
from engines.preprocess import EncodedImage, ImageSpec
from streamapp.codecs import tensor_to_array
from streamapp.exceptions import ConfigError, InvalidRequestError, ModelNotFoundError
from streamapp.models.images import DEFAULT_IMAGE_FORMATS, DEFAULT_MAX_IMAGE_PIXELS, ImageConfig
from streamapp.models.metadata import queue_policy, read_metadata, strict_bool, value_range
from streamapp.records import InferenceRequest

__all__ = [
    "BUNDLED_MODELS_DIR",
    "CURRENT_FILE",
    "DEFAULT_IMAGE_FORMATS",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ImageConfig",
    "ModelConfig",
    "ModelRepository",
    "normal_version",
    "version_key",
]

log = logging.getLogger(__name__)

#: The models shipped inside the package.
BUNDLED_MODELS_DIR = Path(__file__).resolve().parent


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
        scale / offset: Pre-processing ``x.astype(input_dtype) * scale + offset`` (metadata
            ``preprocessing``, optional: default 1 and 0).
        metadata: The whole metadata document.
        allow_non_finite: Whether NaN/±Inf may reach the engine (metadata
            ``request.allow_non_finite``, default false).
        image: How an ``image`` input is decoded (metadata ``image``), or None when the model
            takes tensors only.
        value_range: ``(low, high)``: the values a request tensor may hold, inclusive, in the
            request's units (before ``scale``/``offset``; metadata ``request.value_range``), or
            None for no check. A value outside it is dead-lettered as ``out_of_range``: a model
            answers confidently for inputs it was never trained on (raw 0–255 pixels for the
            0–16 digits).
        max_age_ms: Metadata ``queue_policy.max_age_ms``: how old a request may be when its
            batch would start (milliseconds, measured from when it reached Kafka); an older
            one gets an ``expired`` result and no engine time (docs/delivery.md). A request's
            ``deadline`` replaces it. None: no limit.
        latest_frame: Metadata ``queue_policy.latest_frame``: of several requests of one
            device in one batch only the newest (the last read) is inferred, the others get a
            ``superseded`` result naming it.
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
    value_range: tuple[float, float] | None = None
    max_age_ms: float | None = None
    latest_frame: bool = False

    @property
    def has_queue_policy(self) -> bool:
        """Whether the metadata sets a queue policy (a max age or latest-frame)."""
        return self.max_age_ms is not None or self.latest_frame

    @property
    def queue_policy_text(self) -> str | None:
        """The queue policy in words, e.g. ``max age 200 ms, latest frame``; None when unset."""
        parts = ([f"max age {self.max_age_ms:g} ms"] if self.max_age_ms is not None else []) + (
            ["latest frame"] if self.latest_frame else [])
        return ", ".join(parts) or None

    @classmethod
    def from_dir(cls, directory: Path) -> ModelConfig:
        """Read ``directory/metadata.json``.

        Raises:
            ConfigError: The file is missing, or not valid: the message lists each problem
                as ``streamapp models check`` words it
                (:func:`~streamapp.models.metadata.metadata_problems`).
        """
        meta_path = directory / "metadata.json"
        if not meta_path.is_file():
            raise ConfigError(f"model folder {directory} has no metadata.json")
        meta, problems = read_metadata(meta_path)
        if meta is None or problems:
            raise _invalid(directory, problems)
        request = meta["request"]
        pre = meta.get("preprocessing", {})
        config = cls(
            name=meta["name"],
            version=str(meta.get("version", "1")),
            path=directory / meta.get("file", "model.onnx"),
            labels=tuple(meta["labels"]),
            input_name=meta["input"]["name"],
            input_dtype=np.dtype(meta["input"]["dtype"]),
            input_shape=tuple(meta["input"]["shape"]),
            output_name=meta["output"]["name"],
            request_shape=tuple(request["shape"]),
            request_dtypes=frozenset(request["dtypes"]),
            scale=float(pre.get("scale", 1.0)),
            offset=float(pre.get("offset", 0.0)),
            metadata=meta,
            allow_non_finite=strict_bool(request.get("allow_non_finite", False)),
            image=ImageConfig.from_metadata(meta["image"]) if "image" in meta else None,
            value_range=value_range(request.get("value_range")),
            **queue_policy(meta.get("queue_policy")),
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

    def image_spec(self) -> ImageSpec | None:
        """The whole image → engine input declaration (image config, then ``preprocessing``
        scale/offset, then the input dtype) as one :class:`~engines.preprocess.ImageSpec` for
        an engine that decodes images itself; None for a tensor-only model or one whose
        declaration cannot be folded (``preprocessing.scale`` 0 with mean/std)."""
        if self.image is None:
            return None
        try:
            return self.image.spec(scale=self.scale, offset=self.offset,
                                   dtype=str(self.input_dtype))
        except ValueError:
            return None

    def encoded_image(
        self, request: InferenceRequest, max_image_pixels: int | None = None
    ) -> EncodedImage | None:
        """The request's image still compressed, for an engine that decodes JPEGs itself, or
        None when the request must go through :meth:`preprocess` (a tensor request, a model
        without images, or a frame the GPU cannot decode: see
        :meth:`~streamapp.models.images.ImageConfig.for_gpu`). Reads the header only."""
        if request.tensor is not None or request.image is None or self.image is None:
            return None
        return self.image.for_gpu(request.image, max_image_pixels)

    def preprocess(
        self, request: InferenceRequest, max_image_pixels: int | None = None
    ) -> np.ndarray:
        """Turn a request's tensor or image into one engine input item.

        A tensor is used when the request has one, else the image (models with an ``image``
        config only). A tensor whose dtype is the input's, with scale 1 and offset 0, is
        returned as a read-only view of the request's bytes (no copy); the executor's pack into
        its (pinned) staging buffer is then the only copy. So is a float16 tensor for a wider
        float input without scale and offset, within the model's value range: the executor
        widens it exactly as it packs (:func:`engines.base.put_item`).

        Args:
            request: A decoded request for this model.
            max_image_pixels: The worker's image pixel limit (``Settings.max_image_pixels``),
                or None for the model's own limit only.

        Returns:
            ``input_dtype[*item_shape]``, e.g. ``float32[1, 8, 8]`` = pixels × scale + offset;
            or ``float16[*item_shape]`` as above (its values are the input's, exactly).

        Raises:
            InvalidRequestError: ``unsupported_input`` (an image for a tensor-only model),
                ``bad_dtype``, ``bad_shape``, ``non_finite`` (NaN/Inf given, or produced by the
                conversion, where the model forbids them), ``undecodable_image`` or
                ``image_too_large``.
        """
        tensor = request.tensor
        if tensor is None:
            if self.image is None or request.image is None:
                raise InvalidRequestError(
                    "unsupported_input",
                    f"model {self.name!r} takes a tensor {list(self.request_shape)}, not an image",
                )
            return self._to_input(self.image.to_array(request.image, max_image_pixels))
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
        plan = self._tensor_plans.get(tensor.dtype)
        if plan is not None and len(tensor.data) == plan.nbytes:
            quick = self._quick_input(plan, tensor.data)
            if quick is not None:
                return quick
        raw = tensor_to_array(tensor)
        array = None
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
        if self.value_range is not None:
            self._check_range(raw, *self.value_range)
        if array is not None:
            return array.reshape(self.item_shape)
        return self._to_input(raw)

    def _check_range(self, raw: np.ndarray, low: float, high: float) -> None:
        """Raise ``out_of_range`` when a value of ``raw`` (request units) is outside
        ``[low, high]``; a bound the dtype cannot pass (0 for unsigned types) is not checked.
        NaN and ±Inf pass: they reach this check only where the model allows them
        (``request.allow_non_finite``). A float tensor is compared with the bounds in its own
        dtype (numpy casts the Python floats to it): 2.65 is 2.6504 for float16 and 2.6500001
        for float32, so a value sent as the bound passes whatever the dtype (docs/records.md)."""
        if raw.dtype.kind in "iu":
            limits = np.iinfo(raw.dtype)
            check_low, check_high = limits.min < low, limits.max > high
        else:
            check_low = check_high = True
            if self.allow_non_finite:
                raw = np.where(np.isfinite(raw), raw, low)
        if raw.size == 0 or not (check_low or check_high):
            return
        below = check_low and bool(raw.min() < low)
        above = check_high and bool(raw.max() > high)
        if not (below or above):
            return
        outside = (raw < low) | (raw > high)
        first = tuple(int(i) for i in np.argwhere(outside)[0])
        raise InvalidRequestError(
            "out_of_range",
            f"model {self.name!r} takes values from {low:g} to {high:g} (its metadata's "
            f"request.value_range); the tensor holds {int(np.count_nonzero(outside))} value(s) "
            f"outside it, the first {raw[first]} at index {list(first)}",
        )

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
        if raw.dtype == self.input_dtype and self.scale == 1.0 and self.offset == 0.0:
            return raw  # nothing to do: keep the view of the received bytes
        plan = self._tensor_plans.get(raw.dtype.name)
        if plan is not None and plan.quiet:
            return plan.convert(raw)
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported by the caller
            array = raw.astype(self.input_dtype)
            if self.scale != 1.0:
                array *= self.input_dtype.type(self.scale)
            if self.offset != 0.0:
                array += self.input_dtype.type(self.offset)
        return array

    @property
    def _tensor_plans(self) -> dict[str, _TensorPlan]:
        """A :class:`_TensorPlan` per request dtype, worked out on first use. Kept outside the
        instance (a frozen dataclass whose ``__dict__`` is its fields: code copies configs
        with ``ModelConfig(**config.__dict__)``), by ``id``, while the config lives."""
        entry = _PLANS.get(id(self))
        if entry is not None and entry[0]() is self:
            return entry[1]
        plans = {}
        for name in self.request_dtypes:
            try:
                dtype = np.dtype(name).newbyteorder("<")
            except TypeError:
                continue  # not a dtype: preprocess rejects it before a plan is looked up
            plans[dtype.name] = _TensorPlan.make(self, dtype)
        key = id(self)
        _PLANS[key] = (weakref.ref(self, lambda _: _PLANS.pop(key, None)), plans)
        return plans

    def _quick_input(self, plan: _TensorPlan, data: bytes) -> np.ndarray | None:
        """The engine input item of a tensor's little-endian ``data`` (``plan.nbytes`` long)
        when it provably passes every check of :meth:`preprocess` (range, non-finite values,
        overflow), with the fewest numpy calls; None to leave it to the full checks, which then
        raise their exact error (or return the same array).

        The plan's conversion is quiet (cannot overflow): an integer tensor then converts to
        finite values, and only the range is checked. A float tensor within a (finite) value
        range is finite, as min/max propagate NaN and ±Inf is outside the range: one range
        check replaces both; without a range the converted values are checked for NaN/Inf.
        """
        if plan.kind == "other":
            return None
        raw = np.frombuffer(data, dtype=plan.dtype)
        if plan.half_as_is:
            return raw.reshape(plan.item_shape) if _half_within(raw, plan) else None
        if plan.widen and self.value_range is not None:
            # numpy reduces float16 one element at a time: min + max of a float16[3, 224, 224]
            # took 1.7 ms (2-core machine, numpy 2.4) and were most of an H200 worker's event
            # loop with ResNet-50 fp16 tensors (py-spy, 2026-12-03). The exact cast first, then
            # the same checks on float32: 0.28 ms, and the cast is the conversion's own
            # (a table lookup: widen_half). Without scale and offset, half_as_is above.
            wide = widen_half(raw, plan.out)
            if not (_max(wide) <= plan.high and _min(wide) >= plan.low):
                return None
            return plan.scale_shift(wide).reshape(plan.item_shape)
        if plan.kind == "int" or self.value_range is not None:
            if (plan.check_high and not _max(raw) <= plan.high) or (
                    plan.check_low and not _min(raw) >= plan.low):
                return None
            return plan.convert(raw).reshape(plan.item_shape)
        array = plan.convert(raw)
        if not _all(_isfinite(array), axis=None):
            return None
        return array.reshape(plan.item_shape)

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
                + (f"{self.value_range[0]:g} to {self.value_range[1]:g}"
                   if self.value_range is not None else "its value range"),
            )
        return array.reshape(self.item_shape)

    def top_k(self, probs: np.ndarray, k: int) -> list[dict[str, Any]]:
        """The ``k`` most likely labels of one item's probabilities ``float32[classes]``."""
        order = np.argsort(-probs, kind="stable")[:k]
        return [{"label": self.labels[i], "score": round(float(probs[i]), 6)} for i in order]

    def top_k_many(self, probs: np.ndarray, k: int) -> list[list[dict[str, Any]]]:
        """:meth:`top_k` of every row of ``probs`` (``float[batch, classes]``) in one sort:
        the same labels, order (ties by class index) and rounded scores.

        Returns:
            One list per row of ``min(k, classes)`` ``{"label": str, "score": float}`` dicts,
            most likely first; scores rounded to 6 decimals.
        """
        probs = np.asarray(probs)
        order = _top_indices(probs, k)
        width = order.shape[1]
        scores = np.round(np.take_along_axis(probs, order, axis=1).astype(np.float64), 6)
        # one flat list of pairs, then cut into rows: ~0.4 µs a row less than nested loops
        labels = np.asarray(self.labels, dtype=object)[order].ravel().tolist()
        flat = [{"label": label, "score": score}
                for label, score in zip(labels, scores.ravel().tolist(), strict=True)]
        if width == 0:
            return [[] for _ in range(order.shape[0])]
        return [flat[i:i + width] for i in range(0, len(flat), width)]


def _top_indices(probs: np.ndarray, k: int) -> np.ndarray:
    """``np.argsort(-probs, axis=1, kind="stable")[:, :k]`` (``probs`` ``float[rows,
    classes]``): each row's ``k`` largest, ties by class index, NaN last.

    A partition finds each row's ``k`` largest in linear time, and only they are sorted: 0.8
    against 3.2 ms for ``float32[64, 1000]`` (ResNet-50's batch of 64, k = 5; 2-core machine,
    numpy 2.4). A row whose ``k``-th and ``k + 1``-th largest are equal (or NaN) could keep
    another of the tied classes: that row is sorted whole.
    """
    rows, classes = probs.shape
    if not 0 < k < classes or rows == 0:
        return np.argsort(-probs, axis=1, kind="stable")[:, :k]
    neg = -probs
    part = np.argpartition(neg, k, axis=1)
    top = np.sort(part[:, :k], axis=1)  # ascending class index: the stable sort's tie order
    values = np.take_along_axis(neg, top, axis=1)
    following = np.take_along_axis(neg, part[:, k:k + 1], axis=1)[:, 0]
    order = np.take_along_axis(top, np.argsort(values, axis=1, kind="stable"), axis=1)
    tied = ~(values.max(axis=1) < following)  # also True where a NaN is involved
    if tied.any():
        again = np.flatnonzero(tied)
        order[again] = np.argsort(neg[again], axis=1, kind="stable")[:, :k]
    return order


#: Each live config's tensor plans (:attr:`ModelConfig._tensor_plans`), by ``id``.
_PLANS: dict[int, tuple[weakref.ref[ModelConfig], dict[str, _TensorPlan]]] = {}

_min, _max, _all, _isfinite = (
    np.minimum.reduce, np.maximum.reduce, np.logical_and.reduce, np.isfinite)


def _half_within(raw: np.ndarray, plan: _TensorPlan) -> bool:
    """Whether every value of the float16 array ``raw`` is finite and within
    ``[plan.half_low, plan.half_high]`` (the range as the full checks compare it), from four
    integer reductions over its bit patterns (~20 µs for float16[3, 224, 224], where numpy's
    float16 min/max took 1.7 ms and a float32 copy to check 0.28 ms).

    As int16, non-negative values (sign bit clear) order as their floats and sit above every
    negative one; as uint16, negative values order by magnitude and sit above every
    non-negative one. So the int16 maximum is the largest value when one is non-negative,
    and the uint16 maximum the smallest when one is negative (else: the uint16 minimum, and
    the int16 minimum, the negative value of least magnitude). A NaN's pattern lies beyond
    infinity's of its sign, so a NaN is one of these extremes whenever there is one.
    """
    signed, unsigned = raw.view(np.int16), raw.view(np.uint16)
    smax, umax = int(_max(signed)), int(_max(unsigned))
    if plan.half_low <= 0.0 <= plan.half_high:
        # a range holding 0 (ImageNet's): only the largest value of each sign can leave it
        return (smax < 0 or _half(smax) <= min(plan.half_high, _HALF_MAX)) and (
            umax < 0x8000 or _half(umax) >= max(plan.half_low, -_HALF_MAX))
    smin = int(_min(signed))
    largest = smax if smax >= 0 else smin & 0xFFFF
    smallest = umax if smin < 0 else int(_min(unsigned))
    high, low = _half(largest), _half(smallest)
    return (plan.half_low <= low and high <= plan.half_high and math.isfinite(low)
            and math.isfinite(high))


#: float16's largest finite value (65504).
_HALF_MAX = float(np.finfo(np.float16).max)


def _half(code: int) -> float:
    """The value of a float16 bit pattern (NaN for a NaN pattern: every comparison fails)."""
    return float(np.uint16(code).view(np.float16))

@dataclass(frozen=True, slots=True)
class _TensorPlan:
    """How :meth:`ModelConfig.preprocess` turns a request tensor of one dtype into an engine
    input, worked out once per model and dtype.

    Attributes:
        dtype: The request dtype, little-endian.
        nbytes: Bytes of a tensor of the model's request shape.
        item_shape: The engine input shape of one item.
        kind: ``"int"`` or ``"float"`` for a tensor the quick path may take (a float one only
            where the model forbids NaN/Inf), ``"other"`` for the full checks always.
        quiet: The conversion is the identity, or no value of ``dtype`` can overflow or meet
            ``inf * 0`` on its way (cast, ``× scale``, ``+ offset``) into the engine's float
            dtype, so it needs no ``np.errstate`` (~0.7 µs a request) and finite values stay
            finite: an integer dtype whose largest magnitude, and that times ``|scale|`` plus
            ``|offset|``, are at most half the engine dtype's largest finite value (the half
            covers rounding); a float dtype not narrowed, with a scale that is not 0 in the
            engine dtype, and ``|scale| <= 1`` without offset or the same bound.
        check_low / check_high: Whether the value range's bound can be passed by ``dtype``
            (an unsigned dtype never goes below 0).
        low / high: The model's value range (request units); ±inf for none.
        identity: The conversion is the identity: the input is a view of the request bytes.
        widen: A float16 tensor for a wider float engine dtype of the quick path: the cast is
            exact, so the range checks can run on the cast (fast) values.
        half_as_is: ``widen`` within a value range, without scale or offset: the quick path
            checks the range on the float16 bit patterns (:func:`_half_within`) and returns
            the request's own float16 bytes, which the executor widens exactly as it packs
            the batch (:func:`engines.base.put_item`): no float32 copy of the request.
        half_low / half_high: The value range rounded to float16, the bounds the full checks
            compare a float16 tensor with (numpy compares a float16 array with a Python
            float in float16).
        out: The engine input dtype.
        scaled / shifted: Whether ``preprocessing`` scale is not 1 / offset is not 0.
        scale / offset: ``preprocessing`` scale and offset as the engine dtype's scalars.
    """

    dtype: np.dtype[Any]
    nbytes: int
    item_shape: tuple[int, ...]
    kind: str
    quiet: bool
    check_low: bool
    check_high: bool
    low: float
    high: float
    identity: bool
    widen: bool
    half_as_is: bool
    half_low: float
    half_high: float
    out: np.dtype[Any]
    scaled: bool
    shifted: bool
    scale: Any
    offset: Any

    @classmethod
    def make(cls, config: ModelConfig, dtype: np.dtype[Any]) -> _TensorPlan:
        out = config.input_dtype
        with np.errstate(all="ignore"):  # float16(1e6) is inf: then the plan is not quiet
            scale, offset = out.type(config.scale), out.type(config.offset)
        low, high = config.value_range or (-np.inf, np.inf)
        identity = dtype == out and config.scale == 1.0 and config.offset == 0.0
        quiet = identity
        if not identity and out.kind == "f" and dtype.kind in "iuf":
            largest = float(np.finfo(out).max)
            s, o = abs(float(scale)), abs(float(offset))
            if dtype.kind == "f":
                # a cast to a float type as wide or wider is exact; then |scale| <= 1 cannot
                # grow a value, else the bound below holds for any finite value
                bound = float(np.finfo(dtype).max) * s + o <= largest / 2
                quiet = s != 0.0 and dtype.itemsize <= out.itemsize and (
                    (s <= 1.0 and o == 0.0) or bound)
            else:
                limits = np.iinfo(dtype)
                magnitude = float(max(-int(limits.min), int(limits.max)))
                quiet = magnitude <= largest / 2 and magnitude * s + o <= largest / 2
        check_low = check_high = config.value_range is not None
        if dtype.kind in "iu" and check_low:
            limits = np.iinfo(dtype)
            check_low, check_high = bool(limits.min < low), bool(limits.max > high)
        nbytes = int(np.prod(config.request_shape, dtype=np.int64)) * dtype.itemsize
        if not quiet or nbytes == 0:  # an empty tensor: numpy's min/max refuse it
            kind = "other"
        elif dtype.kind in "iu":
            kind = "int"
        elif dtype.kind == "f" and not config.allow_non_finite:
            kind = "float"
        else:
            kind = "other"
        widen = (kind == "float" and dtype == np.float16 and out.kind == "f"
                 and out.itemsize > dtype.itemsize)
        with np.errstate(over="ignore"):
            half_low, half_high = float(np.float16(low)), float(np.float16(high))
        return cls(
            dtype=dtype,
            nbytes=nbytes,
            item_shape=config.item_shape,
            kind=kind,
            quiet=quiet,
            check_low=check_low,
            check_high=check_high,
            low=low,
            high=high,
            identity=identity,
            widen=widen,
            half_as_is=widen and config.value_range is not None and config.scale == 1.0
            and config.offset == 0.0 and np.dtype(np.float16).isnative,
            half_low=half_low,
            half_high=half_high,
            out=out,
            scaled=config.scale != 1.0,
            shifted=config.offset != 0.0,
            scale=scale,
            offset=offset,
        )

    def convert(self, raw: np.ndarray) -> np.ndarray:
        """``raw × scale + offset`` in the engine dtype, as :meth:`ModelConfig._convert`
        computes it (cast, then scale, then offset, each rounded to the engine dtype), without
        ``np.errstate``: call it only where :attr:`quiet`."""
        if self.identity:
            return raw
        if raw.dtype == np.float16 and self.out.kind == "f" and self.out.itemsize > 2:
            return self.scale_shift(widen_half(raw, self.out))
        return self.scale_shift(raw.astype(self.out))

    def scale_shift(self, array: np.ndarray) -> np.ndarray:
        """``array × scale + offset`` in place; ``array`` is already in the engine dtype."""
        if self.scaled:
            array *= self.scale
        if self.shifted:
            array += self.offset
        return array


class ModelRepository:
    """The models in one folder, by name.

    Args:
        root: Folder with one sub-folder per model; None means the bundled models.
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root) if root is not None else BUNDLED_MODELS_DIR

    def names(self) -> list[str]:
        """Names of the models found (folders with a ``metadata.json`` of their own or in a
        version folder)."""
        flat = {p.parent.name for p in self.root.glob("*/metadata.json")}
        versioned = {p.parent.parent.name for p in self.root.glob("*/*/metadata.json")
                     if p.parent.name.isdigit()}
        return sorted(flat | versioned)

    def versions(self, name: str) -> dict[str, Path]:
        """Version → folder of every version of model ``name``, lowest first (versions compare
        as numbers where both are digits, e.g. ``"2" < "10"``).

        Raises:
            ModelNotFoundError: No such model; the message lists the models there are.
            ConfigError: The flat folder's metadata cannot be read to learn its version.
        """
        directory = self.root / name
        found: dict[str, Path] = {}
        if (directory / "metadata.json").is_file():
            found[_flat_version(directory)] = directory
        if directory.is_dir():
            for sub in directory.iterdir():
                if sub.name.isdigit() and (sub / "metadata.json").is_file():
                    found[normal_version(sub.name)] = sub
        if not found and not self.root.is_dir():
            raise ModelNotFoundError(
                f"model {name!r}: the model repository {self.root} does not exist (or is not "
                "a folder): check --models-dir (STREAMAPP_MODELS_DIR)"
            )
        if not found:
            raise ModelNotFoundError(
                f"model {name!r} is not in {self.root}; models there: "
                f"{', '.join(self.names()) or 'none'}"
            )
        return dict(sorted(found.items(), key=lambda kv: version_key(kv[0])))

    def current_marker(self, name: str) -> str | None:
        """What ``NAME/current`` says, stripped (``""``: empty), or None without one."""
        try:
            return (self.root / name / CURRENT_FILE).read_text().strip()
        except OSError:
            return None  # no marker: the highest version, as documented

    def default_version(self, name: str, *, warn: bool = True) -> str:
        """The version a worker serves at start: ``NAME/current`` when it names one that
        exists, else the highest (with a warning, unless ``warn`` is false, when ``current``
        names a missing version).

        Raises:
            As :meth:`versions`.
        """
        versions = self.versions(name)
        marker = self.root / name / CURRENT_FILE
        written = self.current_marker(name)
        chosen = normal_version(written) if written else ""  # "02" is version 2, as a folder
        if chosen in versions:
            return chosen
        if written is not None and warn:
            what = f"names version {written!r}, which does not exist" if written else "is empty"
            log.warning("model %s: %s %s (versions: %s); trying the highest version, %s, "
                        "instead", name, marker, what, ", ".join(versions), list(versions)[-1])
        return list(versions)[-1]

    def get(self, name: str, version: str | None = None) -> ModelConfig:
        """The config of model ``name`` at ``version`` (None: :meth:`default_version`).

        Raises:
            ModelNotFoundError: No such model, or no such version (the message lists the
                versions there are).
            ConfigError: The version's metadata is missing a field or invalid.
        """
        versions = self.versions(name)
        chosen = self.default_version(name) if version is None else normal_version(version)
        if chosen not in versions:
            raise ModelNotFoundError(
                f"model {name!r} has no version {chosen!r} in {self.root / name}; versions "
                f"there: {', '.join(versions)}"
            )
        config = ModelConfig.from_dir(versions[chosen])
        if config.version != chosen:  # a version folder's name wins over what its file says
            config = dataclasses.replace(config, version=chosen)
        return config

    def set_current(self, name: str, version: str) -> None:
        """Record ``version`` in ``NAME/current`` (atomically), so that a worker (re)started
        later serves it. A repository that cannot be written (the bundled one in a read-only
        install) logs a warning: a restart then serves :meth:`default_version`'s choice."""
        marker = self.root / name / CURRENT_FILE
        tmp = marker.with_name(f".{CURRENT_FILE}.{os.getpid()}")
        try:
            tmp.write_text(f"{version}\n")
            os.replace(tmp, marker)
        except OSError as exc:
            log.warning("cannot record version %s of model %s in %s (%s); a worker started "
                        "later serves the repository's default version", version, name,
                        marker, exc)


#: The file in a model's folder that names the version to serve at start.
CURRENT_FILE = "current"


def normal_version(version: str) -> str:
    """A version as the repository names it: digits without leading zeros (``"02"`` is
    ``"2"``), any other name unchanged."""
    return str(int(version)) if version.isdigit() else version


def version_key(version: str) -> tuple[int, int | str]:
    """Sort key of a version: numbers in numeric order, before any other name."""
    return (0, int(version)) if version.isdigit() else (1, version)


def _invalid(directory: Path, problems: list[str]) -> ConfigError:
    """The one-line error of a version folder whose ``metadata.json`` has ``problems`` (as
    ``streamapp models check`` words them)."""
    return ConfigError(
        f"{directory / 'metadata.json'} is invalid: {'; '.join(problems)} (streamapp models "
        f"check {directory} lists each problem; docs/models.md)"
    )


def _flat_version(directory: Path) -> str:
    meta, problems = read_metadata(directory / "metadata.json")
    if meta is None:
        raise _invalid(directory, problems)
    return str(meta.get("version", "1"))
