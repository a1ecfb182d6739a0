"""Checks on the shipped ``digits`` model (``streamapp/models/digits``) that a user would make.

They use only what the product uses at run time (onnxruntime, numpy) plus scikit-learn's bundled
data set; torch is not needed. ``scripts/train_digits.py`` produces the files under test.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

MODEL_DIR = Path(__file__).resolve().parents[2] / "streamapp" / "models" / "digits"
MODEL_PATH = MODEL_DIR / "model.onnx"
METADATA_PATH = MODEL_DIR / "metadata.json"

# ONNX Runtime reports element types as "tensor(<onnx type>)".
ORT_TYPES = {"float32": "tensor(float)", "uint8": "tensor(uint8)", "int64": "tensor(int64)"}


@pytest.fixture(scope="module")
def metadata() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(METADATA_PATH.read_text(encoding="utf-8"))
    return loaded


@pytest.fixture(scope="module")
def session() -> ort.InferenceSession:
    return ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def digits() -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    bunch = load_digits()
    return bunch.images, bunch.target.astype(np.int64)


def preprocess(images: npt.NDArray[Any], metadata: dict[str, Any]) -> npt.NDArray[np.float32]:
    """Apply the metadata's contract: dtype[n, 8, 8] -> float32[n, 1, 8, 8] = x * scale + offset."""
    pre = metadata["preprocessing"]
    x = images.astype(np.float32) * np.float32(pre["scale"]) + np.float32(pre["offset"])
    return x[:, np.newaxis, :, :]


def predict_probs(
    session: ort.InferenceSession, x: npt.NDArray[np.float32], metadata: dict[str, Any]
) -> npt.NDArray[np.float32]:
    (probs,) = session.run([metadata["output"]["name"]], {metadata["input"]["name"]: x})
    return np.asarray(probs)


def test_sha256_in_metadata_matches_model_file(metadata: dict[str, Any]) -> None:
    assert hashlib.sha256(MODEL_PATH.read_bytes()).hexdigest() == metadata["onnx_sha256"]


def test_model_is_one_self_contained_opset_17_file(metadata: dict[str, Any]) -> None:
    model = onnx.load(str(MODEL_PATH), load_external_data=False)
    assert model.graph.initializer, "expected the weights inside the graph"
    for tensor in model.graph.initializer:
        assert tensor.data_location != onnx.TensorProto.EXTERNAL, tensor.name
    opsets = {entry.domain: entry.version for entry in model.opset_import}
    assert opsets == {"": metadata["training"]["onnx_opset"]} == {"": 17}
    onnx.checker.check_model(model)


@pytest.mark.parametrize("kind", ["input", "output"])
def test_onnx_tensor_spec_matches_metadata(
    session: ort.InferenceSession, metadata: dict[str, Any], kind: str
) -> None:
    (spec,) = session.get_inputs() if kind == "input" else session.get_outputs()
    expected = metadata[kind]
    assert spec.name == expected["name"]
    assert spec.type == ORT_TYPES[expected["dtype"]]
    assert len(spec.shape) == len(expected["shape"])
    for actual_dim, expected_dim in zip(spec.shape, expected["shape"], strict=True):
        if expected_dim == -1:
            # Dynamic dimension: ONNX Runtime reports its symbolic name (or None), never an int.
            assert not isinstance(actual_dim, int), spec.shape
        else:
            assert actual_dim == expected_dim, spec.shape
    assert expected["shape"][0] == -1  # the batch axis is dynamic


def test_labels_match_output_width(metadata: dict[str, Any]) -> None:
    assert metadata["labels"] == [str(i) for i in range(10)]
    assert metadata["output"]["shape"][-1] == len(metadata["labels"])


def test_held_out_accuracy_recomputed_from_onnx_matches_metadata(
    session: ort.InferenceSession,
    metadata: dict[str, Any],
    digits: tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]],
) -> None:
    images, labels = digits
    test_idx = np.asarray(metadata["training"]["test_indices"], dtype=np.int64)
    probs = predict_probs(session, preprocess(images[test_idx], metadata), metadata)
    accuracy = float((probs.argmax(axis=1) == labels[test_idx]).mean())
    assert accuracy == pytest.approx(metadata["training"]["test_accuracy"], abs=1e-12)
    assert accuracy >= 0.95


def test_train_and_all_accuracy_recomputed_from_onnx_match_metadata(
    session: ort.InferenceSession,
    metadata: dict[str, Any],
    digits: tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]],
) -> None:
    images, labels = digits
    correct = predict_probs(session, preprocess(images, metadata), metadata).argmax(1) == labels
    is_test = np.zeros(len(labels), dtype=bool)
    is_test[metadata["training"]["test_indices"]] = True
    training = metadata["training"]
    assert float(correct[~is_test].mean()) == pytest.approx(training["train_accuracy"], abs=1e-12)
    assert float(correct.mean()) == pytest.approx(training["all_accuracy"], abs=1e-12)


def test_test_indices_are_the_seeded_stratified_quarter(
    metadata: dict[str, Any],
    digits: tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]],
) -> None:
    _, labels = digits
    training = metadata["training"]
    n_images = training["n_images"]
    test_indices = training["test_indices"]
    assert n_images == len(labels) == 1797
    assert training["test_fraction"] == 0.25
    # sklearn rounds the test share up: ceil(0.25 * 1797) = 450.
    assert len(test_indices) == math.ceil(training["test_fraction"] * n_images) == 450
    assert test_indices == sorted(set(test_indices))
    assert 0 <= test_indices[0] and test_indices[-1] < n_images
    # Re-running the documented split gives exactly these indices; train is its complement,
    # so no held-out image was seen in training.
    train_idx, test_idx = train_test_split(
        np.arange(n_images),
        test_size=training["test_fraction"],
        random_state=training["seed"],
        stratify=labels,
    )
    assert sorted(int(i) for i in test_idx) == test_indices
    assert set(int(i) for i in train_idx).isdisjoint(test_indices)
    assert len(train_idx) + len(test_idx) == n_images
    # Stratified: every class holds about a quarter of its images out.
    for label in range(10):
        of_class = int((labels == label).sum())
        held_out = int((labels[test_indices] == label).sum())
        assert abs(held_out - of_class * training["test_fraction"]) <= 1


def test_batch_of_one_and_batch_of_64_agree(
    session: ort.InferenceSession,
    metadata: dict[str, Any],
    digits: tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]],
) -> None:
    images, _ = digits
    x = preprocess(images[:64], metadata)
    batched = predict_probs(session, x, metadata)
    assert batched.shape == (64, 10)
    assert batched.dtype == np.float32
    singles = np.concatenate([predict_probs(session, x[i : i + 1], metadata) for i in range(64)])
    assert singles.shape == (64, 10)
    np.testing.assert_array_equal(singles.argmax(axis=1), batched.argmax(axis=1))
    np.testing.assert_allclose(singles, batched, rtol=1e-5, atol=1e-6)
    # "kind": "probabilities": each row is a distribution over the labels.
    np.testing.assert_allclose(batched.sum(axis=1), 1.0, rtol=1e-5)
    assert (batched >= 0.0).all()


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_request_dtypes_give_the_same_predictions(
    session: ort.InferenceSession,
    metadata: dict[str, Any],
    digits: tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]],
    dtype: str,
) -> None:
    images, labels = digits
    request = metadata["request"]
    assert dtype in request["dtypes"]
    assert tuple(request["shape"]) == images.shape[1:]
    low, high = request["value_range"]
    assert images.min() == low and images.max() == high
    # load_digits() pixels are whole numbers 0..16, so a uint8 request carries them exactly.
    as_request = images[:100].astype(dtype)
    probs = predict_probs(session, preprocess(as_request, metadata), metadata)
    reference = predict_probs(session, preprocess(images[:100], metadata), metadata)
    np.testing.assert_array_equal(probs, reference)
    assert (probs.argmax(axis=1) == labels[:100]).mean() >= 0.95
