"""Versions in the model repository (:class:`streamapp.models.ModelRepository`) and the
request's ``model_version`` pin (:mod:`streamapp.codecs`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from streamapp.codecs import decode_request, encode_request
from streamapp.exceptions import InvalidRequestError, ModelNotFoundError
from streamapp.models import BUNDLED_MODELS_DIR, ModelRepository
from streamapp.records import InferenceRequest, TensorPayload
from tests.model_versions import make_digits_versions


def test_the_flat_folder_is_one_version() -> None:
    repo = ModelRepository()
    assert repo.versions("digits") == {"1": BUNDLED_MODELS_DIR / "digits"}
    assert repo.default_version("digits") == "1"
    assert repo.get("digits").version == repo.get("digits", "1").version == "1"


def test_version_folders_flat_ones_and_the_current_file(tmp_path: Path) -> None:
    root = make_digits_versions(tmp_path, versions=(2, 4))
    shutil.copy(BUNDLED_MODELS_DIR / "digits" / "metadata.json", root / "digits")
    shutil.copy(BUNDLED_MODELS_DIR / "digits" / "model.onnx", root / "digits")
    (root / "digits" / "10").mkdir()  # no metadata: not a version
    shutil.copytree(root / "digits" / "4", root / "digits" / "12")
    repo = ModelRepository(root)
    assert repo.names() == ["digits"]
    assert list(repo.versions("digits")) == ["1", "2", "4", "12"]  # numeric order
    assert repo.default_version("digits") == "12"  # the highest
    assert repo.get("digits", "12").version == "12"  # the folder wins over its metadata ("4")
    assert repo.get("digits", "02").version == "2"
    repo.set_current("digits", "2")
    assert repo.default_version("digits") == "2" and repo.get("digits").version == "2"
    with pytest.raises(ModelNotFoundError, match=r"no version '3' .*versions there: 1, 2, 4, 12"):
        repo.get("digits", "3")
    with pytest.raises(ModelNotFoundError, match="models there: digits"):
        repo.get("faces")


def test_a_model_with_version_folders_only_is_listed(tmp_path: Path) -> None:
    root = make_digits_versions(tmp_path, versions=(1,))
    meta = json.loads((root / "digits" / "1" / "metadata.json").read_text())
    assert ModelRepository(root).names() == ["digits"]
    assert ModelRepository(root).get("digits").labels == tuple(meta["labels"])


def _request(version: str | None) -> InferenceRequest:
    return InferenceRequest("r1", "cam1", 1, 1_700_000_000.0, "digits",
                            tensor=TensorPayload("uint8", (8, 8), bytes(64)),
                            model_version=version)


@pytest.mark.parametrize("codec", ["json", "msgpack"])
def test_a_request_pins_a_version(codec: str) -> None:
    pinned = _request("2")
    assert decode_request(encode_request(pinned, codec)).model_version == "2"  # type: ignore[arg-type]
    assert decode_request(encode_request(_request(None), codec)).model_version is None  # type: ignore[arg-type]
    body = json.loads(encode_request(_request(None)))
    body["model_version"] = 3  # an integer is its decimal string
    assert decode_request(json.dumps(body).encode()).model_version == "3"


@pytest.mark.parametrize("bad", ["", 1.5, True, ["2"], "x" * 65, -1])
def test_a_bad_model_version_is_wrong_type(bad: object) -> None:
    body = json.loads(encode_request(_request(None)))
    body["model_version"] = bad
    with pytest.raises(InvalidRequestError) as exc:
        decode_request(json.dumps(body).encode())
    assert exc.value.reason == "wrong_type" and "model_version" in str(exc.value)


def test_models_check_takes_version_folders(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from streamapp.cli import cli
    from streamapp.models.check import check_model

    root = make_digits_versions(tmp_path, versions=(1, 2))
    assert check_model(root / "digits" / "2", backend="onnxruntime", max_batch_size=8).ok
    done = CliRunner().invoke(cli, ["models", "check", str(root), "--backend", "onnxruntime"])
    assert done.exit_code == 0, done.output
    assert "digits v1 (" in done.output and "digits v2 (" in done.output
    assert f"--models-dir {root} --models digits serves them" in done.output
