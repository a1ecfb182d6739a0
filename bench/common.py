"""Measurements that more than one section of the benchmark takes: the backlog producer, the
engine alone, the worker's own count of results.

``bench.run`` (the whole profile) and ``bench.scaleout`` (N workers) both import from here,
and ``bench.run`` imports ``bench.scaleout``, never the other way round.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from bench import load
from bench.workloads import Workload

__all__ = ["decode_infer_ceiling", "engine_ceiling", "produce_backlog", "results_count"]


async def produce_backlog(bootstrap: str, topic: str, wl: Workload, n: int,
                          options: Mapping[str, Any] | None = None) -> int:
    """Produce ``n`` requests of ``wl`` as fast as possible (``acks=1``, linger 20 ms, 1 MiB
    batches unless ``options`` say otherwise); returns the number of failed sends."""
    sender_opts = {"linger_ms": 20, "max_batch_size": 1 << 20, "acks": 1, **(options or {})}
    producer = load._producer(bootstrap, sender_opts)
    await producer.start()
    try:
        sender = load._Sender(producer, topic, wl.payload)
        now = time.time()
        for i in range(n):
            await sender.send(i, now)
        await sender.flush()
        return sender.failed
    finally:
        await producer.stop()


def engine_ceiling(wl: Workload, backend: str, batch: int, seconds: float,
                   log: Callable[[str], None], *, inflight: int = 4) -> dict[str, Any]:
    """The backend alone at ``batch`` for ``seconds`` (``engines bench``'s raw mode).

    For camera JPEGs (``resnet50-jpeg``) on a backend that decodes frames on its device,
    ``items_per_s`` is :func:`decode_infer_ceiling` (``mode`` ``decode + infer``, with
    ``inflight`` batches in flight) and the model alone moves to ``infer_items_per_s``.

    Returns:
        ``items_per_s``, ``batch_ms_p50`` (ms per batch), ``mode`` (``device`` when the
        backend timed the device alone, else ``infer``), the raw numbers and the engine's
        description; ``io_items_per_s`` / ``io_batch_ms_p50`` with host copies where timed.
    """
    from engines.bench import BenchConfig, run_bench
    from streamapp.models import ModelRepository

    config = ModelRepository(wl.models_dir).get(wl.model)
    cfg = BenchConfig(model=config.path, backend=backend, batch_sizes=(batch,),
                      duration_s=seconds, warmup_s=0.5, modes=("raw",),
                      timeline_batches=0, options=config.engine_options(backend))
    res = run_bench(cfg, log=lambda _m: None)
    raw = res["raw"][str(batch)]
    best = raw.get("device") or raw["infer"]
    out = {"batch": batch, "items_per_s": best["items_per_s"],
           "batch_ms_p50": best["p50_ms"], "mode": "device" if "device" in raw else "infer",
           "raw": raw, "engine": res["env"]["engine"]}
    if "io" in raw:
        out["io_items_per_s"] = raw["io"]["items_per_s"]
        out["io_batch_ms_p50"] = raw["io"]["p50_ms"]
    log(f"  engine ceiling: {out['items_per_s']:,.0f} items/s at batch {batch} "
        f"({out['batch_ms_p50']:.2f} ms/batch, {out['mode']})")
    if wl.name == "resnet50-jpeg":
        decoded = decode_infer_ceiling(wl, backend, batch, seconds, inflight=inflight)
        if decoded is not None:
            # The target's ceiling for camera frames is the engine-level decode + infer:
            # infer alone (inputs already on the GPU) is not what a frame costs the GPU.
            out.update(infer_items_per_s=out["items_per_s"], decode=decoded,
                       items_per_s=decoded["items_per_s"], mode="decode + infer")
            log(f"  engine ceiling with decoding: {decoded['items_per_s']:,.0f} images/s "
                f"(nvJPEG + pre-processing + the model, {decoded['executor']}; "
                f"{decoded['cpu_us_per_item']:.0f} µs CPU per image, GPU "
                f"{decoded['gpu_util_pct'] or 0:.0f} % busy)")
    return out


def decode_infer_ceiling(wl: Workload, backend: str, batch: int, seconds: float, *,
                         inflight: int = 4, streams: int = 2) -> dict[str, Any] | None:
    """Camera frames the way the executor server runs them, without Kafka or sockets: batches
    of ``batch`` :class:`~engines.preprocess.EncodedImage` frames of ``wl`` through the CUDA
    executor the worker settings build (``streams`` CUDA streams, ``inflight`` batches in
    flight), the engine decoding them (nvJPEG) before the model — the engine-level
    decode + infer ceiling of issue 17's camera-frame target.

    Returns:
        ``items_per_s`` (images/s over ``seconds``), ``cpu_us_per_item`` (this process's CPU
        time per image, µs), ``gpu_util_pct`` (NVML's, the mean after the first second; None
        where it cannot be read), ``executor``; None where ``backend`` does not decode frames on a
        device here (CPU, no torchvision).
    """
    import asyncio

    from bench.procs import Sampler
    from bench.workloads import camera_jpegs
    from engines.preprocess import EncodedImage, inspect_jpeg
    from streamapp.models import ModelRepository
    from streamapp.models.decoding import configure_engine_images
    from streamapp.models.loading import _make_executor
    from streamapp.settings import Settings

    config = ModelRepository(wl.models_dir).get(wl.model)
    settings = Settings(max_batch_size=batch, max_inflight_batches=inflight,
                        cuda_streams=streams)
    executor = _make_executor(backend, str(config.path), settings,
                              config.engine_options(backend))
    engine = executor.engine
    frames = [EncodedImage.from_bytes(j, inspect_jpeg(j))  # type: ignore[arg-type]
              for j in camera_jpegs()]
    items: list[Any] = [{config.input_name: frames[i % len(frames)]} for i in range(batch)]
    decodes = configure_engine_images(config, engine) is None

    async def measure() -> tuple[int, float, float]:
        """Warm up, then ``max_inflight`` clients run batches for ``seconds``; closes the
        executor either way. Returns (images, wall s, CPU s)."""
        try:
            if not decodes:
                return 0, 0.0, 0.0
            for _ in range(2 * executor.max_inflight):
                await executor.run(items)
            done, end = 0, time.perf_counter() + seconds
            cpu0, t0 = time.process_time(), time.perf_counter()

            async def client() -> None:
                nonlocal done
                while time.perf_counter() < end:
                    await executor.run(items)
                    done += len(items)

            await asyncio.gather(*(client() for _ in range(executor.max_inflight)))
            return done, time.perf_counter() - t0, time.process_time() - cpu0
        finally:
            await executor.close()

    try:
        with Sampler({}) as sampler:
            t0 = time.time()
            done, wall, cpu = asyncio.run(measure())
            gpu = sampler.summary(t0 + 1.0, time.time()).get("gpu_util_pct")
    finally:
        engine.close()
    if not decodes:
        return None
    return {"items_per_s": done / wall, "cpu_us_per_item": 1e6 * cpu / max(1, done),
            "gpu_util_pct": gpu,
            "executor": f"{streams} streams, {inflight} batches in flight, batch {batch}"}


#: The worker's results counter in its ``/metrics`` (one line per model and outcome).
RESULTS_METRIC = re.compile(
    rb'^streamapp_requests_total\{[^}]*outcome="result"[^}]*\}\s+([0-9.e+]+)', re.M)


def results_count(web_url: str, timeout_s: float = 10.0) -> int | None:
    """The worker's own count of results (its ``/metrics``); None when it does not answer
    within ``timeout_s`` seconds."""
    try:
        with urllib.request.urlopen(web_url + "/metrics", timeout=timeout_s) as r:
            body = r.read()
    except OSError:
        return None
    return int(sum(float(m) for m in RESULTS_METRIC.findall(body)))
