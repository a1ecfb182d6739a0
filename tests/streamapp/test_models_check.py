"""``streamapp models check`` (streamapp.models.check): every problem of a model folder is one
line naming the field and the fix, exit 1; a good folder prints the requests it accepts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from streamapp.cli import cli
from streamapp.exceptions import ConfigError
from streamapp.models import BUNDLED_MODELS_DIR
from streamapp.models.check import check_model
from streamapp.models.loading import load_models
from streamapp.models.repository import ModelRepository
from streamapp.settings import Settings

DIGITS = BUNDLED_MODELS_DIR / "digits"
META: dict[str, Any] = json.loads((DIGITS / "metadata.json").read_text())


def folder(root: Path, meta: dict[str, Any], name: str = "digits",
           model: Path | None = DIGITS / "model.onnx") -> Path:
    """A model folder ``root/name`` with ``meta`` and a copy of ``model``."""
    path = root / name
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps(meta))
    if model is not None:
        shutil.copy(model, path / "model.onnx")
    return path


def fixed_batch_model(path: Path) -> Path:
    """An ONNX softmax over ``float32[1, 10]``: a batch dimension fixed at 1."""
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 10])
    y = helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 10])
    graph = helper.make_graph([helper.make_node("Softmax", ["input"], ["probs"])], "fixed",
                              [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_the_bundled_model_passes_and_the_report_says_what_requests_it_takes(
    runner: CliRunner,
) -> None:
    out = runner.invoke(cli, ["models", "check", str(DIGITS)])
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert lines[0] == f"model     digits v1 ({DIGITS / 'model.onnx'})"
    assert "input     input float32[batch, 1, 8, 8]" in lines
    assert "output    probs float32[batch, 10]  <- scores" in lines
    assert ("tensor    float32 or uint8 [8, 8], values 0 to 16, finite -> input "
            "float32[1, 8, 8] = x * 0.0625 + 0") in lines
    assert any(line.startswith("image     PNG or JPEG -> L 8x8 (box)") for line in lines)
    assert "labels    10: 0 1 2 3 4 5 6 7 8 9" in lines
    assert lines[-1] == "ok: streamapp worker --models digits serves it"
    # no PATH: the worker's models (the bundled digits by default)
    default = runner.invoke(cli, ["models", "check"])
    assert default.exit_code == 0 and default.stdout == out.stdout


def test_a_repository_stands_for_each_model_in_it(tmp_path: Path, runner: CliRunner) -> None:
    folder(tmp_path / "repo", META)
    folder(tmp_path / "repo", {**META, "name": "digits2"}, name="digits2")
    out = runner.invoke(cli, ["models", "check", str(tmp_path / "repo")])
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines()[-1] == (
        f"ok: streamapp worker --models-dir {tmp_path / 'repo'} --models digits,digits2 "
        "serves them")


def problems(path: Path, **options: Any) -> list[str]:
    check = check_model(path, **options)
    assert not check.ok
    return check.problems


def test_every_missing_field_is_its_own_line(tmp_path: Path) -> None:
    meta = {"labels": [], "input": {"shape": "x"}, "request": {"dtypes": ["complex64"]}}
    found = problems(folder(tmp_path, meta))
    for field in ("name", "input.name", "input.dtype", "output.name", "request.shape"):
        assert f"field {field}: missing (give " in "\n".join(found), field
    assert "field labels: must be a non-empty list of strings, got []" in found
    assert "field input.shape: must be a list of integers, got 'x'" in found
    assert any(p.startswith("field request.dtypes: must list dtypes of ") and
               "complex64" in p for p in found)
    assert len(found) == 8


def test_metadata_that_does_not_fit_the_engine_is_one_line_per_disagreement(
    tmp_path: Path, runner: CliRunner,
) -> None:
    meta = {**META, "labels": ["a", "b"],
            "input": {"name": "input", "dtype": "float16", "shape": [-1, 8, 8]},
            "output": {"name": "scores"}, "request": {"shape": [8, 9], "dtypes": ["uint8"]}}
    meta.pop("image")
    path = folder(tmp_path, meta)
    out = runner.invoke(cli, ["models", "check", str(path)])
    assert out.exit_code == 1 and out.stdout == ""
    assert out.stderr.splitlines() == [
        f"error: {path}: input.dtype float16 differs from the model's input "
        "input float32[batch, 1, 8, 8]",
        f"error: {path}: input.shape [-1, 8, 8] does not fit the model's input "
        "input float32[batch, 1, 8, 8]",
        f"error: {path}: request.shape [8, 9] holds 72 values, an input item [8, 8] holds 64",
        f"error: {path}: output.name 'scores' is not an output of the model; its outputs: "
        "probs float32[batch, 10]",
    ]


def test_labels_must_match_the_scores(tmp_path: Path) -> None:
    found = problems(folder(tmp_path, {**META, "labels": ["0", "1"]}))
    assert found == ["output probs float32[batch, 10] must be [batch, 2]: one score per label "
                     "(2 labels)"]


def test_a_fixed_batch_dimension_is_refused_with_how_to_export(tmp_path: Path) -> None:
    meta = {"name": "fixed", "labels": list("abcdefghij"),
            "input": {"name": "input", "dtype": "float32", "shape": [1, 10]},
            "output": {"name": "probs"}, "request": {"shape": [10], "dtypes": ["float32"]}}
    path = folder(tmp_path, meta, name="fixed", model=None)
    fixed_batch_model(path / "model.onnx")
    (found,) = problems(path)
    assert found.startswith("the model's input input float32[1, 10] has a fixed batch "
                            "dimension; export it with a dynamic one")


@pytest.mark.parametrize(("change", "expected"), [
    ({"name": "other"}, "name 'other' differs from the folder's name 'digits': a worker finds "
                        "a model by its folder; rename one of them"),
    ({"file": "model.plan"}, "no model file 'model.plan' in the folder (metadata 'file', "
                             "default model.onnx)"),
    ({"image": {**META["image"], "size": [4, 4]}},
     "field image: mode 'L' and size [4, 4] give arrays of shape [4, 4], but "
     "request.shape is [8, 8]"),
])
def test_other_problems_say_what_to_change(tmp_path: Path, change: dict[str, Any],
                                           expected: str) -> None:
    assert expected in problems(folder(tmp_path, {**META, **change}))


def test_a_folder_without_metadata_a_bad_json_and_a_backend_that_cannot_load(
    tmp_path: Path,
) -> None:
    (missing,) = problems(tmp_path / "nothing")
    assert missing.startswith("no such folder; a model repository holds one folder per model")
    folder(tmp_path / "repo", META)
    (repository,) = problems(tmp_path / "repo")
    assert repository == ("no metadata.json in the folder; it holds the models digits: check "
                          "a folder of those (docs/models.md)")
    path = folder(tmp_path, META)
    (path / "metadata.json").write_text("{not json")
    (bad,) = problems(path)
    assert bad.startswith("metadata.json is not valid JSON: ")
    (path / "metadata.json").write_text(json.dumps(META))
    (unloadable,) = problems(path, backend="no-such-backend")
    assert unloadable.startswith("model.onnx does not load with backend 'no-such-backend': ")


def test_the_check_runs_the_model_on_zeros_and_on_a_blank_image(tmp_path: Path) -> None:
    check = check_model(DIGITS)
    assert check.ok and check.engine_tag is not None
    assert check.engine_tag.endswith(":" + META["onnx_sha256"][:8])
    assert [s.name for s in check.inputs] == ["input"] and check.inputs[0].dtype == np.float32
    # an image declaration the pre-processing cannot run (a format Pillow cannot write)
    meta = {**META, "image": {**META["image"], "formats": ["NOSUCH"]}}
    found = problems(folder(tmp_path, meta))
    assert len(found) == 1 and found[0].startswith("a blank NOSUCH image cannot be ")


def test_a_worker_refuses_a_model_that_does_not_fit_its_metadata(tmp_path: Path) -> None:
    meta = {**META, "input": {**META["input"], "name": "pixels"}}
    folder(tmp_path, meta)
    with pytest.raises(ConfigError) as info:
        load_models(Settings(models_dir=tmp_path, backend="onnxruntime"))
    assert str(info.value) == (
        f"model 'digits' ({tmp_path / 'digits' / 'model.onnx'}) does not fit its "
        "metadata.json: input.name 'pixels' is not an input of the model; its inputs: input "
        f"float32[batch, 1, 8, 8] (streamapp models check {tmp_path / 'digits'} lists every "
        "problem; docs/models.md)")


@pytest.mark.parametrize("text", [
    "[]",  # not an object
    '{"name": "digits", "labels": ["a"',  # truncated
    json.dumps({"name": "digits", "labels": ["a"], "request": {"shape": [8]}}),  # fields missing
    json.dumps({**META, "queue_policy": {"max_age_ms": 0, "latest_frame": 1}}),
    json.dumps({**META, "image": {"mode": "L"}}),
], ids=["list", "truncated", "missing", "queue-policy", "image-size"])
def test_the_worker_words_a_bad_metadata_json_as_the_check_does(
    tmp_path: Path, text: str,
) -> None:
    path = folder(tmp_path, META)
    (path / "metadata.json").write_text(text)
    found = problems(path)
    with pytest.raises(ConfigError) as info:
        ModelRepository(tmp_path).get("digits")
    assert str(info.value) == (
        f"{path / 'metadata.json'} is invalid: {'; '.join(found)} (streamapp models check "
        f"{path} lists each problem; docs/models.md)")
    assert all(line.startswith(("metadata.json ", "field ")) and ";" not in line
               for line in found)


def test_each_missing_field_is_named_with_its_path_for_the_worker(tmp_path: Path) -> None:
    path = folder(tmp_path, {"name": "digits", "labels": ["a"], "request": {"shape": [8]}})
    assert [p.split(":")[0] for p in problems(path)] == [
        "field input.name", "field input.dtype", "field input.shape", "field output.name",
        "field request.dtypes"]


@pytest.mark.parametrize(("policy", "shown"), [
    ({"max_age_ms": 200, "latest_frame": True}, "max age 200 ms, latest frame"),
    ({"max_age_ms": 12.5}, "max age 12.5 ms"),
    ({"latest_frame": True}, "latest frame"),
    (None, None),
])
def test_the_report_shows_the_queue_policy(
    tmp_path: Path, runner: CliRunner, policy: dict[str, Any] | None, shown: str | None,
) -> None:
    meta = {**META} if policy is None else {**META, "queue_policy": policy}
    out = runner.invoke(cli, ["models", "check", str(folder(tmp_path, meta))])
    assert out.exit_code == 0, out.output
    queue = [line for line in out.stdout.splitlines() if line.startswith("queue ")]
    assert queue == ([] if shown is None else [
        f"queue     policy: {shown} (docs/delivery.md)"])
