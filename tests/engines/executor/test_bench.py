"""``engines bench`` end to end on small models: CPU (ONNX Runtime, thread executor) and the
TensorRT + CUDA stand-ins (GPU executor, timeline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engines import cuda
from engines.bench import BenchConfig, format_results, run_bench
from engines.cli import app
from engines.tensorrt._api import use_tensorrt
from engines.tensorrt.builder import build_plan
from engines.testing import fake_cuda, fake_trt

FAST = {"duration_s": 0.2, "warmup_s": 0.05, "batch_sizes": (1, 4)}


def test_bench_cli_on_cpu_writes_json(onnx_model: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "bench",
            str(onnx_model),
            "--backend",
            "onnxruntime",
            "--batch-sizes",
            "1,4",
            "--duration-s",
            "0.2",
            "--warmup-s",
            "0.05",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "raw_infer" in result.output and "batched_over_sync=" in result.output
    data = json.loads((tmp_path / "bench.json").read_text())
    assert set(data["raw"]) == {"1", "4"}
    for mode in ("sync", "async"):
        assert data[mode]["items_per_s"] > 0
        assert data[mode]["p50_ms"] <= data[mode]["p99_ms"]
    assert data["batched"]["4"]["mean_batch"] > 1


def test_bench_on_the_gpu_path_with_standins(onnx_model: Path, tmp_path: Path) -> None:
    fake_cuda.reset()
    with cuda.use_runtime(fake_cuda), use_tensorrt(fake_trt):
        plan = tmp_path / "m.plan"
        build_plan(onnx_model, plan, max_batch=4)
        results = run_bench(
            BenchConfig(model=plan, backend="tensorrt", timeline_batches=4, **FAST),  # type: ignore[arg-type]
            log=lambda _: None,
        )
        assert cuda.live_handles() == {}
    fake_cuda.reset()
    assert set(results["raw"]["4"]) == {"io", "device"}
    assert results["executor"]["4"]["items_per_s"] > 0
    timeline = results["timeline"]
    assert len(timeline["entries"]) == 4
    assert timeline["order"] == "gpu compute start"
    checks = results["checks"]
    assert {"executor_over_raw", "batched_over_sync", "h2d_overlaps_compute"} <= set(checks)
    assert "executor" in format_results(results)


@pytest.mark.parametrize("bad", ["0", "x"])
def test_bench_rejects_bad_batch_sizes(onnx_model: Path, bad: str) -> None:
    result = CliRunner().invoke(app, ["bench", str(onnx_model), "--batch-sizes", bad])
    assert result.exit_code != 0
