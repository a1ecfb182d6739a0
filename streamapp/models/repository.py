"""The model repository: a folder per model with ``model.onnx`` and ``metadata.json``.

The metadata says how a request becomes an engine input (allowed dtypes, item shape, scale and
offset) and how engine outputs become a result (labels, top-k). The bundled repository holds the
``digits`` model trained by ``scripts/train_digits.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamapp.codecs import tensor_to_array
from streamapp.exceptions import ConfigError, InvalidRequestError, ModelNotFoundError
from streamapp.records import InferenceRequest

__all__ = ["BUNDLED_MODELS_DIR", "ModelConfig", "ModelRepository"]

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
        scale / offset: Pre-processing ``x.astype(input_dtype) * scale + offset``.
        metadata: The whole metadata document.
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

    @classmethod
    def from_dir(cls, directory: Path) -> ModelConfig:
        """Read ``directory/metadata.json``.

        Raises:
            ConfigError: The file is missing or lacks a field.
        """
        meta_path = directory / "metadata.json"
        try:
            meta = json.loads(meta_path.read_text())
            return cls(
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
            )
        except FileNotFoundError as exc:
            raise ConfigError(f"model folder {directory} has no metadata.json") from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{meta_path} is invalid: missing or bad field {exc}") from exc

    @property
    def item_shape(self) -> tuple[int, ...]:
        """Engine input shape of one item, e.g. ``(1, 8, 8)``."""
        return self.input_shape[1:]

    def preprocess(self, request: InferenceRequest) -> np.ndarray:
        """Turn a request's tensor into one engine input item.

        Args:
            request: A decoded request for this model.

        Returns:
            ``input_dtype[*item_shape]``, e.g. ``float32[1, 8, 8]`` = pixels × scale + offset.

        Raises:
            InvalidRequestError: ``unsupported_input`` (no tensor), ``bad_dtype`` or ``bad_shape``.
        """
        tensor = request.tensor
        if tensor is None:
            raise InvalidRequestError(
                "unsupported_input",
                f"model {self.name!r} takes a tensor {list(self.request_shape)}, not an image",
            )
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
        array = tensor_to_array(tensor).astype(self.input_dtype)
        if self.scale != 1.0:
            array *= self.input_dtype.type(self.scale)
        if self.offset != 0.0:
            array += self.input_dtype.type(self.offset)
        return array.reshape(self.item_shape)

    def top_k(self, probs: np.ndarray, k: int) -> list[dict[str, Any]]:
        """The ``k`` most likely labels of one item's probabilities ``float32[classes]``."""
        order = np.argsort(-probs, kind="stable")[:k]
        return [{"label": self.labels[i], "score": round(float(probs[i]), 6)} for i in order]


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
