"""Prometheus metrics: what outcomes and batches count, scrape-time gauges, and the docs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from streamapp.agents.observer import Outcome
from streamapp.batching import BatchInfo
from streamapp.metrics import METRIC_FAMILIES, GpuMonitor, Metrics, WorkerGauges

METRICS_DOC = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()


class NoGpu(GpuMonitor):
    def __init__(self) -> None:
        self._nvml = None
        self._handles = []


class FakeGpu(GpuMonitor):
    def __init__(self) -> None:
        self._nvml = object()
        self._handles = [("0", "NVIDIA H200", None)]

    def sample(self) -> list[tuple[str, str, float, int, int]]:
        return [("0", "NVIDIA H200", 0.42, 10 * 2**30, 141 * 2**30)]


def outcome(kind: str, model: str = "digits", reason: str | None = None) -> Outcome:
    ok = kind == "result"
    return Outcome(kind=kind,  # type: ignore[arg-type]
                   device_id="cam1", request_id="r", seq=0, model=model, reason=reason,
                   label="3" if ok else None, score=0.9 if ok else None,
                   e2e_ms=120.0 if ok else None, queue_ms=3.0 if ok else None,
                   infer_ms=1.5 if ok else None, attempt=0, ts=0.0, partition=0)


async def scrape(metrics: Metrics) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    text = (await metrics.render()).decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


async def test_outcomes_and_batches_are_counted() -> None:
    metrics = Metrics(["digits"], max_batch_size=32, gpu=NoGpu())
    for _ in range(5):
        metrics.on_outcome(outcome("result"))
    metrics.on_outcome(outcome("dead_letter", reason="bad_shape"))
    metrics.on_outcome(outcome("dead_letter", model="resnet-9000", reason="unknown_model"))
    metrics.on_outcome(outcome("retry", reason="engine_oom"))
    metrics.on_batch("digits", BatchInfo("b0", 5, "delay", 0.0, 0.001, 0.001, 0.002))
    await metrics.flush()
    s = await scrape(metrics)
    requests = s["streamapp_requests_total"]
    # final outcomes only: the retried request is not finished yet
    assert requests == {
        (("model", "digits"), ("outcome", "result")): 5,
        (("model", "digits"), ("outcome", "dead_letter")): 1,
        # request fields are untrusted: an unknown model name does not become a label value
        (("model", "unknown"), ("outcome", "dead_letter")): 1,
    }
    assert s["streamapp_dead_letters_total"][(("model", "digits"), ("reason", "bad_shape"))] == 1
    assert s["streamapp_retries_total"] == {(("model", "digits"), ("reason", "engine_oom")): 1}
    assert s["streamapp_batches_total"][(("closed_by", "delay"), ("model", "digits"))] == 1
    assert s["streamapp_batch_size_sum"][(("model", "digits"),)] == 5
    digits = (("model", "digits"),)
    # one family per duration, each observed once per answered request
    for family, seconds in (("streamapp_queue_duration_seconds", 0.003),
                            ("streamapp_inference_duration_seconds", 0.0015),
                            ("streamapp_e2e_duration_seconds", 0.120)):
        assert s[f"{family}_count"] == {digits: 5}
        assert s[f"{family}_sum"][digits] == pytest.approx(5 * seconds)
    e2e_buckets = s["streamapp_e2e_duration_seconds_bucket"]
    assert e2e_buckets[(("le", "0.1"), *digits)] == 0
    assert e2e_buckets[(("le", "0.2"), *digits)] == 5
    assert s["streamapp_queue_duration_seconds_bucket"][(("le", "0.005"), *digits)] == 5


async def test_gauges_are_refreshed_at_scrape_time_and_a_failing_refresher_is_contained() -> None:
    metrics = Metrics(["digits"], max_batch_size=8, gpu=FakeGpu())

    async def refresh(g: WorkerGauges) -> None:
        g.ready, g.inflight_batches, g.pending_requests = True, 2, 40
        g.lag = {("req", 0): 7, ("req", 1): 0}
        g.backlog = {("req", 0): 1_073, ("req", 1): 12}
        g.assigned = {"req": 2}
        g.engines = {"digits": {"backend": "tensorrt", "engine": "trt-10:ab12", "device": "cuda:0",
                                "precision": "fp16", "max_batch_size": 64}}

    def broken(g: WorkerGauges) -> None:
        raise RuntimeError("consumer not started")

    metrics.add_refresher(refresh)
    metrics.add_refresher(broken)
    s = await scrape(metrics)
    assert s["streamapp_ready"][()] == 1
    assert s["streamapp_inflight_batches"][()] == 2
    assert s["streamapp_consumer_lag"][(("partition", "0"), ("topic", "req"))] == 7
    assert s["streamapp_backlog_records"][(("partition", "0"), ("topic", "req"))] == 1_073
    assert s["streamapp_backlog_records"][(("partition", "1"), ("topic", "req"))] == 12
    assert s["streamapp_assigned_partitions"][(("topic", "req"),)] == 2
    (info_labels,) = s["streamapp_engine_info"]
    assert dict(info_labels)["precision"] == "fp16"
    gpu = (("gpu", "0"), ("name", "NVIDIA H200"))
    assert s["streamapp_gpu_utilization_ratio"][gpu] == 0.42
    assert s["streamapp_gpu_memory_total_bytes"][gpu] == 141 * 2**30


async def test_without_nvml_there_are_no_gpu_metrics() -> None:
    s = await scrape(Metrics(["digits"], max_batch_size=8, gpu=NoGpu()))
    assert not [name for name in s if name.startswith("streamapp_gpu")]


def test_registries_are_per_app() -> None:
    a = Metrics(["digits"], max_batch_size=8, gpu=NoGpu())
    b = Metrics(["digits"], max_batch_size=8, gpu=NoGpu())
    a.on_outcome(outcome("result"))
    assert a.requests.labels("digits", "result")._value.get() == 1
    assert b.requests.labels("digits", "result")._value.get() == 0


def _documented() -> set[str]:
    block = METRICS_DOC.split("<!-- metrics-reference:start -->")[1].split(
        "<!-- metrics-reference:end -->")[0]
    return set(re.findall(r"^\| `(streamapp_[a-z0-9_]+)` \|", block, re.M))


async def test_every_exported_family_is_documented_and_every_documented_one_exported() -> None:
    metrics = Metrics(["digits"], max_batch_size=8, gpu=FakeGpu(), process_metrics=False)

    async def refresh(g: WorkerGauges) -> None:
        g.lag = {("req", 0): 1}
        g.backlog = {("req", 0): 1}
        g.highwater = {("req", 0): 1}
        g.assigned = {"req": 1}
        g.engines = {"digits": {"backend": "onnxruntime"}}

    metrics.add_refresher(refresh)
    metrics.on_outcome(outcome("result"))
    text = (await metrics.render()).decode()
    exported: set[str] = set()
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):  # prometheus-client's creation timestamps
            continue
        types: dict[str, Any] = {"counter": "_total", "info": "_info"}
        exported.add(family.name + types.get(family.type, ""))
    assert exported == {name for name, *_ in METRIC_FAMILIES}
    assert _documented() == exported
