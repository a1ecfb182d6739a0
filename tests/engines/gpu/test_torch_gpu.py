"""The torch backend on a real GPU: digits parity with ONNX Runtime on CPU for all 1,797 images,
executor vs synchronous results, memory after close, and the TensorRT stand-in on real CUDA."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines import cuda, load_engine
from engines.executor.cuda import CudaExecutor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("real_torch"),
    # onnx2torch and torch warn about their own internals (TracerWarning, deprecations).
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

DIGITS = Path(__file__).resolve().parents[3] / "streamapp" / "models" / "digits" / "model.onnx"


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return (data.images / 16.0).astype(np.float32)[:, None], data.target


def _onnxruntime_probs(x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(DIGITS), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(["probs"], {"input": x})[0])


async def _run_all(engine: Any, x: np.ndarray, batch: int) -> np.ndarray:
    async with CudaExecutor(engine, streams=2, depth=2) as ex:
        batches = [[{"input": row} for row in x[i : i + batch]] for i in range(0, len(x), batch)]
        outs = [out["probs"] async for out in ex.map(batches)]
    return np.concatenate(outs)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_digits_predictions_match_onnxruntime_on_all_images(
    precision: str, report: Callable[[str, dict[str, Any]], None]
) -> None:
    x, labels = _digits()
    reference = _onnxruntime_probs(x)
    with load_engine("torch", DIGITS, precision=precision, max_batch_size=64) as engine:
        gpu = asyncio.run(_run_all(engine, x, 64))
        sync = engine.infer({"input": x[:64]})["probs"]
    agree = gpu.argmax(1) == reference.argmax(1)
    report(
        f"digits_parity_{precision}",
        {
            "images": len(x),
            "backend": engine.info.tag,
            "device": engine.info.device,
            "precision": precision,
            "same_prediction": int(agree.sum()),
            "different": int((~agree).sum()),
            "max_abs_prob_diff": float(np.abs(gpu - reference).max()),
            "gpu_accuracy": float((gpu.argmax(1) == labels).mean()),
            "cpu_accuracy": float((reference.argmax(1) == labels).mean()),
        },
    )
    assert len(gpu) == 1797
    assert agree.all(), f"{(~agree).sum()} images predicted differently"
    np.testing.assert_allclose(sync, gpu[:64], atol=1e-6 if precision == "fp32" else 2e-3)
    np.testing.assert_allclose(gpu, reference, atol=1e-4 if precision == "fp32" else 5e-3)


def test_torch_executor_frees_its_memory(report: Callable[[str, dict[str, Any]], None]) -> None:
    import torch

    x, _ = _digits()
    with load_engine("torch", DIGITS, max_batch_size=64) as engine:
        engine.infer({"input": x[:8]})
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free_before, _ = cuda.mem_get_info()
        handles_before = cuda.live_handles()
        asyncio.run(_run_all(engine, x[:640], 64))
        free_after, _ = cuda.mem_get_info()
    report(
        "torch_executor_memory",
        {
            "free_before": free_before,
            "free_after": free_after,
            "leaked_bytes": free_before - free_after,
            "live_handles": cuda.live_handles(),
        },
    )
    assert cuda.live_handles() == handles_before
    assert free_before - free_after <= 8 << 20


def test_tensorrt_standin_runs_on_real_cuda(tmp_path: Path) -> None:
    """The TensorRT backend's call sequence with real device pointers and streams (the
    stand-in computes on the host; this is not real TensorRT)."""
    from engines.tensorrt._api import use_tensorrt
    from engines.tensorrt.builder import build_plan, parse_shapes
    from engines.testing import fake_trt

    x, _ = _digits()
    reference = _onnxruntime_probs(x[:200])
    with use_tensorrt(fake_trt):
        build_plan(DIGITS, tmp_path / "d.plan", profiles=parse_shapes(["input:1,32,64"]))
        with load_engine("tensorrt", tmp_path / "d.plan") as engine:
            out = asyncio.run(_run_all(engine, x[:200], 50))
    np.testing.assert_allclose(out, reference, atol=1e-5)
