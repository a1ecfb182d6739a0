"""``metadata.json`` validation shared by the worker (:meth:`ModelConfig.from_dir
<streamapp.models.repository.ModelConfig.from_dir>`) and ``streamapp models check``: one
problem line per missing or bad field, worded the same for both.

A missing field reads ``field input.dtype: missing (give …)``, a bad one ``field
queue_policy.max_age_ms: must be …, got …``. Lines avoid ";": the worker joins them with
"; " into its one error line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from streamapp.codecs import ALLOWED_DTYPES
from streamapp.models.images import ImageConfig

__all__ = [
    "QUEUE_POLICY_KEYS",
    "REQUIRED_FIELDS",
    "metadata_problems",
    "queue_policy",
    "read_metadata",
    "strict_bool",
    "value_range",
]

#: Fields every ``metadata.json`` needs: dotted path → what it must be.
REQUIRED_FIELDS: dict[str, str] = {
    "name": "the model's name, a string: the requests' `model` field",
    "labels": "a list of class labels, index = output column",
    "input.name": "the engine input's name, a string",
    "input.dtype": "the engine input's dtype, e.g. \"float32\"",
    "input.shape": "the engine input's shape with -1 for the batch, e.g. [-1, 64]",
    "output.name": "the name of the engine output with one score per label",
    "request.shape": "the shape of a request tensor, e.g. [8, 8]",
    "request.dtypes": "the dtypes a request tensor may have, e.g. [\"float32\"]",
}

#: Keys of the metadata's ``queue_policy`` object.
QUEUE_POLICY_KEYS = ("max_age_ms", "latest_frame")


class FieldError(ValueError):
    """A field of ``metadata.json`` that is present but wrong; ``str()`` is the problem line."""

    def __init__(self, dotted: str, must: str) -> None:
        super().__init__(f"field {dotted}: {must}")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def value_range(value: Any) -> tuple[float, float] | None:
    """Metadata ``request.value_range``: ``[low, high]``, finite numbers, low ≤ high; or
    absent (None).

    Raises:
        FieldError: Anything else.
    """
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2 or not all(_number(v) for v in value):
        raise FieldError("request.value_range", f"must be [low, high], got {value!r}")
    low, high = float(value[0]), float(value[1])
    if not (np.isfinite(low) and np.isfinite(high) and low <= high):
        raise FieldError("request.value_range",
                         f"must be finite with low <= high, got {value!r}")
    return low, high


def queue_policy(value: Any) -> dict[str, Any]:
    """Metadata ``queue_policy``: ``{"max_age_ms": number > 0 or null, "latest_frame": bool}``,
    both optional; or absent. Returns the ``ModelConfig`` fields it sets.

    Raises:
        FieldError: Not an object, an unknown key, or a bad value.
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FieldError("queue_policy", "must be an object such as "
                         f"{{\"max_age_ms\": 200, \"latest_frame\": true}}, got {value!r}")
    unknown = sorted(set(value) - set(QUEUE_POLICY_KEYS))
    if unknown:
        raise FieldError("queue_policy", f"unknown key(s) {unknown}, the keys are "
                         f"{', '.join(QUEUE_POLICY_KEYS)}")
    out: dict[str, Any] = {}
    age = value.get("max_age_ms")
    if age is not None:
        if not _number(age) or not (np.isfinite(age) and age > 0):
            raise FieldError("queue_policy.max_age_ms", "must be a number of milliseconds > 0 "
                             f"or null, got {age!r}")
        out["max_age_ms"] = float(age)
    latest = value.get("latest_frame", False)
    if not isinstance(latest, bool):
        raise FieldError("queue_policy.latest_frame", f"must be true or false, got {latest!r}")
    out["latest_frame"] = latest
    return out


def strict_bool(value: Any, dotted: str = "request.allow_non_finite") -> bool:
    """A JSON ``true``/``false``.

    Raises:
        FieldError: Anything else (``"false"``, 0, null).
    """
    if not isinstance(value, bool):
        raise FieldError(dotted, f"must be true or false, got {value!r}")
    return value


def _get(meta: dict[str, Any], dotted: str) -> Any:
    value: Any = meta
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _required_problems(meta: dict[str, Any]) -> list[str]:
    problems = []
    for dotted, what in REQUIRED_FIELDS.items():
        if _get(meta, dotted) is None:
            problems.append(f"field {dotted}: missing (give {what})")
    for dotted in ("name", "input.name", "output.name"):
        value = _get(meta, dotted)
        if value is not None and not isinstance(value, str):
            problems.append(str(FieldError(dotted, f"must be a string, got {value!r}")))
    labels = meta.get("labels")
    if labels is not None and (not isinstance(labels, list) or not labels
                               or not all(isinstance(x, str) for x in labels)):
        problems.append(str(FieldError("labels", "must be a non-empty list of strings, got "
                                       f"{labels!r}")))
    for dotted in ("input.shape", "request.shape"):
        shape = _get(meta, dotted)
        if shape is not None and (not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) for d in shape)):
            problems.append(str(FieldError(dotted, f"must be a list of integers, got {shape!r}")))
    dtypes = _get(meta, "request.dtypes")
    if dtypes is not None:
        unknown = [d for d in dtypes if d not in ALLOWED_DTYPES] if isinstance(
            dtypes, list) else [dtypes]
        if unknown or not dtypes:
            problems.append(str(FieldError(
                "request.dtypes",
                f"must list dtypes of {', '.join(sorted(ALLOWED_DTYPES))}, got {dtypes!r}")))
    dtype = _get(meta, "input.dtype")
    if dtype is not None:
        try:
            np.dtype(dtype)
        except TypeError:
            problems.append(str(FieldError("input.dtype", f"{dtype!r} is not a dtype name, "
                                           "e.g. \"float32\"")))
    return problems


def _optional_problems(meta: dict[str, Any]) -> list[str]:
    problems = []
    version = meta.get("version")
    if version is not None and (isinstance(version, bool) or not isinstance(version, str | int)):
        problems.append(str(FieldError("version", f"must be a string, got {version!r}")))
    file = meta.get("file")
    if file is not None and not isinstance(file, str):
        problems.append(str(FieldError("file", f"must be a file name, got {file!r}")))
    pre = meta.get("preprocessing", {})
    if not isinstance(pre, dict):
        problems.append(str(FieldError("preprocessing", "must be an object "
                                       f"{{\"scale\": ..., \"offset\": ...}}, got {pre!r}")))
    else:
        for key in ("scale", "offset"):
            if key in pre and not _number(pre[key]):
                problems.append(str(FieldError(f"preprocessing.{key}",
                                               f"must be a number, got {pre[key]!r}")))
    request = meta.get("request")
    checks: list[tuple[Any, Any]] = [(queue_policy, meta.get("queue_policy"))]
    if isinstance(request, dict):
        checks += [(strict_bool, request.get("allow_non_finite", False)),
                   (value_range, request.get("value_range"))]
    for parse, value in checks:
        try:
            parse(value)
        except FieldError as exc:
            problems.append(str(exc))
    return problems


def _image_problems(meta: dict[str, Any]) -> list[str]:
    """The ``image`` object: its own fields, then whether it gives ``request.shape``."""
    value = meta["image"]
    if not isinstance(value, dict):
        return [str(FieldError("image", f"must be an object such as {{\"mode\": \"L\", "
                               f"\"size\": [8, 8]}}, got {value!r}"))]
    for key, what in (("mode", "'L' (grey) or 'RGB'"), ("size", "[width, height]")):
        if key not in value:
            return [f"field image.{key}: missing (give {what})"]
    size = value["size"]
    if not isinstance(size, list) or len(size) != 2 or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in size):
        return [str(FieldError("image.size", f"must be [width, height] in pixels, got "
                               f"{size!r}"))]
    try:
        image = ImageConfig.from_metadata(value)
    except KeyError as exc:  # Image.Resampling[...] of an unknown filter
        return [str(FieldError("image.resample", f"{exc} is not a Pillow filter, use box, "
                               "bilinear, bicubic, lanczos, hamming or nearest"))]
    except (TypeError, ValueError) as exc:
        return [str(FieldError("image", str(exc)))]
    request_shape = _get(meta, "request.shape")
    if isinstance(request_shape, list) and image.array_shape != tuple(request_shape):
        return [str(FieldError(
            "image", f"mode {image.mode!r} and size {list(image.size)} give arrays of shape "
            f"{list(image.array_shape)}, but request.shape is {request_shape}"))]
    return []


def metadata_problems(meta: dict[str, Any]) -> list[str]:
    """Every problem of a ``metadata.json`` document, one line each (empty: a
    ``ModelConfig`` can be made of it). The engine is not looked at: that is
    :func:`streamapp.models.check.engine_problems`.

    Args:
        meta: The parsed document.
    """
    problems = _required_problems(meta) + _optional_problems(meta)
    if "image" in meta:
        problems += _image_problems(meta)
    return problems


def read_metadata(meta_path: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """Read and validate one ``metadata.json``.

    Args:
        meta_path: The file (it must exist).

    Returns:
        ``(document, problems)``: document None when the file is not one JSON object;
        problems as :func:`metadata_problems`, or the one line saying why it could not be read.
    """
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, [f"metadata.json is not valid JSON: {exc}"]
    if not isinstance(meta, dict):
        return None, ["metadata.json must hold one JSON object"]
    return meta, metadata_problems(meta)
