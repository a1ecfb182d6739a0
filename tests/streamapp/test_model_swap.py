"""Hot swap of model versions on one pipeline (no Kafka): :mod:`streamapp.models.swap`.

Steady requests from 16 devices go through a real ONNX Runtime pipeline while versions 2
(answers "7" for everything), 3 (truncated file), 4 (samples fail) and 1 again are loaded; every
request is answered exactly once, none is dead-lettered, every batch is answered by one version,
the one current when it started, and a refused version leaves the current one serving.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sklearn.datasets import load_digits

from streamapp.agents.pipeline import InferencePipeline, LoadedModel
from streamapp.codecs import decode_dead_letter, decode_result
from streamapp.exceptions import ModelSwapError
from streamapp.models import ModelRepository
from streamapp.models.loading import load_version
from streamapp.models.swap import (
    ModelSwapper,
    check_samples,
    close_model,
    contract_difference,
)
from streamapp.settings import Settings
from tests.model_versions import V2_LABEL, make_digits_versions
from tests.streamapp.agents.test_pipeline import FakeSink, Source, good

DEVICES = 16


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return load_digits().images.astype(np.uint8)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_digits_versions(tmp_path / "models")


def _settings(models_dir: Path, **extra: Any) -> Settings:
    return Settings(models_dir=models_dir, backend="onnxruntime", topic_prefix="",
                    max_batch_size=8, max_batch_delay_ms=2.0, max_inflight_batches=2,
                    **extra)


async def _started(settings: Settings, version: str = "1") -> tuple[InferencePipeline, FakeSink]:
    config = ModelRepository(settings.models_dir).get("digits", version)
    sink = FakeSink()
    pipeline = InferencePipeline(settings, {"digits": load_version(settings, config)}, sink,
                                 worker="w")
    await pipeline.start()
    return pipeline, sink


async def _stop(pipeline: InferencePipeline, swapper: ModelSwapper | None = None) -> None:
    """Stop the pipeline and close every version still loaded."""
    await pipeline.stop()
    if swapper is not None:
        await swapper.close()
    for model in pipeline.loaded["digits"].values():
        await close_model(model)


async def test_swap_mid_traffic_answers_every_request_once(
    repo: Path, images: np.ndarray
) -> None:
    settings = _settings(repo)
    pipeline, sink = await _started(settings)
    swapper = ModelSwapper(settings, lambda: pipeline)
    v1 = pipeline.models["digits"]
    source = Source()
    sent: dict[str, int] = {}  # request_id -> image index
    loaded_at: list[tuple[int, str]] = []  # (requests read when the load returned, version)
    started_at: dict[str, int] = {}  # version -> requests read when its load was called
    stop = asyncio.Event()

    async def traffic() -> None:
        seq = 0
        while not stop.is_set():
            batch = []
            for d in range(DEVICES):
                i = (seq * DEVICES + d) % len(images)
                batch.append(good(source, images[i], f"dev-{d}", seq))
                sent[f"dev-{d}-{seq}"] = i
            await pipeline.handle_many(batch)
            seq += 1
            await asyncio.sleep(0.002)

    feeder = asyncio.create_task(traffic())
    refusals: dict[str, ModelSwapError] = {}
    try:
        await asyncio.sleep(0.15)
        for version in ("2", "3", "4", "1"):
            started_at[version] = len(sent)
            try:
                await swapper.load("digits", version)
                loaded_at.append((len(sent), version))
            except ModelSwapError as exc:
                refusals[version] = exc
                assert pipeline.models["digits"].version == "2"  # 2 keeps answering
            await asyncio.sleep(0.15)
    finally:
        stop.set()
        await feeder
        await pipeline.batcher.drain()
        await swapper.wait_closed()
        await _stop(pipeline, swapper)

    assert refusals["3"].reason == "load_failed" and refusals["3"].status == 422
    assert refusals["4"].reason == "check_failed"
    assert "expected label '5'" in str(refusals["4"])
    assert [v for _, v in loaded_at] == ["2", "1"]
    results = [decode_result(s.value) for s in sink.sent if s.topic == settings.result_topic]
    letters = [decode_dead_letter(s.value) for s in sink.sent if s.topic == settings.dlq_topic]
    assert letters == []
    ids = [r["request_id"] for r in results]
    assert len(ids) == len(set(ids)) == len(sent)  # every request exactly once
    assert source.acked and len(source.acked) == len(sent)
    # one version per batch; version 2 answers "7", version 1 the digit itself
    by_batch: dict[str, set[str]] = {}
    for r in results:
        by_batch.setdefault(r["batch_id"], set()).add(r["model_version"])
        label = r["outputs"]["top_k"][0]["label"]
        if r["model_version"] == "2":
            assert label == V2_LABEL
    assert all(len(v) == 1 for v in by_batch.values())
    order = {rid: n for n, rid in enumerate(sent)}
    versions = [r["model_version"] for r in sorted(results, key=lambda r: order[r["request_id"]])]
    # in read order: 1..., then 2..., then 1... (each switch once)
    changes = [v for n, v in enumerate(versions) if n == 0 or versions[n - 1] != v]
    assert changes == ["1", "2", "1"]
    # a request read after a load returned is answered by the new version
    first_v2 = versions.index("2")
    assert first_v2 <= loaded_at[0][0]
    assert set(versions[loaded_at[0][0]:started_at["1"]]) == {"2"}  # 3 and 4 changed nothing
    assert set(versions[loaded_at[1][0]:]) == {"1"}
    assert v1.executor.engine.closed  # the swapped-out version was closed
    assert sum(1 for r in results if r["model_version"] == "2") > 0


async def test_refused_versions_leave_the_current_one(repo: Path) -> None:
    settings = _settings(repo)
    pipeline, _ = await _started(settings)
    swapper = ModelSwapper(settings, lambda: pipeline)
    try:
        current = pipeline.models["digits"]
        with pytest.raises(ModelSwapError) as missing:
            await swapper.load("digits", "9")
        assert (missing.value.reason, missing.value.status) == ("version_not_found", 404)
        assert "versions there: 1, 2, 3, 4" in str(missing.value)
        with pytest.raises(ModelSwapError) as unknown:
            await swapper.load("faces", "1")
        assert (unknown.value.reason, unknown.value.status) == ("unknown_model", 404)
        assert pipeline.models["digits"] is current and not current.executor.engine.closed
        described = swapper.describe()["digits"]
        assert described["current"] == "1" and described["available"] == ["1", "2", "3", "4"]
        assert list(described["loaded"]) == ["1"]
    finally:
        await _stop(pipeline, swapper)


async def test_incompatible_contract_and_shared_executor_are_refused(repo: Path) -> None:
    meta_path = repo / "digits" / "2" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["preprocessing"]["scale"] = 1.0
    meta_path.write_text(json.dumps(meta))
    settings = _settings(repo)
    pipeline, _ = await _started(settings)
    try:
        with pytest.raises(ModelSwapError) as refused:
            await ModelSwapper(settings, lambda: pipeline).load("digits", "2")
        assert refused.value.reason == "incompatible_version" and refused.value.status == 409
        assert "its scale is 1.0 where version 1 has 0.0625" in str(refused.value)
        shared = Settings(**{**settings.model_dump(), "gpu_executor": "shared"})
        with pytest.raises(ModelSwapError) as no:
            await ModelSwapper(shared, lambda: pipeline).prepare("digits", "2")
        assert no.value.reason == "not_supported"
    finally:
        await _stop(pipeline)


async def test_keep_serves_pinned_requests_then_unload_returns_it(
    repo: Path, images: np.ndarray
) -> None:
    settings = _settings(repo)
    pipeline, sink = await _started(settings)
    swapper = ModelSwapper(settings, lambda: pipeline)
    v1 = pipeline.models["digits"]
    source = Source()

    def pinned(seq: int, version: str | None) -> Any:
        message = good(source, images[0], "dev-p", seq)
        body = json.loads(message.value or b"")
        if version is not None:
            body["model_version"] = version
        message.value = json.dumps(body).encode()
        return message

    try:
        await swapper.load("digits", "2", keep=True)
        assert sorted(pipeline.loaded["digits"]) == ["1", "2"]
        await pipeline.handle_many([pinned(0, "1"), pinned(1, None), pinned(2, "2")])
        await pipeline.batcher.drain()
        await swapper.unload("digits", "1")
        await swapper.wait_closed()
        assert v1.executor.engine.closed
        await pipeline.handle_many([pinned(3, "1"), pinned(4, "9\nFAKE")])
        await pipeline.batcher.drain()
    finally:
        await _stop(pipeline, swapper)
    results = {r["seq"]: r for r in (decode_result(s.value) for s in sink.sent
                                     if s.topic == settings.result_topic)}
    assert {s: r["model_version"] for s, r in results.items()} == {0: "1", 1: "2", 2: "2"}
    assert results[0]["outputs"]["top_k"][0]["label"] == "0"
    letter, odd = [decode_dead_letter(s.value) for s in sink.sent
                   if s.topic == settings.dlq_topic]
    assert letter.error["reason"] == odd.error["reason"] == "unknown_model_version"
    assert "streamapp models load digits --version 1 --keep" in letter.error["message"]
    # a version that is no number is quoted, never put raw into a command (a trial's newline
    # split the worker's log line)
    assert "\n" not in odd.error["message"] and "'9\\nFAKE'" in odd.error["message"]
    assert "versions are numbers" in odd.error["message"]


async def test_samples_check_and_contract() -> None:
    repo = ModelRepository()
    config = repo.get("digits")
    assert contract_difference(config, config) is None
    settings = Settings(backend="onnxruntime")
    model = load_version(settings, config)
    try:
        assert await check_samples(model) == len(config.metadata.get("samples", []))
        wrong = LoadedModel(
            config.__class__(**{**config.__dict__, "metadata": {**config.metadata, "samples": [
                {"tensor": load_digits().images[0].tolist(), "scores": [0.0] * 10,
                 "tolerance": 0.01}]}}), model.executor)
        with pytest.raises(ModelSwapError) as failed:
            await check_samples(wrong)
        assert failed.value.reason == "check_failed" and "within 0.01" in str(failed.value)
        bad = LoadedModel(
            config.__class__(**{**config.__dict__, "metadata": {**config.metadata, "samples": [
                {"tensor": [[1, 2]], "label": "0"}]}}), model.executor)
        with pytest.raises(ModelSwapError) as unusable:
            await check_samples(bad)
        assert unusable.value.reason == "bad_metadata" and "shape [8, 8]" in str(unusable.value)
    finally:
        await model.executor.close()
        model.executor.engine.close()


async def test_commit_records_current_for_a_restart(repo: Path) -> None:
    settings = _settings(repo)
    pipeline, _ = await _started(settings)
    swapper = ModelSwapper(settings, lambda: pipeline)
    try:
        await swapper.load("digits", "2")
    finally:
        await _stop(pipeline, swapper)
    assert (repo / "digits" / "current").read_text().strip() == "2"
    assert ModelRepository(repo).default_version("digits") == "2"
    (repo / "digits" / "current").write_text("7\n")  # gone: the highest serves
    assert ModelRepository(repo).default_version("digits") == "4"


# -- the TensorRT path, on the in-repo stand-ins (never met a real TensorRT) ----------------------



async def test_tensorrt_plans_swap_the_same_way(
    trt_standins: Any, tmp_path: Path, images: np.ndarray
) -> None:
    from engines.tensorrt.builder import build_plan

    repo = make_digits_versions(tmp_path / "models", versions=(1, 2))
    for version in ("1", "2"):
        folder = repo / "digits" / version
        build_plan(folder / "model.onnx", folder / "model.plan", max_batch=8)
        meta = json.loads((folder / "metadata.json").read_text())
        (folder / "metadata.json").write_text(json.dumps({**meta, "file": "model.plan"}))
    settings = _settings(repo, cuda_streams=2)
    settings = Settings(**{**settings.model_dump(), "backend": "tensorrt"})
    pipeline, sink = await _started(settings)
    swapper = ModelSwapper(settings, lambda: pipeline)
    v1 = pipeline.models["digits"]
    assert v1.info.backend == "tensorrt"
    source = Source()
    try:
        await pipeline.handle_many([good(source, images[i], "dev-t", i) for i in range(4)])
        await pipeline.batcher.drain()
        answer = await swapper.load("digits", "2")
        assert answer["samples_checked"] == 3 and answer["previous"] == "1"
        await pipeline.handle_many([good(source, images[i], "dev-t", 4 + i) for i in range(4)])
        await pipeline.batcher.drain()
        await swapper.wait_closed()
        assert v1.executor.engine.closed
        (swap,) = swapper.describe()["digits"]["swaps"]
        assert swap["unloaded"] == "1" and swap["device_memory_returned_bytes"] > 0
    finally:
        await _stop(pipeline, swapper)
    results = [decode_result(s.value) for s in sink.sent if s.topic == settings.result_topic]
    assert [r["model_version"] for r in results] == ["1"] * 4 + ["2"] * 4
    assert [r["outputs"]["top_k"][0]["label"] for r in results[4:]] == [V2_LABEL] * 4
    assert [r["outputs"]["top_k"][0]["label"] for r in results[:4]] == ["0", "1", "2", "3"]
    assert all(r["engine"].startswith("tensorrt-") for r in results)


async def test_reloading_a_kept_version_closes_the_kept_copy(repo: Path) -> None:
    settings = _settings(repo)
    pipeline, _ = await _started(settings)
    swapper = ModelSwapper(settings, lambda: pipeline)
    v1 = pipeline.models["digits"]
    try:
        await swapper.load("digits", "2", keep=True)  # 1 kept
        v2 = pipeline.models["digits"]
        await swapper.load("digits", "1", keep=True)  # a fresh 1 replaces the kept one; 2 kept
        await swapper.wait_closed()
        assert v1.executor.engine.closed and not v2.executor.engine.closed
        assert sorted(pipeline.loaded["digits"]) == ["1", "2"]
        assert pipeline.models["digits"] is pipeline.loaded["digits"]["1"] is not v1
        fresh = pipeline.models["digits"]
        await swapper.load("digits", "1")  # the same version again: reloaded from disk
        await swapper.unload("digits", "2")
        await swapper.wait_closed()
        assert fresh.executor.engine.closed and v2.executor.engine.closed
        assert list(pipeline.loaded["digits"]) == ["1"]
        with pytest.raises(ModelSwapError) as current:
            await swapper.unload("digits", "1")
        assert (current.value.reason, current.value.status) == ("version_serving", 409)
        assert str(current.value) == ("cannot unload digits v1: it is the version serving; load "
                                      "another version first (streamapp models load)")
        with pytest.raises(ModelSwapError) as gone:
            await swapper.unload("digits", "2")  # unloaded above
        assert (gone.value.reason, gone.value.status) == ("version_not_found", 404)
        assert str(gone.value) == "cannot unload digits v2: it is not loaded (loaded: 1)"
    finally:
        await _stop(pipeline, swapper)
