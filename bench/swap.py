"""The cost of a hot swap, in one process: ``python -m bench.swap``.

Drives :class:`~streamapp.agents.pipeline.InferencePipeline` at a steady rate from 16 devices
(no Kafka: a sink that acknowledges at once and stamps each result) and swaps versions with
:class:`~streamapp.models.swap.ModelSwapper` every ``--every-s`` seconds, alternating between
two versions. Prints JSON: per swap the load time (prepare: load + warm-up + samples), the
longest gap between two results while it ran and for ``--settle-s`` after, the p99 latency
(read → produced) in that window, the device memory returned by closing the old version
(``cudaMemGetInfo``, null on a CPU), and the same gap and p99 outside the swaps as the baseline.

Default: the bundled digits on ONNX Runtime, versions 1 and 2 copied into a temporary repository.
On a GPU (what the issue asks to measure there)::

    python -m bench.swap --backend torch --models-dir DIR --model resnet50 --versions 1,2

where ``DIR/resnet50/1/`` and ``DIR/resnet50/2/`` hold the model (``bench/models.py`` builds
one). Requests carry a constant tensor of the model's request shape and first dtype (the low
end of its ``request.value_range``, else 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from streamapp.agents.pipeline import InferencePipeline, SourceMessage
from streamapp.codecs import encode_request
from streamapp.models import BUNDLED_MODELS_DIR, ModelRepository
from streamapp.models.loading import load_version
from streamapp.models.swap import ModelSwapper, close_model
from streamapp.records import InferenceRequest, TensorPayload
from streamapp.settings import Settings

DEVICES = 16


class _StampingSink:
    """Acknowledges at once; remembers when each record was handed over."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    async def send(self, topic: str, key: bytes | None, value: bytes) -> asyncio.Future[None]:
        self.stamps.append(time.perf_counter())
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


def _repository(args: argparse.Namespace) -> Path:
    if args.models_dir is not None:
        return Path(args.models_dir)
    root = Path(tempfile.mkdtemp(prefix="bench-swap-"))
    for version in args.versions:
        shutil.copytree(BUNDLED_MODELS_DIR / "digits", root / "digits" / version)
    return root


def _value(config: Any, device: int, seq: int) -> bytes:
    dtype = sorted(config.request_dtypes)[0]
    fill = config.value_range[0] if config.value_range is not None else 0
    array = np.full(config.request_shape, fill, dtype=dtype)
    return encode_request(InferenceRequest(
        f"d{device}-{seq}", f"d{device}", seq, time.time(), config.name,
        tensor=TensorPayload(dtype, tuple(array.shape), array.tobytes())), "msgpack")


def _window(stamps: np.ndarray, latencies: np.ndarray, start: float, end: float
            ) -> dict[str, float | None]:
    inside = (stamps >= start) & (stamps <= end)
    got = stamps[inside]
    return {
        "results": int(got.size),
        "max_gap_ms": round(float(np.diff(got).max()) * 1e3, 2) if got.size > 1 else None,
        "p99_ms": round(float(np.percentile(latencies[inside], 99)) * 1e3, 2)
        if got.size else None,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    root = _repository(args)
    settings = Settings(models_dir=root, backend=args.backend, topic_prefix="",
                        max_batch_size=args.max_batch_size, max_batch_delay_ms=2.0,
                        max_inflight_batches=2, state_flush_interval_ms=0)
    config = ModelRepository(root).get(args.model, args.versions[0])
    sink = _StampingSink()
    pipeline = InferencePipeline(settings, {args.model: load_version(settings, config)}, sink,
                                 worker="bench")
    await pipeline.start()
    swapper = ModelSwapper(settings, lambda: pipeline)
    # one tensor per device, a request id per request: two requests of one device in one batch
    # with the same id would be duplicate_request_id dead letters, not engine work
    base = [_value(config, d, 0) for d in range(DEVICES)]
    value = [msgpack.unpackb(b, raw=False) for b in base]
    read_at: list[float] = []
    stop = asyncio.Event()

    async def traffic() -> None:
        interval = DEVICES / args.rate
        offset, next_at = 0, time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            messages = []
            for d in range(DEVICES):
                offset += 1
                body = {**value[d], "request_id": f"d{d}-{offset}", "seq": offset}
                messages.append(SourceMessage(f"d{d}".encode(),
                                              msgpack.packb(body, use_bin_type=True), "bench", d,
                                              offset, ack=lambda: None))
                read_at.append(now)
            await pipeline.handle_many(messages)
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))

    feeder = asyncio.create_task(traffic())
    swaps: list[dict[str, Any]] = []
    started = time.perf_counter()
    try:
        for n in range(args.swaps):
            await asyncio.sleep(args.every_s)
            version = args.versions[(n + 1) % len(args.versions)]
            t0 = time.perf_counter()
            answer = await swapper.load(args.model, version)
            swaps.append({"version": version, "called": t0, "returned": time.perf_counter(),
                          "load_ms": answer["load_ms"]})
        await asyncio.sleep(args.every_s)
    finally:
        stop.set()
        await feeder
        await pipeline.batcher.drain()
        await swapper.wait_closed()
        await pipeline.stop()
        for model in pipeline.loaded[args.model].values():
            await close_model(model)
    stamps = np.asarray(sink.stamps)
    latencies = stamps - np.asarray(read_at[: len(stamps)])  # one outcome per read, in order
    history = swapper.history.get(args.model, [])
    out_swaps = []
    for swap, record in zip(swaps, history, strict=False):
        window = _window(stamps, latencies, swap["called"], swap["returned"] + args.settle_s)
        out_swaps.append({"version": swap["version"], "load_ms": swap["load_ms"],
                          "command_ms": round((swap["returned"] - swap["called"]) * 1e3, 1),
                          "device_memory_returned_bytes":
                              record.get("device_memory_returned_bytes"), **window})
    quiet = np.ones(stamps.size, dtype=bool)
    for swap in swaps:
        quiet &= ~((stamps >= swap["called"]) & (stamps <= swap["returned"] + args.settle_s))
    # from the first settle window on: the start (first batches, thread pools) is no swap's cost
    baseline = _window(stamps[quiet], latencies[quiet], started + args.settle_s, float("inf"))
    return {"backend": args.backend, "model": args.model, "rate_per_s": args.rate,
            "engine": pipeline.models[args.model].info.tag, "results": int(stamps.size),
            "baseline": baseline, "swaps": out_swaps}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.swap", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--backend", default="onnxruntime")
    parser.add_argument("--models-dir", default=None, help="Repository with the versions "
                        "(default: digits 1 and 2 copied into a temporary folder).")
    parser.add_argument("--model", default="digits")
    parser.add_argument("--versions", default="1,2", type=lambda s: s.split(","))
    parser.add_argument("--rate", type=float, default=1000.0, help="Requests per second.")
    parser.add_argument("--swaps", type=int, default=4)
    parser.add_argument("--every-s", type=float, default=1.5)
    parser.add_argument("--settle-s", type=float, default=0.5)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--out", default=None, help="Also write the JSON here.")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
