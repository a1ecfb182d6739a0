"""Decode ceilings for camera frames (GPU machine): what nvJPEG + PyTorch pre-processing, the
engine behind it, and Pillow on the CPU can do, without Kafka or Faust.

Prints one JSON line per measurement (images/s, median of ``--repeats`` timed runs of
``--duration-s`` each, CUDA synchronized at both ends):

- ``gpu_decode``: ``decode_jpeg(list of batch frames, device="cuda")`` alone;
- ``gpu_decode_preprocess``: decode + orientation/resize/normalize into a
  ``float16[batch, 3, 224, 224]`` buffer (:class:`engines.preprocess.gpu.GpuImageWriter`);
- ``gpu_path_resnet50``: ResNet-50 (torch backend, fp16, CUDA graphs) through the CUDA executor
  (2 streams × depth 2) with every item an :class:`EncodedImage` — the decode + engine ceiling;
- ``engine_only_resnet50``: the same with CPU-preprocessed float32 arrays (no decoding);
- ``cpu_pillow``: the CPU path (``ImageConfig.to_array``) on 1 thread and on ``--threads``.

Usage: ``python scripts/gpu_image_ceiling.py --frames .out/cam --model models-perf/resnet50.onnx``
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rate(fn: Any, per_call: int, duration_s: float, repeats: int, sync: Any = None) -> float:
    rates = []
    for _ in range(repeats):
        n = 0
        if sync:
            sync()
        start = time.perf_counter()
        while time.perf_counter() - start < duration_s:
            fn()
            n += per_call
        if sync:
            sync()
        rates.append(n / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=Path, default=Path(".out/cam"))
    parser.add_argument("--pattern", default="cam640_*.jpg")
    parser.add_argument("--model", type=Path, default=Path("models-perf/resnet50.onnx"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args()

    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    from bench.models import write_metadata
    from engines import load_engine
    from engines.executor.cuda import CudaExecutor
    from engines.preprocess import EncodedImage, inspect_jpeg
    from engines.preprocess.gpu import GpuImageWriter
    from streamapp.models import ModelRepository
    from streamapp.records import InferenceRequest

    datas = [p.read_bytes() for p in sorted(args.frames.glob(args.pattern))]
    frames = [EncodedImage.from_bytes(d, inspect_jpeg(d)) for d in datas]  # type: ignore[arg-type]
    batch = [frames[i % len(frames)] for i in range(args.batch)]
    size = f"{frames[0].info.width}x{frames[0].info.height}"
    kb = sum(len(d) for d in datas) / len(datas) / 1000
    common = {"frame": size, "mean_kB": round(kb, 1), "batch": args.batch,
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    sync = torch.cuda.synchronize

    def emit(name: str, rate: float, **extra: Any) -> None:
        print(json.dumps({"measure": name, "images_per_s": round(rate, 1), **common, **extra}),
              flush=True)

    tensors = [torch.from_numpy(f.data.copy()) for f in batch]
    for _ in range(3):
        decode_jpeg(tensors, mode=ImageReadMode.RGB, device="cuda")
    emit("gpu_decode", _rate(lambda: decode_jpeg(tensors, mode=ImageReadMode.RGB,
                                                   device="cuda"),
                             args.batch, args.duration_s, args.repeats, sync))

    repo = Path("/tmp/image-ceiling-repo/resnet50")
    repo.mkdir(parents=True, exist_ok=True)
    if not (repo / "model.onnx").exists():
        (repo / "model.onnx").symlink_to(args.model.resolve())
    write_metadata(repo, precision="fp16")
    config = ModelRepository(repo.parent).get("resnet50")
    spec = config.image_spec()
    assert spec is not None
    spec16 = type(spec)(**{**spec.__dict__, "dtype": "float16"})
    writer = GpuImageWriter(spec16, torch.device("cuda:0"))
    out = torch.empty((args.batch, 3, 224, 224), dtype=torch.float16, device="cuda:0")
    rows = list(enumerate(batch))
    writer.write(rows, out)
    emit("gpu_decode_preprocess", _rate(lambda: writer.write(rows, out), args.batch,
                                        args.duration_s, args.repeats, sync))

    def request(d: bytes) -> InferenceRequest:
        return InferenceRequest("r", "d", 0, 1.7e9, "resnet50", image=d)

    arrays = [config.preprocess(request(datas[i % len(datas)])) for i in range(args.batch)]
    with load_engine("torch", args.model, precision="fp16", max_batch_size=args.batch) as engine:
        assert engine.configure_images("input", spec) is None

        async def executor_rate(items: list[dict[str, Any]]) -> float:
            async with CudaExecutor(engine, streams=2, depth=2) as ex:
                for _ in range(4):
                    await ex.run(items)
                rates = []
                for _ in range(args.repeats):
                    n, start = 0, time.perf_counter()
                    pending: list[Any] = []
                    while time.perf_counter() - start < args.duration_s:
                        pending.append(await ex.submit(items))
                        n += len(items)
                        while len(pending) > ex.max_inflight:
                            await pending.pop(0)
                    for fut in pending:
                        await fut
                    rates.append(n / (time.perf_counter() - start))
                return statistics.median(rates)

        emit("gpu_path_resnet50", asyncio.run(executor_rate([{"input": f} for f in batch])),
             engine=engine.info.tag, precision="fp16")
        emit("engine_only_resnet50", asyncio.run(executor_rate([{"input": a} for a in arrays])),
             engine=engine.info.tag, precision="fp16")

    reqs = [request(datas[i % len(datas)]) for i in range(64)]
    emit("cpu_pillow", _rate(lambda: [config.preprocess(r) for r in reqs[:8]], 8,
                             args.duration_s, 1), threads=1)
    with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
        emit("cpu_pillow", _rate(lambda: list(pool.map(config.preprocess, reqs)), len(reqs),
                                 args.duration_s, 1), threads=args.threads)


if __name__ == "__main__":
    main()
