"""The checks a version passes before it serves, at worker start and in ``streamapp models
check``: the same as ``streamapp models load``'s (:mod:`streamapp.models.verify`), for version
folders and the flat layout alike.

The repository of :mod:`tests.model_versions`: 1 and 2 pass, 3 does not load, 4 answers its
samples wrongly.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sklearn.datasets import load_digits
from typer.testing import CliRunner

from streamapp.agents.pipeline import LoadedModel
from streamapp.cli import cli
from streamapp.exceptions import ConfigError, ModelSwapError
from streamapp.models import BUNDLED_MODELS_DIR, ModelRepository
from streamapp.models.check import check_model
from streamapp.models.loading import load_local_models, load_models, load_version
from streamapp.models.verify import close_model, prepare_version, run_blocking, start_order
from streamapp.records import InferenceRequest, TensorPayload
from streamapp.settings import Settings
from tests.model_versions import V2_LABEL, make_digits_versions


def _settings(models_dir: Path) -> Settings:
    return Settings(models_dir=models_dir, backend="onnxruntime", max_batch_size=8)


def _close(models: dict[str, LoadedModel]) -> None:
    async def close() -> None:
        for model in models.values():
            await close_model(model)

    run_blocking(close)


def _label(model: LoadedModel, index: int) -> str:
    """The label ``model`` answers for the data set's image ``index``."""
    image = load_digits().images[index].astype(np.uint8)
    request = InferenceRequest("r", "d", 0, 1.7e9, "digits",
                               tensor=TensorPayload("uint8", (8, 8), image.tobytes()))
    engine = model.executor.engine
    out = engine.infer({model.config.input_name: model.config.preprocess(request)[None]})
    return model.config.top_k(out[model.config.output_name][0], 1)[0]["label"]


@pytest.mark.parametrize(
    ("versions", "current", "served"),
    [
        ((1, 2, 3, 4), None, "2"),  # 4 fails its samples, 3 does not load: the next highest
        ((1, 2, 4), "4", "2"),  # `current` names one that fails: the highest that passes
        ((1, 2, 4), "1", "1"),  # `current` passes: it serves, as before
    ],
)
def test_a_worker_starts_on_the_first_version_that_passes_the_load_checks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, versions: tuple[int, ...],
    current: str | None, served: str,
) -> None:
    root = make_digits_versions(tmp_path, versions=versions)
    if current is not None:
        (root / "digits" / "current").write_text(f"{current}\n")
    with caplog.at_level(logging.INFO, logger="streamapp.models"):
        models = load_models(_settings(root))
    try:
        model = models["digits"]
        assert model.version == served
        # it is that version which answers: 2 says "7" for everything, 1 reads the digit
        assert _label(model, 0) == (V2_LABEL if served == "2" else "0")
    finally:
        _close(models)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    order = start_order(ModelRepository(root), "digits")
    skipped = order[:order.index(served)]
    assert len(errors) == len(skipped)
    for version, line in zip(skipped, errors, strict=True):
        assert line.startswith(f"model digits: not serving version {version}, it fails its "
                               "checks (")
    if "4" in skipped:
        (four,) = [e for e in errors if "version 4" in e]
        assert "(check_failed): sample 0 of digits v4: expected label '5', the engine " \
               "answered '0'" in four
    if "3" in skipped:
        (three,) = [e for e in errors if "version 3" in e]
        assert "(load_failed): version 3 of digits failed to load" in three
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if skipped == ["4", "3"]:
        assert warnings == [
            "model digits: serving version 2 (versions 4 and 3 failed their checks, above; "
            "`streamapp models check` lists every problem)"]
    elif skipped == ["4"]:
        assert warnings == [
            "model digits: serving version 2 (version 4 failed its checks, above; "
            "`streamapp models check` lists every problem)"]
    else:
        assert skipped == [] and warnings == []


def test_a_fallback_with_another_request_contract_is_an_error_line_and_still_serves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    from tests.model_versions import flat_tensors, rewrite_metadata

    root = make_digits_versions(tmp_path, versions=(1, 4))  # 4, the highest, fails its samples
    rewrite_metadata(root / "digits" / "1", flat_tensors)
    with caplog.at_level(logging.INFO, logger="streamapp.models"):
        models = load_models(_settings(root))
    try:
        assert models["digits"].version == "1"  # serving beats refusing to start
    finally:
        _close(models)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and errors[0].startswith("model digits: not serving version 4")
    assert errors[1] == (
        "model digits: serving version 1, which accepts other requests than version 4 (the "
        "version to serve): request.shape [64] ≠ [8, 8]; request.value_range [0, 255] ≠ "
        "[0, 16]; image none (tensor requests only) ≠ L 8x8; a request that version 4 takes "
        "may fail here or mean something else: fix version 4, or give a new request contract "
        "a new model name (docs/versions.md)")


def test_a_current_naming_a_missing_version_is_a_warning_that_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    root = make_digits_versions(tmp_path, versions=(1, 2, 3))
    (root / "digits" / "current").write_text("7\n")
    with caplog.at_level(logging.INFO, logger="streamapp.models"):
        models = load_models(_settings(root))
    try:
        assert models["digits"].version == "2"  # 3, the highest, does not load
    finally:
        _close(models)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"model digits: {root / 'digits' / 'current'} names version '7', which does not exist "
        "(versions: 1, 2, 3); trying the highest version, 3, instead",
        "model digits: serving version 2 (version 3 failed its checks, above; "
        "`streamapp models check` lists every problem)"]


def test_a_worker_refuses_to_start_when_no_version_passes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    root = make_digits_versions(tmp_path, versions=(3, 4))
    with caplog.at_level(logging.INFO, logger="streamapp.models"), \
            pytest.raises(ConfigError) as info:
        load_models(_settings(root))
    message = str(info.value)
    # as docs/versions.md says: an ERROR line per failing version, then the one error
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [e.split(",")[0] for e in errors] == ["model digits: not serving version 4",
                                                 "model digits: not serving version 3"]
    assert message.startswith("model 'digits' cannot be served: no version passes its checks; "
                              "version 4 (check_failed): sample 0 of digits v4: expected label "
                              "'5'")
    assert "; version 3 (load_failed): version 3 of digits failed to load: " in message
    assert message.endswith(f"(streamapp models check {root / 'digits'} lists every problem; "
                            "docs/versions.md)")


def _flat(root: Path, **meta: Any) -> Path:
    """The bundled digits as a flat folder ``root/digits`` with ``meta`` over its metadata."""
    folder = root / "digits"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(BUNDLED_MODELS_DIR / "digits" / "model.onnx", folder)
    body = json.loads((BUNDLED_MODELS_DIR / "digits" / "metadata.json").read_text())
    (folder / "metadata.json").write_text(json.dumps({**body, **meta}))
    return folder


def test_a_flat_model_whose_samples_fail_is_refused_at_start_and_by_models_check(
    tmp_path: Path, runner: CliRunner,
) -> None:
    body = json.loads((BUNDLED_MODELS_DIR / "digits" / "metadata.json").read_text())
    wrong = [{**s, "label": str((int(s["label"]) + 1) % 10)} for s in body["samples"]]
    folder = _flat(tmp_path, samples=wrong)
    with pytest.raises(ConfigError) as info:
        load_models(_settings(tmp_path))
    expected = (f"sample 0 of digits v1: expected label {wrong[0]['label']!r}, the engine "
                f"answered {body['samples'][0]['label']!r}")
    assert str(info.value).startswith("model 'digits' cannot be served: version 1 fails its "
                                      f"checks (check_failed): {expected}")
    out = runner.invoke(cli, ["models", "check", str(folder), "--backend", "onnxruntime"])
    assert out.exit_code == 1 and out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"error: {folder}: check_failed: {expected} (score ")


def test_models_check_runs_every_version_and_names_the_one_a_worker_starts_on(
    tmp_path: Path, runner: CliRunner,
) -> None:
    root = make_digits_versions(tmp_path)
    out = runner.invoke(cli, ["models", "check", "--models-dir", str(root), "--backend",
                              "onnxruntime"])
    assert out.exit_code == 1, out.output
    lines = out.stdout.splitlines()
    for version in ("1", "2"):  # the passing ones: their report, samples checked
        assert f"model     digits v{version} ({root / 'digits' / version / 'model.onnx'})" \
            in lines
    assert lines.count("samples   3 answered as declared (a worker checks them before it "
                       "serves this version)") == 2
    summary = lines[lines.index("versions  digits, in the order a worker tries them at "
                                "start:"):]
    assert [line.split()[:2] for line in summary[1:5]] == [
        ["v4", "FAILED:"], ["v3", "FAILED:"], ["v2", "ok,"], ["v1", "ok,"]]
    assert summary[1].startswith("  v4     FAILED: check_failed: sample 0 of digits v4: "
                                 "expected label '5', the engine answered '0'")
    assert summary[3:] == ["  v2     ok, 3 sample(s) answered as declared",
                           "  v1     ok, 3 sample(s) answered as declared",
                           "  a worker starts on digits v2"]
    errors = out.stderr.splitlines()
    assert [e.split(": ")[1] for e in errors] == [str(root / "digits" / "3"),
                                                  str(root / "digits" / "4")]
    assert errors[1].endswith(summary[1].split("FAILED: ", 1)[1])
    # and a worker does start on it
    models = load_models(_settings(root))
    try:
        assert models["digits"].version == "2"
    finally:
        _close(models)


def test_models_check_runs_the_version_folders_beside_a_flat_folder(
    tmp_path: Path, runner: CliRunner,
) -> None:
    make_digits_versions(tmp_path, versions=(4,))
    _flat(tmp_path)  # version 1, the bundled samples (they pass)
    out = runner.invoke(cli, ["models", "check", "--models-dir", str(tmp_path), "--backend",
                              "onnxruntime"])
    assert out.exit_code == 1, out.output
    assert out.stderr.startswith(f"error: {tmp_path / 'digits' / '4'}: check_failed: sample 0 "
                                 "of digits v4")
    summary = out.stdout.splitlines()[-4:]
    assert summary[0] == "versions  digits, in the order a worker tries them at start:"
    assert summary[1].startswith("  v4     FAILED: check_failed: ")
    assert summary[2:] == ["  v1     ok, 3 sample(s) answered as declared",
                           "  a worker starts on digits v1"]
    models = load_models(_settings(tmp_path))
    try:
        assert models["digits"].version == "1"
    finally:
        _close(models)


def test_models_check_and_models_load_agree_on_every_version(tmp_path: Path) -> None:
    """One code path: a version passes ``models check`` exactly when a load's prepare phase
    (load, warm-up, samples) accepts it, refused for the same reason."""
    root = make_digits_versions(tmp_path)
    repo = ModelRepository(root)
    settings = _settings(root)
    for version in repo.versions("digits"):
        check = check_model(root / "digits" / version, backend="onnxruntime",
                            max_batch_size=8)

        async def prepare(version: str = version) -> int:
            model, checked = await prepare_version(
                repo.get("digits", version), lambda c: load_version(settings, c))
            await close_model(model)
            return checked

        try:
            checked = run_blocking(prepare)
        except ModelSwapError as exc:
            assert not check.ok, version
            if exc.reason == "check_failed":
                assert check.problems == [f"check_failed: {exc}"]
        else:
            assert check.ok and check.samples_checked == checked == 3, version


def test_the_executor_server_does_not_fall_back(tmp_path: Path) -> None:
    """Its workers pick the default version from the repository on their own: a server that
    served another one would answer with the wrong labels, so it refuses to start."""
    root = make_digits_versions(tmp_path, versions=(1, 4))
    with pytest.raises(ConfigError, match=r"version 4 fails its checks \(check_failed\)"):
        load_local_models(_settings(root), fallback=False)



async def test_tensorrt_plans_are_checked_at_start_and_serve_on_the_workers_loop(
    trt_standins: Any, tmp_path: Path,
) -> None:
    """The GPU executor path (in-repo TensorRT and CUDA stand-ins): the start checks run on a
    loop of their own, the version that passed then runs on the worker's; the refused version
    is closed (no CUDA object left)."""
    from engines.tensorrt.builder import build_plan
    from streamapp.models.swap import check_samples, warm_up

    root = make_digits_versions(tmp_path, versions=(1, 2, 4))
    for version in ("1", "2", "4"):
        folder = root / "digits" / version
        build_plan(folder / "model.onnx", folder / "model.plan", max_batch=8)
        meta = json.loads((folder / "metadata.json").read_text())
        (folder / "metadata.json").write_text(json.dumps({**meta, "file": "model.plan"}))
    settings = Settings(models_dir=root, backend="tensorrt", max_batch_size=8, cuda_streams=2)
    models = load_models(settings)  # called on a running loop, as the worker's start does
    model = models["digits"]
    try:
        assert model.version == "2" and model.info.backend == "tensorrt"
        await warm_up(model)
        assert await check_samples(model) == 3
    finally:
        await close_model(model)
