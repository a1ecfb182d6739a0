"""A model repository with four versions of ``digits`` for the hot-swap tests.

* ``1``: the bundled model, declaring three samples it answers correctly;
* ``2``: the same network with the final layer's bias of class 7 raised by
  :data:`SHIFT`, so that it answers ``"7"`` for every input (answers differ from version 1);
* ``3``: a truncated model file (fails to load);
* ``4``: the bundled model declaring samples whose labels are wrong (fails its check).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from sklearn.datasets import load_digits

from streamapp.models import BUNDLED_MODELS_DIR

#: Added to the logit of class 7 in version 2 (the logits of digits are within about ±30).
SHIFT = 1000.0
#: The label version 2 gives every input.
V2_LABEL = "7"
#: Indices of the data set images used as samples (labels 0, 1, 2).
SAMPLE_INDICES = (0, 1, 2)


def _samples(labels: list[str]) -> list[dict[str, Any]]:
    images = load_digits().images
    return [{"tensor": images[i].astype(np.float32).tolist(), "label": label}
            for i, label in zip(SAMPLE_INDICES, labels, strict=True)]


def _write(folder: Path, meta: dict[str, Any], model: bytes) -> None:
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(model)
    (folder / "metadata.json").write_text(json.dumps(meta))


def shifted_model(source: Path, label_index: int = int(V2_LABEL), shift: float = SHIFT) -> bytes:
    """``source`` (the digits ONNX file) with ``shift`` added to the last Gemm's bias of class
    ``label_index``."""
    model = onnx.load(str(source))
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    bias_name = gemms[-1].input[2]
    for i, init in enumerate(model.graph.initializer):
        if init.name == bias_name:
            bias = numpy_helper.to_array(init).copy()
            bias[label_index] += shift
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(bias, bias_name))
    return model.SerializeToString()


def make_digits_versions(root: Path, versions: tuple[int, ...] = (1, 2, 3, 4)) -> Path:
    """Write ``root/digits/<V>/`` for each of ``versions``; returns ``root``."""
    source = BUNDLED_MODELS_DIR / "digits"
    meta = json.loads((source / "metadata.json").read_text())
    original = (source / "model.onnx").read_bytes()
    good = ["0", "1", "2"]
    builders = {
        1: lambda: ({**meta, "version": "1", "samples": _samples(good)}, original),
        2: lambda: ({**meta, "version": "2", "samples": _samples([V2_LABEL] * 3)},
                    shifted_model(source / "model.onnx")),
        3: lambda: ({**meta, "version": "3", "samples": _samples(good)},
                    original[: len(original) // 3]),
        4: lambda: ({**meta, "version": "4", "samples": _samples(["5", "1", "2"])}, original),
    }
    for version in versions:
        body, model = builders[version]()
        _write(root / "digits" / str(version), body, model)
    return root


def rewrite_metadata(folder: Path, change: Any) -> None:
    """Apply ``change(meta)`` to ``folder/metadata.json``."""
    path = folder / "metadata.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def flat_tensors(meta: dict[str, Any]) -> None:
    """Version 1 of digits taking flat ``[64]`` tensors of 0..255 and no images: the same
    network (64 values per item), another request contract."""
    meta["request"]["shape"] = [64]
    meta["request"]["value_range"] = [0, 255]
    del meta["image"]
    meta["samples"] = [{**s, "tensor": [v for row in s["tensor"] for v in row]}
                       for s in meta["samples"]]
