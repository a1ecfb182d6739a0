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
import resource
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
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


#: ``--workload`` → (model, request tensor dtype, shape).
WORKLOADS = {"digits": ("digits", "float32", [8, 8]),
             "resnet50-tensor": ("resnet50", "float16", [3, 224, 224])}


def _tensors(workload: str) -> list[bytes]:
    if workload == "digits":
        return [image.tobytes() for image in load_digits().images.astype(np.float32) / 16.0]
    # ImageNet-normalized values (the model's value range is -2.12 to 2.65)
    rng = np.random.default_rng(0)
    return [np.clip(rng.standard_normal((3, 224, 224)), -2.1, 2.6).astype(np.float16).tobytes()
            for _ in range(8)]


def _requests(devices: int, workload: str = "digits",
              ) -> Callable[[int, int], list[tuple[bytes, bytes]]]:
    """``make(first, count)``: the msgpack requests ``first .. first + count - 1``, made when
    they are handed over, as a consumer's fetch makes them, so that their memory is freed and
    reused as in a worker (900 MB of tensor requests made up front and kept changed where the
    worker's own arrays were allocated, and what that cost)."""
    model, dtype, shape = WORKLOADS[workload]
    tensors = _tensors(workload)

    def make(first: int, count: int) -> list[tuple[bytes, bytes]]:
        out = []
        for i in range(first, first + count):
            device = f"cam-{i % devices:04d}"
            value = msgpack.packb({
                "request_id": uuid.uuid4().hex, "device_id": device, "seq": i // devices,
                "ts": time.time(), "model": model,
                "tensor": {"dtype": dtype, "shape": shape, "data": tensors[i % len(tensors)]},
            })
            out.append((device.encode(), value))
        return out

    return make


def stand_in_resnet50(repo: Path) -> Path:
    """Write ``repo/resnet50``: ResNet-50's IO and metadata, a channel mean and a 3 × 1000
    matrix product for compute (ONNX, opset 17). Returns ``repo``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from bench.models import write_metadata

    folder = repo / "resnet50"
    folder.mkdir(parents=True, exist_ok=True)
    weights = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((3, 1000)).astype(np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["input"], ["mean"], axes=[2, 3], keepdims=0),
         helper.make_node("MatMul", ["mean", "W"], ["logits"])],
        "resnet50-io-stand-in",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 1000])],
        [weights])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(folder / "model.onnx"))
    write_metadata(folder, builder="bench.pipeline_cost (IO stand-in)")
    return repo


def _faults(who: int) -> int:
    return resource.getrusage(who).ru_minflt


async def run(n: int, devices: int, batch: int, state_flush_ms: float,
              chunk: int | None = None, workload: str = "digits") -> dict[str, float]:
    model = WORKLOADS[workload][0]
    with tempfile.TemporaryDirectory(prefix="pipeline-cost-") as tmp:
        extra: dict[str, object] = {}
        if model != "digits":
            extra = {"models_dir": stand_in_resnet50(Path(tmp)), "models": [model]}
        settings = Settings(max_batch_size=batch, max_batch_delay_ms=5.0,
                            state_flush_interval_ms=state_flush_ms, **extra)
        return await _run(settings, n, devices, batch, chunk, workload)


async def _run(settings: Settings, n: int, devices: int, batch: int, chunk: int | None,
               workload: str) -> dict[str, float]:
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

    make = _requests(devices, workload)
    make(0, 1)  # warm up the request maker
    topic = settings.request_topic
    faults = _faults(resource.RUSAGE_SELF)
    # what making the requests costs is subtracted: main-thread CPU and page faults
    making_cpu = making_faults = 0.0
    started, cpu = time.perf_counter(), time.process_time()
    step = chunk or batch
    for first in range(0, n, step):
        t0, f0 = time.thread_time(), _faults(resource.RUSAGE_THREAD)
        records = make(first, min(step, n - first))
        making_cpu += time.thread_time() - t0
        making_faults += _faults(resource.RUSAGE_THREAD) - f0
        messages = [SourceMessage(key=k, value=v, topic=topic, partition=0, offset=first + j,
                                  ack=ack)
                    for j, (k, v) in enumerate(records)]
        del records
        await pipeline.handle_many(messages)
        del messages
    await pipeline.batcher.drain()
    await pipeline.flush_state()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu - making_cpu
    faults = _faults(resource.RUSAGE_SELF) - faults - making_faults
    stats = pipeline.batcher.stats
    await pipeline.stop(drain=False)
    for model in models.values():
        await model.executor.close()
    assert acked == n, f"{acked} of {n} acked"
    # records/s includes the time the requests took to make (a few µs each for tensors)
    return {"records": n, "per_s": n / wall, "cpu_us_per_record": 1e6 * cpu / n,
            "page_faults_per_record": faults / n,
            "mean_batch": stats.items / max(stats.batches, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline_cost", description=__doc__)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="digits")
    parser.add_argument("--requests", type=int, default=None,
                        help="default: 50,000 digits or 3,000 tensors")
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
    requests = args.requests or (50_000 if args.workload == "digits" else 3_000)
    result = asyncio.run(run(requests, args.devices, args.batch, args.state_flush_ms,
                             args.chunk, args.workload))
    if profiler:
        profiler.disable()
        profiler.dump_stats(args.profile)
    print(f"pipeline alone (no Kafka), {args.workload} on onnxruntime, batch {args.batch}, "
          f"chunks of {args.chunk or args.batch}, "
          f"{args.devices} devices: {result['per_s']:,.0f} records/s, "
          f"{result['cpu_us_per_record']:.1f} µs CPU per record, "
          f"{result['page_faults_per_record']:.1f} minor page faults per record, mean batch "
          f"{result['mean_batch']:.1f}")


if __name__ == "__main__":
    main()
