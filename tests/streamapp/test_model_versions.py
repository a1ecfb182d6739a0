"""Versions in the model repository (:class:`streamapp.models.ModelRepository`) and the
request's ``model_version`` pin (:mod:`streamapp.codecs`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from streamapp.codecs import decode_request, encode_request
from streamapp.exceptions import InvalidRequestError, ModelNotFoundError
from streamapp.models import BUNDLED_MODELS_DIR, ModelRepository
from streamapp.records import InferenceRequest, TensorPayload
from tests.model_versions import flat_tensors, make_digits_versions, rewrite_metadata


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
    (root / "digits" / "current").write_text("04\n")  # as a folder "04" would be: version 4
    assert repo.default_version("digits") == "4"
    with pytest.raises(ModelNotFoundError, match=r"no version '3' .*versions there: 1, 2, 4, 12"):
        repo.get("digits", "3")
    with pytest.raises(ModelNotFoundError, match="models there: digits"):
        repo.get("faces")


def test_an_empty_current_file_is_a_warning_and_the_highest_version_serves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    root = make_digits_versions(tmp_path, versions=(1, 2))
    (root / "digits" / "current").write_text("\n")

    with caplog.at_level(logging.WARNING, logger="streamapp.models"):
        assert ModelRepository(root).default_version("digits") == "2"

    assert [r.getMessage() for r in caplog.records] == [
        f"model digits: {root / 'digits' / 'current'} is empty (versions: 1, 2); trying the "
        "highest version, 2, instead"]


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


# -- one request contract per model (docs/versions.md) -----------------------------------------

def test_contract_differences_names_each_field_a_client_depends_on() -> None:
    from streamapp.models.verify import contract_differences, contract_problem

    v1 = ModelRepository().get("digits")
    image = dataclasses.replace(v1.image, size=(16, 16), mode="RGB", scale=1.0, offset=-1.0)
    v2 = dataclasses.replace(
        v1, version="2", request_shape=(16, 16, 3), request_dtypes=frozenset({"float32"}),
        value_range=(0.0, 1.0), allow_non_finite=True, image=image,
        labels=(*v1.labels[:3], "three", *v1.labels[4:]),
        metadata={**v1.metadata, "output": {**v1.metadata["output"], "kind": "logits"}})
    assert contract_differences(v2, v1) == [
        "request.shape [16, 16, 3] ≠ [8, 8]",
        "request.dtypes [float32] ≠ [float32, uint8]",
        "request.value_range [0, 1] ≠ [0, 16]",
        "request.allow_non_finite true ≠ false",
        "image.mode RGB ≠ L",
        "image.size [16, 16] ≠ [8, 8]",
        "image.scale 1 ≠ 0.0627451",
        "image.offset -1 ≠ 0",
        "labels: 1 of 10 differ, first at index 3: 'three' ≠ '3'",
        "output.kind logits ≠ probabilities",
    ]
    assert contract_differences(dataclasses.replace(v1, image=None), v1) == [
        "image none (tensor requests only) ≠ L 8x8"]
    assert contract_differences(dataclasses.replace(v1, labels=v1.labels[:9]), v1) == [
        "labels 9 ≠ 10 labels"]
    assert contract_problem(dataclasses.replace(v1, version="2", labels=v1.labels[::-1]), v1,
                            " (current)") == (
        "answers in other terms than version 1 (current): labels: 10 of 10 differ, first at "
        "index 0: '9' ≠ '0'")


def test_the_same_contract_is_no_difference() -> None:
    """What a new network may change: its file, engine input, pre-processing, resampling,
    samples, queue policy and version."""
    from streamapp.models.verify import contract_differences, contract_problem

    v1 = ModelRepository().get("digits")
    assert v1.image is not None
    v2 = dataclasses.replace(
        v1, version="2", path=Path("model.plan"), input_name="x", input_shape=(-1, 64),
        scale=1.0, offset=0.5, image=dataclasses.replace(v1.image, resample="bilinear"),
        metadata={**v1.metadata, "samples": []}, max_age_ms=100.0)
    assert contract_differences(v2, v1) == contract_differences(v1, v2) == []
    assert contract_problem(v2, v1) is None


def test_models_check_reports_a_version_with_another_request_contract(
    tmp_path: Path, runner: Any,
) -> None:
    from streamapp.cli import cli

    root = make_digits_versions(tmp_path, versions=(1, 2))
    rewrite_metadata(root / "digits" / "1", flat_tensors)
    out = runner.invoke(cli, ["models", "check", str(root), "--backend", "onnxruntime"])
    assert out.exit_code == 1, out.output
    problem = ("version 1 accepts other requests than version 2 (the highest): request.shape "
               "[64] ≠ [8, 8]; request.value_range [0, 255] ≠ [0, 16]; image none (tensor "
               "requests only) ≠ L 8x8 (a fallback or hot swap between them would break "
               "clients: give a new contract a new model name, docs/versions.md)")
    assert out.stderr.splitlines() == [f"error: {root / 'digits' / '1'}: {problem}"]
    assert out.stdout.splitlines()[-4:] == [
        "versions  digits, in the order a worker tries them at start:",
        "  v2     ok, 3 sample(s) answered as declared",
        f"  v1     DIFFERS: {problem}",
        "  a worker starts on digits v2"]
    # `current` names the version the others are compared with ("01" as a folder would)
    for written in ("1\n", "01"):
        (root / "digits" / "current").write_text(written)
        out = runner.invoke(cli, ["models", "check", str(root), "--backend", "onnxruntime"])
        assert out.exit_code == 1, out.output
        assert out.stderr.startswith(
            f"error: {root / 'digits' / '2'}: version 2 accepts other requests than version 1 "
            "(current): request.shape [8, 8] ≠ [64]; ")


def test_models_check_says_a_worker_starts_on_a_version_with_another_contract(
    tmp_path: Path, runner: Any,
) -> None:
    from streamapp.cli import cli

    root = make_digits_versions(tmp_path, versions=(1, 4))  # 4 fails its samples
    rewrite_metadata(root / "digits" / "1", flat_tensors)
    out = runner.invoke(cli, ["models", "check", str(root), "--backend", "onnxruntime"])
    assert out.exit_code == 1, out.output
    summary = out.stdout.splitlines()[-4:]
    assert summary[1].startswith("  v4     FAILED: check_failed: ")
    assert summary[2].startswith("  v1     DIFFERS: version 1 accepts other requests than "
                                 "version 4 (the highest): request.shape [64] ≠ [8, 8]; ")
    assert summary[3] == ("  a worker starts on digits v1, whose request contract differs "
                          "from v4's (above)")


async def test_a_hot_swap_to_another_contract_is_refused_with_409(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from streamapp.exceptions import ModelSwapError
    from streamapp.models.swap import ModelSwapper
    from streamapp.settings import Settings

    root = make_digits_versions(tmp_path, versions=(1, 2))
    rewrite_metadata(root / "digits" / "2", lambda meta: meta.update(
        labels=[*meta["labels"][:9], "nine"]))
    repo = ModelRepository(root)
    serving = SimpleNamespace(config=repo.get("digits", "1"), version="1")
    pipeline = SimpleNamespace(models={"digits": serving})
    swapper = ModelSwapper(Settings(models_dir=root, backend="onnxruntime"),
                           lambda: pipeline,  # type: ignore[arg-type,return-value]
                           loader=lambda config: pytest.fail("a refused version is not loaded"))
    with pytest.raises(ModelSwapError) as refused:
        await swapper.load("digits", "2")
    assert (refused.value.reason, refused.value.status) == ("incompatible_version", 409)
    assert str(refused.value) == (
        "version 2 of digits is refused: it answers in other terms than version 1 (serving): "
        "labels: 1 of 10 differ, first at index 9: 'nine' ≠ '9'; clients' requests would fail "
        "or mean something else (deploy a new request contract as a new model name, "
        "docs/versions.md)")
