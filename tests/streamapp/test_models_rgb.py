"""RGB image models: per-channel mean/std normalization and channels-first layout (the ResNet-50
benchmark model's contract), and backend options read from a model's metadata."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from streamapp.exceptions import ConfigError
from streamapp.models import ModelConfig
from streamapp.models.repository import ImageConfig
from streamapp.records import InferenceRequest, TensorPayload

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


def png(rgb: tuple[int, int, int], size: tuple[int, int] = (6, 5)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, rgb).save(buf, "PNG")
    return buf.getvalue()


def rgb_meta(**image: Any) -> dict[str, Any]:
    return {
        "name": "rgb", "labels": ["a", "b"],
        "input": {"name": "input", "dtype": "float32", "shape": [-1, 3, 4, 4]},
        "output": {"name": "logits", "dtype": "float32", "shape": [-1, 2]},
        "request": {"shape": [3, 4, 4], "dtypes": ["float32", "float16"]},
        "image": {"mode": "RGB", "size": [4, 4], "scale": 1 / 255, "resample": "bilinear",
                  "mean": MEAN, "std": STD, "layout": "CHW", **image},
        "preprocessing": {"scale": 1.0, "offset": 0.0},
        "engine": {"torch": {"precision": "fp16"}},
    }


@pytest.fixture
def rgb_model(tmp_path: Path) -> ModelConfig:
    (tmp_path / "metadata.json").write_text(json.dumps(rgb_meta()))
    return ModelConfig.from_dir(tmp_path)


def test_rgb_image_is_normalized_per_channel_channels_first(rgb_model: ModelConfig) -> None:
    request = InferenceRequest("r", "d", 0, 0.0, "rgb", image=png((255, 0, 128)))

    item = rgb_model.preprocess(request)

    assert item.shape == (3, 4, 4) and item.dtype == np.float32
    expected = [(1.0 - MEAN[0]) / STD[0], (0.0 - MEAN[1]) / STD[1],
                (128 / 255 - MEAN[2]) / STD[2]]
    for channel, value in enumerate(expected):
        np.testing.assert_allclose(item[channel], value, atol=1e-5)


def test_preprocessed_float16_tensor_is_accepted_as_is(rgb_model: ModelConfig) -> None:
    array = np.random.default_rng(0).standard_normal((3, 4, 4)).astype(np.float16)
    request = InferenceRequest("r", "d", 0, 0.0, "rgb", tensor=TensorPayload(
        "float16", (3, 4, 4), array.tobytes()))

    item = rgb_model.preprocess(request)

    np.testing.assert_array_equal(item, array.astype(np.float32))


def test_hwc_layout_keeps_pillow_order() -> None:
    config = ImageConfig.from_metadata({"mode": "RGB", "size": [3, 2], "mean": [0, 0, 0],
                                        "std": [1, 1, 2]})

    array = config.to_array(png((10, 20, 30)))

    assert config.array_shape == (2, 3, 3) and array.shape == (2, 3, 3)
    np.testing.assert_allclose(array[0, 0], [10, 20, 15])


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ({"mean": [0.5, 0.5]}, "mean has 2 values"),
        ({"std": [1, 0, 1]}, "must be positive"),
        ({"layout": "NHWC"}, "layout"),
    ],
)
def test_bad_normalization_is_a_config_error(tmp_path: Path, image: dict[str, Any],
                                             message: str) -> None:
    (tmp_path / "metadata.json").write_text(json.dumps(rgb_meta(**image)))

    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dir(tmp_path)


def test_engine_options_per_backend(rgb_model: ModelConfig, tmp_path: Path) -> None:
    assert rgb_model.engine_options("torch") == {"precision": "fp16"}
    assert rgb_model.engine_options("onnxruntime") == {}
    meta = rgb_meta()
    meta["engine"] = {"torch": "fp16"}
    (tmp_path / "metadata.json").write_text(json.dumps(meta))

    with pytest.raises(ConfigError, match="'engine' must map backend names"):
        ModelConfig.from_dir(tmp_path).engine_options("torch")


def test_nan_in_a_float16_tensor_is_found_with_its_index(rgb_model: ModelConfig) -> None:
    from streamapp.exceptions import InvalidRequestError

    array = np.zeros((3, 4, 4), dtype=np.float16)
    array[1, 2, 3] = np.nan
    array[2, 0, 0] = np.inf
    request = InferenceRequest("r", "d", 0, 0.0, "rgb", tensor=TensorPayload(
        "float16", (3, 4, 4), array.tobytes()))

    with pytest.raises(InvalidRequestError, match=r"holds 2 NaN/infinite value\(s\) \(first at "
                       r"index \[1, 2, 3\]: nan\)") as info:
        rgb_model.preprocess(request)
    assert info.value.reason == "non_finite"
