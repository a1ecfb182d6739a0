from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engines import registry
from engines.cli import app
from engines.testing import FakeEngine

from .conftest import ModelFactory

runner = CliRunner()


def test_inspect_onnx_model(onnx_model: Path) -> None:
    result = runner.invoke(app, ["inspect", str(onnx_model)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "inputs:" in lines and "outputs:" in lines
    input_line = lines[lines.index("inputs:") + 1].split()
    output_line = lines[lines.index("outputs:") + 1].split()
    assert input_line[:2] == ["input", "float32"]
    assert " ".join(input_line[2:]) == "[batch, 1, 8, 8]"
    assert output_line[:2] == ["probs", "float32"]
    assert " ".join(output_line[2:]) == "[batch, 10]"
    assert f"sha256:    {hashlib.sha256(onnx_model.read_bytes()).hexdigest()}" in lines
    assert "max batch: 256" in lines
    assert "opset:     ai.onnx 17" in lines
    assert result.stderr == ""


def test_inspect_fixed_batch_model_shows_its_batch(make_onnx_model: ModelFactory) -> None:
    result = runner.invoke(app, ["inspect", str(make_onnx_model(batch_dim=1))])
    assert result.exit_code == 0, result.output
    assert "max batch: 1" in result.stdout.splitlines()
    assert "[1, 1, 8, 8]" in result.stdout
    assert "batch," not in result.stdout


@pytest.mark.parametrize("content", [None, b"not an onnx model"], ids=["missing", "garbage"])
def test_inspect_bad_model_is_one_line_and_exit_1(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "model.onnx"
    if content is not None:
        path.write_bytes(content)
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.startswith("error: ")
    assert str(path) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_inspect_plan_says_tensorrt_and_exits_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["inspect", str(tmp_path / "model.plan")])
    assert result.exit_code == 2
    assert "TensorRT" in result.stderr
    assert result.stdout == ""


def test_backends_lists_availability_and_description(
    isolated_registry: dict[str, registry.Backend],
) -> None:
    onnxruntime = isolated_registry["onnxruntime"]
    isolated_registry.clear()
    isolated_registry["onnxruntime"] = onnxruntime
    registry.register(
        "tensorrt",
        lambda path, **options: FakeEngine(),
        is_available=lambda: False,
        description="TensorRT plans on NVIDIA GPUs",
    )
    result = runner.invoke(app, ["backends"])
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split(maxsplit=2)[1:] for line in result.stdout.splitlines()}
    assert rows["onnxruntime"][0] == "available"
    assert rows["tensorrt"] == ["unavailable", "TensorRT plans on NVIDIA GPUs"]
    assert "auto -> onnxruntime" in result.stdout


def test_backends_when_nothing_is_available(
    isolated_registry: dict[str, registry.Backend],
) -> None:
    isolated_registry.clear()
    registry.register("onnxruntime", lambda path, **o: FakeEngine(), is_available=lambda: False)
    result = runner.invoke(app, ["backends"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "onnxruntime  unavailable",
        "auto -> none (no backend can run here)",
    ]
