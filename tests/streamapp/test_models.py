"""Model repository: the bundled ``digits`` model's contract, pre-processing of real digit images,
rejection of inputs the model cannot take, and top-k post-processing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sklearn.datasets import load_digits

from streamapp.exceptions import ConfigError, InvalidRequestError, ModelNotFoundError
from streamapp.models import BUNDLED_MODELS_DIR, ModelConfig, ModelRepository
from streamapp.models.repository import _top_indices
from streamapp.records import InferenceRequest, TensorPayload


@pytest.fixture(scope="module")
def digits() -> ModelConfig:
    return ModelRepository().get("digits")


@pytest.fixture(scope="module")
def first_image() -> np.ndarray:
    """``float64[8, 8]`` with pixel values 0..16: scikit-learn's first digit (a 0)."""
    image: np.ndarray = load_digits().images[0]
    return image


def request_for(array: np.ndarray | None = None, image: bytes | None = None) -> InferenceRequest:
    tensor = None
    if array is not None:
        tensor = TensorPayload(str(array.dtype), tuple(array.shape), array.tobytes())
    return InferenceRequest("r-1", "dev-1", 0, 0.0, "digits", tensor=tensor, image=image)


def test_repository_lists_digits() -> None:
    repository = ModelRepository()

    assert "digits" in repository.names()
    assert repository.root == BUNDLED_MODELS_DIR


def test_digits_contract(digits: ModelConfig) -> None:
    assert digits.name == "digits"
    assert digits.labels == tuple(str(d) for d in range(10))
    assert digits.input_name == "input" and digits.output_name == "probs"
    assert digits.input_dtype == np.float32
    assert digits.input_shape == (-1, 1, 8, 8)
    assert digits.item_shape == (1, 8, 8)
    assert digits.request_shape == (8, 8)
    assert digits.request_dtypes == {"uint8", "float32"}
    assert digits.scale == 1 / 16 and digits.offset == 0.0
    assert digits.path == BUNDLED_MODELS_DIR / "digits" / "model.onnx"
    assert digits.path.is_file()


def test_unknown_model_lists_available() -> None:
    with pytest.raises(ModelNotFoundError) as info:
        ModelRepository().get("resnet50")

    message = str(info.value)
    assert "'resnet50'" in message and "digits" in message
    assert info.value.reason == "unknown_model"
    assert not info.value.retriable


def test_empty_repository_says_none(tmp_path: Path) -> None:
    repository = ModelRepository(tmp_path)

    assert repository.names() == []
    with pytest.raises(ModelNotFoundError, match="models there: none"):
        repository.get("digits")


def test_a_repository_that_does_not_exist_is_named_as_such(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        ModelRepository(tmp_path / "nodir").get("digits")

    assert str(info.value) == (
        f"model 'digits': the model repository {tmp_path / 'nodir'} does not exist (or is not a "
        "folder): check --models-dir (STREAMAPP_MODELS_DIR)")


def test_invalid_metadata_is_a_config_error(tmp_path: Path) -> None:
    meta = json.loads((BUNDLED_MODELS_DIR / "digits" / "metadata.json").read_text())
    del meta["labels"]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "metadata.json").write_text(json.dumps(meta))

    with pytest.raises(ConfigError, match="labels"):
        ModelRepository(tmp_path).get("broken")


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_preprocess_real_digit(digits: ModelConfig, first_image: np.ndarray, dtype: str) -> None:
    array = digits.preprocess(request_for(first_image.astype(dtype)))

    assert array.dtype == np.float32
    assert array.shape == (1, 8, 8)
    np.testing.assert_array_equal(array, (first_image / 16).reshape(1, 8, 8))
    assert array.max() == 15 / 16  # the brightest pixel of this image is 15


def test_preprocess_does_not_modify_request_bytes(
    digits: ModelConfig, first_image: np.ndarray
) -> None:
    request = request_for(first_image.astype(np.float32))
    assert request.tensor is not None
    before = request.tensor.data

    digits.preprocess(request)

    assert request.tensor.data == before
    assert np.frombuffer(request.tensor.data, np.float32).max() == 15.0


def test_wrong_dtype(digits: ModelConfig, first_image: np.ndarray) -> None:
    with pytest.raises(InvalidRequestError) as info:
        digits.preprocess(request_for(first_image.astype(np.int32)))

    assert info.value.reason == "bad_dtype"
    assert "int32" in info.value.message and "uint8" in info.value.message


def test_wrong_shape(digits: ModelConfig, first_image: np.ndarray) -> None:
    with pytest.raises(InvalidRequestError) as info:
        digits.preprocess(request_for(first_image.astype(np.uint8).ravel()))

    assert info.value.reason == "bad_shape"
    assert "[64]" in info.value.message and "[8, 8]" in info.value.message


def _tensor_only_model(tmp_path: Path) -> ModelConfig:
    meta = json.loads((BUNDLED_MODELS_DIR / "digits" / "metadata.json").read_text())
    del meta["image"]
    (tmp_path / "tensors").mkdir()
    (tmp_path / "tensors" / "metadata.json").write_text(json.dumps(meta))
    return ModelRepository(tmp_path).get("tensors")


def test_image_for_a_tensor_only_model_is_unsupported(tmp_path: Path) -> None:
    model = _tensor_only_model(tmp_path)
    assert model.image is None

    with pytest.raises(InvalidRequestError) as info:
        model.preprocess(request_for(image=b"\x89PNG\r\n\x1a\n"))

    assert info.value.reason == "unsupported_input"
    assert "tensor" in info.value.message


def test_top_k_orders_by_score_with_labels(digits: ModelConfig) -> None:
    probs = np.array([0.01, 0.05, 0.6, 0.0, 0.2, 0.0, 0.04, 0.1, 0.0, 0.0], dtype=np.float32)

    top = digits.top_k(probs, 3)

    assert [t["label"] for t in top] == ["2", "4", "7"]
    assert [t["score"] for t in top] == pytest.approx([0.6, 0.2, 0.1])


def test_top_k_ties_keep_label_order(digits: ModelConfig) -> None:
    probs = np.full(10, 0.1, dtype=np.float32)

    assert [t["label"] for t in digits.top_k(probs, 4)] == ["0", "1", "2", "3"]


def test_top_k_of_all_classes(digits: ModelConfig) -> None:
    probs = np.linspace(0.0, 1.0, 10, dtype=np.float32)

    top = digits.top_k(probs, 10)

    assert [t["label"] for t in top] == [str(d) for d in range(9, -1, -1)]
    assert all(isinstance(t["score"], float) for t in top)


@pytest.mark.parametrize("k", [1, 3, 10, 12])
@pytest.mark.parametrize("rows", [0, 1, 64])
def test_top_k_many_is_top_k_of_each_row(digits: ModelConfig, k: int, rows: int) -> None:
    rng = np.random.default_rng(k * 100 + rows)
    probs = rng.random((rows, 10)).astype(np.float32)
    if rows:
        probs[0] = 0.1  # ties: by class index
        probs[-1, 3] = np.nan  # a NaN score sorts as argsort puts it, in both

    many = digits.top_k_many(probs, k)

    assert len(many) == rows
    for got, row in zip(many, probs, strict=True):
        want = digits.top_k(row, k)
        assert [t["label"] for t in got] == [t["label"] for t in want]
        assert [t["score"] for t in got] == pytest.approx([t["score"] for t in want],
                                                           nan_ok=True)
        assert all(type(t["score"]) is float and type(t["label"]) is str for t in got)


@pytest.mark.parametrize("k", [1, 5, 999])
def test_the_top_k_of_1000_classes_is_the_full_sorts(k: int) -> None:
    rng = np.random.default_rng(k)
    probs = rng.random((300, 1000)).astype(np.float32)
    probs[:100] = np.round(probs[:100], 2)  # many ties, some across the k-th place
    probs[100, :] = 0.5  # all tied
    probs[101, 7] = np.nan
    probs[102, :] = np.nan
    probs[103, ::2] = -0.0
    probs[103, 1::2] = 0.0
    probs[104, 10:] = 0.0
    want = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(_top_indices(probs, k), want)


def _model_with_policy(tmp_path: Path, policy: Any) -> ModelConfig:
    meta = json.loads((BUNDLED_MODELS_DIR / "digits" / "metadata.json").read_text())
    meta["queue_policy"] = policy
    (tmp_path / "policed").mkdir(exist_ok=True)
    (tmp_path / "policed" / "metadata.json").write_text(json.dumps(meta))
    return ModelRepository(tmp_path).get("policed")


def test_queue_policy_keys_are_read_and_absent_means_none(
    tmp_path: Path, digits: ModelConfig
) -> None:
    assert (digits.max_age_ms, digits.latest_frame, digits.has_queue_policy) == (
        None, False, False)
    config = _model_with_policy(tmp_path, {"max_age_ms": 200, "latest_frame": True})
    assert (config.max_age_ms, config.latest_frame, config.has_queue_policy) == (
        200.0, True, True)
    assert _model_with_policy(tmp_path, {"latest_frame": True}).max_age_ms is None


@pytest.mark.parametrize(
    ("policy", "says"),
    [({"max_age_ms": 0}, "max_age_ms"), ({"max_age_ms": "200"}, "max_age_ms"),
     ({"latest_frame": 1}, "latest_frame"), ({"max_age": 200}, "unknown key"),
     ([200], "queue_policy")],
    ids=["zero", "string", "int-flag", "typo", "not-an-object"],
)
def test_a_bad_queue_policy_is_a_config_error(tmp_path: Path, policy: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        _model_with_policy(tmp_path, policy)
