"""CPU per record of the worker's own code, without Kafka: ``python -m bench.pipeline_cost``.

Drives :class:`~streamapp.agents.pipeline.InferencePipeline` in one process with the bundled
digits model on ONNX Runtime, the worker's observers (device state on in-memory tables, the
Prometheus metrics) and a sink that acknowledges every record at once, from ``--requests``
msgpack requests of 256 devices handed over in chunks of ``max_batch_size`` (as the agent's
``take_events`` does). Prints records/s and CPU µs per record (process time ÷ records): the part
of a digits result's cost that is streamapp's own (decode, batching, engine, encoding, state,
metrics), to hold beside the Faust agent's ~76–112 µs per record (issue 17). ``--profile FILE``
writes a cProfile of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
from sklearn.datasets import load_digits

from streamapp.agents.pipeline import InferencePipeline, SourceMessage
from streamapp.metrics import Metrics
from streamapp.models.loading import load_models
from streamapp.settings import Settings
from streamapp.tables.device_state import DeviceStateObserver
from streamapp.tables.memory import MemoryDeviceTables
from streamapp.tables.windows import WindowPlan


class _AckedSink:
    """Every record is acknowledged by the time ``send_many`` returns (no transport cost)."""

    def __init__(self) -> None:
        self.records = 0
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        self._done.set_result(None)

    async def send(self, topic: str, key: bytes | None, value: bytes) -> Any:
        self.records += 1
        return self._done

    async def send_many(self, records: Sequence[tuple[str, bytes | None, bytes]]) -> list[Any]:
        self.records += len(records)
        return [self._done] * len(records)


def _requests(n: int, devices: int) -> list[tuple[bytes, bytes]]:
    images = load_digits().images.astype(np.float32) / 16.0
    out = []
    for i in range(n):
        device = f"cam-{i % devices:04d}"
        value = msgpack.packb({
            "request_id": uuid.uuid4().hex, "device_id": device, "seq": i // devices,
            "ts": time.time(), "model": "digits",
            "tensor": {"dtype": "float32", "shape": [8, 8],
                       "data": images[i % len(images)].tobytes()},
        })
        out.append((device.encode(), value))
    return out


async def run(n: int, devices: int, batch: int, state_flush_ms: float,
              chunk: int | None = None) -> dict[str, float]:
    settings = Settings(max_batch_size=batch, max_batch_delay_ms=5.0,
                        state_flush_interval_ms=state_flush_ms)
    models = load_models(settings)
    plan = WindowPlan.from_settings(settings)
    observers = [
        DeviceStateObserver(MemoryDeviceTables(), plan, request_topic=settings.request_topic,
                            ewma_alpha=settings.latency_ewma_alpha),
        Metrics(settings.models, max_batch_size=batch),
    ]
    sink = _AckedSink()
    pipeline = InferencePipeline(settings, models, sink, worker="bench", observers=observers)
    await pipeline.start()
    acked = 0

    def ack() -> None:
        nonlocal acked
        acked += 1

    records = _requests(n, devices)
    topic = settings.request_topic
    started, cpu = time.perf_counter(), time.process_time()
    step = chunk or batch
    for first in range(0, n, step):
        messages = [SourceMessage(key=k, value=v, topic=topic, partition=0, offset=first + j,
                                  ack=ack)
                    for j, (k, v) in enumerate(records[first:first + step])]
        await pipeline.handle_many(messages)
    await pipeline.batcher.drain()
    await pipeline.flush_state()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    stats = pipeline.batcher.stats
    await pipeline.stop(drain=False)
    for model in models.values():
        await model.executor.close()
    assert acked == n, f"{acked} of {n} acked"
    return {"records": n, "per_s": n / wall, "cpu_us_per_record": 1e6 * cpu / n,
            "mean_batch": stats.items / max(stats.batches, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline_cost", description=__doc__)
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--devices", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--state-flush-ms", type=float, default=500.0)
    parser.add_argument("--chunk", type=int, default=None,
                        help="records handed over per call (default: --batch; the direct "
                        "intake hands over what one fetch brought of one partition)")
    parser.add_argument("--profile", default=None, help="write a cProfile here")
    args = parser.parse_args(argv)
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    result = asyncio.run(run(args.requests, args.devices, args.batch, args.state_flush_ms,
                             args.chunk))
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)
    print(f"pipeline alone (no Kafka), digits on onnxruntime, batch {args.batch}, chunks of "
          f"{args.chunk or args.batch}, "
          f"{args.devices} devices: {result['per_s']:,.0f} records/s, "
          f"{result['cpu_us_per_record']:.1f} µs CPU per record, mean batch "
          f"{result['mean_batch']:.1f}")


if __name__ == "__main__":
    main()
