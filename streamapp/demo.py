"""``make demo``: the main job end to end on the embedded broker with the real digits model.

Starts Tansu and one worker (a child process), publishes all 1,797 digits from N devices, reads
every result back, compares each prediction with offline ONNX Runtime inference of the same model
on the same image, and prints a summary. Every process it started is stopped on exit.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamapp.broker import EmbeddedBroker
from streamapp.client import (
    Outcomes,
    collect_outcomes,
    digits_requests,
    load_digits_frames,
    publish,
)
from streamapp.codecs import CodecName
from streamapp.datadir import make_data_dir
from streamapp.kafka import create_topics
from streamapp.models import ModelRepository
from streamapp.process import WorkerProcess
from streamapp.settings import load_settings

__all__ = ["DemoSummary", "offline_predictions", "run_demo", "summarize"]


def offline_predictions(images: np.ndarray, model: str = "digits") -> np.ndarray:
    """Predicted label index per image from a plain onnxruntime session (no streamapp code path
    besides the model's documented pre-processing).

    Args:
        images: ``uint8[n, 8, 8]``.

    Returns:
        ``int64[n]``.
    """
    import onnxruntime as ort

    config = ModelRepository().get(model)
    x = images.astype(np.float32) * np.float32(config.scale) + np.float32(config.offset)
    x = x.reshape(len(images), *config.item_shape)
    session = ort.InferenceSession(str(config.path), providers=["CPUExecutionProvider"])
    (probs,) = session.run([config.output_name], {config.input_name: x})
    return np.argmax(probs, axis=1)


@dataclass
class DemoSummary:
    """The numbers the demo prints and checks."""

    sent: int
    results: int
    unique_results: int
    dead_letters: int
    heldout_accuracy: float
    all_accuracy: float
    agreement: float
    order_violations: int
    p50_ms: float
    p99_ms: float
    throughput_per_s: float
    batch_sizes: dict[int, int]

    def checks(self) -> list[tuple[str, bool]]:
        return [
            ("every frame answered", self.unique_results == self.sent),
            ("no dead letters", self.dead_letters == 0),
            ("held-out accuracy >= 0.95", self.heldout_accuracy >= 0.95),
            ("100 % agreement with offline ONNX Runtime", self.agreement == 1.0),
            ("0 per-device order violations", self.order_violations == 0),
        ]


def summarize(
    sent: list[Any], outcomes: Outcomes, labels: np.ndarray, offline: np.ndarray,
    heldout: set[int],
) -> DemoSummary:
    """Compute the demo's numbers from what was sent and read back."""
    by_id = {s.request_id: s for s in sent}
    first: dict[str, dict[str, Any]] = {}
    for r in outcomes.results:
        first.setdefault(r["request_id"], r)
    correct_all = correct_held = agree = 0
    latencies = []
    for request_id, r in first.items():
        s = by_id[request_id]
        predicted = int(r["outputs"]["top_k"][0]["label"])
        correct_all += predicted == labels[s.index]
        correct_held += s.index in heldout and predicted == labels[s.index]
        agree += predicted == offline[s.index]
        latencies.append((r["_received_at"] - s.ts) * 1000.0)
    violations = 0
    last_seq: dict[str, int] = {}
    for r in outcomes.results:  # topic order; one device is always on one partition
        device = r["device_id"]
        if device in last_seq and r["seq"] <= last_seq[device]:
            violations += 1
        last_seq[device] = r["seq"]
    answered_held = sum(1 for rid in first if by_id[rid].index in heldout)
    span = (
        max(r["_received_at"] for r in outcomes.results) - min(s.sent_at for s in sent)
        if outcomes.results else 0.0
    )
    sizes: dict[int, int] = {}
    for r in first.values():
        sizes[r["batch_size"]] = sizes.get(r["batch_size"], 0) + 1
    n = max(len(first), 1)
    return DemoSummary(
        sent=len(sent),
        results=len(outcomes.results),
        unique_results=len(first),
        dead_letters=len(outcomes.dead_letters),
        heldout_accuracy=correct_held / max(answered_held, 1),
        all_accuracy=correct_all / n,
        agreement=agree / n,
        order_violations=violations,
        p50_ms=float(np.percentile(latencies, 50)) if latencies else float("nan"),
        p99_ms=float(np.percentile(latencies, 99)) if latencies else float("nan"),
        throughput_per_s=len(first) / span if span > 0 else 0.0,
        batch_sizes=dict(sorted(sizes.items())),
    )


def _print_summary(summary: DemoSummary, heldout_n: int, devices: int, codec: str) -> bool:
    def row(name: str, value: str) -> None:
        print(f"  {name:<44} {value}")

    print(f"\nstreamapp demo: digits model, {devices} devices, {codec} requests")
    row("frames sent", f"{summary.sent}")
    row("results (unique)", f"{summary.results} ({summary.unique_results})")
    row("dead-letter records", f"{summary.dead_letters}")
    row(f"accuracy, held-out frames ({heldout_n})", f"{summary.heldout_accuracy:.4f}")
    row(f"accuracy, all frames ({summary.sent})", f"{summary.all_accuracy:.4f}")
    row("agreement with offline ONNX Runtime", f"{summary.agreement * 100:.2f} %")
    row("per-device order violations", f"{summary.order_violations}")
    row("end-to-end latency p50 / p99", f"{summary.p50_ms:.1f} ms / {summary.p99_ms:.1f} ms")
    row("throughput", f"{summary.throughput_per_s:.0f} frames/s")
    common = sorted(summary.batch_sizes.items(), key=lambda kv: -kv[1])[:5]
    row("most common batch sizes (size: frames)", ", ".join(f"{k}: {v}" for k, v in common))
    ok = True
    print()
    for name, passed in summary.checks():
        print(f"  [{'PASS' if passed else 'FAIL'}] {name}")
        ok &= passed
    return ok


def run_demo(
    *,
    devices: int = 16,
    codec: CodecName = "json",
    backend: str = "auto",
    workdir: Path | None = None,
    timeout_s: float = 120.0,
) -> bool:
    """Run the demo; print progress and the summary. Returns True when every check passed.

    Raises:
        StreamAppError: The broker or the worker could not be started.
    """
    tmp = Path(tempfile.mkdtemp(prefix="streamapp-demo-")) if workdir is None else workdir
    make_data_dir(tmp, "--workdir")
    app_id = f"demo-{uuid.uuid4().hex[:8]}"
    ok = False

    def on_sigterm(signum: int, frame: Any) -> None:
        # unwind through the with-blocks below so the broker and the worker are stopped too
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with EmbeddedBroker(log_path=tmp / "broker.log") as broker:
            print(f"broker   ready at {broker.bootstrap_servers} ({broker.startup_s:.2f} s)")
            settings = load_settings(broker=broker.url, app_id=app_id, backend=backend)
            create_topics(
                broker.bootstrap_servers,
                {t: settings.topic_partitions for t in settings.topics},
            )
            worker = WorkerProcess(
                {"broker": broker.url, "broker_kind": "embedded", "app_id": app_id,
                 "backend": backend, "data_dir": tmp / "data"},
                log_path=tmp / "worker.log",
            )
            with worker:
                waited = worker.wait_ready()
                _, ready = worker.get("/ready")
                engines = ", ".join(e["tag"] for e in ready["engines"].values())
                print(f"worker   ready in {waited:.1f} s ({engines}); log: {worker.log_path}")
                ok = _drive(broker.bootstrap_servers, settings, devices, codec, timeout_s)
                stopped = time.monotonic()
            print(f"worker   stopped ({time.monotonic() - stopped:.1f} s)")
        return ok
    finally:
        signal.signal(signal.SIGTERM, previous)
        if workdir is None and ok:
            shutil.rmtree(tmp, ignore_errors=True)
        elif workdir is None:
            print(f"logs kept in {tmp} (broker.log, worker.log)")


def _drive(
    bootstrap: str, settings: Any, devices: int, codec: CodecName, timeout_s: float
) -> bool:
    images, labels = load_digits_frames()
    meta = ModelRepository().get("digits").metadata
    heldout = set(meta["training"]["test_indices"])
    requests = digits_requests(images, devices=devices)
    ids = {r.request_id for _, r in requests}

    def done(o: Outcomes) -> bool:
        return len(o.result_ids() | o.dead_letter_ids()) >= len(ids)

    async def go() -> tuple[list[Any], Outcomes]:
        reader = asyncio.create_task(
            collect_outcomes(
                bootstrap, settings.result_topic, settings.dlq_topic, done=done,
                timeout_s=timeout_s, progress_total=len(ids),
            )
        )
        sent = await publish(bootstrap, settings.request_topic, requests, codec=codec)
        return sent, await reader

    sent, outcomes = asyncio.run(go())
    offline = offline_predictions(images)
    summary = summarize(sent, outcomes, labels, offline, heldout)
    return _print_summary(summary, len(heldout), devices, codec)
