"""``engines bench``: throughput and latency of a model on a backend, five ways, in one run.

- **raw** (the ceiling, no executor): the backend alone. For a stream-capable (GPU) backend,
  ``raw_device`` enqueues the model back to back on one stream with the input already on the GPU
  (two batches queued at a time): the compute ceiling; ``raw_io`` adds the pinned H2D/D2H copies
  and waits for each batch (no overlap). For a CPU backend, ``engine.infer`` in a loop.
- **executor**: fixed batches of N items handed straight to the executor (packing from separate
  item arrays, N streams, ``max_inflight`` batches in flight): what the executor costs.
- **sync**: one request at a time on one stream, waiting for each (batch 1).
- **async**: batch-1 requests, ``max_inflight`` in flight on N streams.
- **batched**: single-item requests from closed-loop clients, grouped by a micro-batcher (size
  cap, time window from the first request) into dynamic batches on N streams.

Throughput is items/s over the measured window; latency is per request (per batch for raw and
executor), ms, p50/p99. With a GPU executor, a CUDA-event timeline of a few batches shows whether
the H2D copy of batch k+1 overlaps the compute of batch k. Results go to ``bench.json`` and plots
to ``bench.png`` / ``timeline.png`` (needs matplotlib: the ``bench`` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from engines.base import Engine, StreamEngine
from engines.exceptions import InputSpecError
from engines.executor.base import Executor, Item
from engines.registry import load_engine

__all__ = ["BenchConfig", "format_results", "run_bench", "write_plots"]

Log = Callable[[str], None]


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    Attributes:
        model: Model file for the backend (``.onnx``, ``.plan``).
        backend: Registry name or ``"auto"``.
        batch_sizes: Batch sizes for raw, executor and batched modes; the largest sets the
            engine's max batch.
        streams: CUDA streams (or threads for a CPU backend).
        depth: Batches in flight per stream.
        duration_s: Measured seconds per mode and batch size.
        warmup_s: Unmeasured seconds before each measurement (after explicit warm-up batches).
        max_delay_ms: Batched mode's window: a batch closes this long after its first request.
        timeline_batches: Batches in the CUDA-event timeline (0: none).
        options: Backend options (e.g. ``{"precision": "fp16"}``).
        modes: Which modes to run.
        seed: Seed of the random inputs.
    """

    model: Path
    backend: str = "auto"
    batch_sizes: tuple[int, ...] = (1, 8, 32, 64)
    streams: int = 2
    depth: int = 2
    duration_s: float = 3.0
    warmup_s: float = 0.5
    max_delay_ms: float = 2.0
    timeline_batches: int = 8
    options: Mapping[str, Any] = field(default_factory=dict)
    modes: tuple[str, ...] = ("raw", "executor", "sync", "async", "batched")
    seed: int = 0


def _summary(latencies_s: Sequence[float], items: int, window_s: float) -> dict[str, Any]:
    lat = np.asarray(latencies_s, dtype=np.float64) * 1000.0
    return {
        "items_per_s": items / window_s if window_s > 0 else 0.0,
        "items": items,
        "window_s": round(window_s, 3),
        "requests": int(lat.size),
        "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
        "mean_ms": float(lat.mean()) if lat.size else None,
    }


def _make_items(engine: Engine, count: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(count):
        item = {}
        for spec in engine.inputs:
            if any(d < 0 for d in spec.item_shape):
                raise InputSpecError(
                    f"cannot benchmark input {spec.name!r} {list(spec.shape)}: dynamic item dims"
                )
            if spec.dtype.kind == "f":
                item[spec.name] = rng.standard_normal(spec.item_shape).astype(spec.dtype)
            else:
                item[spec.name] = np.zeros(spec.item_shape, dtype=spec.dtype)
        items.append(item)
    return items


def _stack(items: Sequence[Item], engine: Engine) -> dict[str, np.ndarray]:
    return {s.name: np.stack([item[s.name] for item in items]) for s in engine.inputs}


def _is_gpu(engine: Engine) -> bool:
    if not isinstance(engine, StreamEngine):
        return False
    from engines import cuda

    return cuda.is_available()


def _make_executor(
    engine: Engine, *, streams: int, depth: int, max_batch: int, timeline: bool = False
) -> Executor:
    if _is_gpu(engine):
        from engines.executor.cuda import CudaExecutor

        assert isinstance(engine, StreamEngine)
        return CudaExecutor(
            engine, streams=streams, depth=depth, max_batch=max_batch, record_timeline=timeline
        )
    from engines.executor.thread import ThreadExecutor

    return ThreadExecutor(engine, max_inflight=streams * depth)


async def _closed_loop(
    clients: int,
    request: Callable[[int], Awaitable[int]],
    warmup_s: float,
    duration_s: float,
) -> dict[str, Any]:
    """``clients`` loops calling ``request(client) -> items``; measures the window after
    ``warmup_s``: items completed in it, latency of requests started in it."""
    now = time.perf_counter
    start = now() + warmup_s
    end = start + duration_s
    latencies: list[float] = []
    done_items = 0

    async def client(index: int) -> None:
        nonlocal done_items
        while now() < end:
            t0 = now()
            n = await request(index)
            t1 = now()
            if start <= t1 <= end:
                done_items += n
            if t0 >= start and t1 <= end:
                latencies.append(t1 - t0)

    await asyncio.gather(*(client(i) for i in range(clients)))
    return _summary(latencies, done_items, end - start)


# ----------------------------------------------------------------------------------------------
# modes


def _raw(
    engine: Engine,
    items: list[dict[str, np.ndarray]],
    batch: int,
    cfg: BenchConfig,
) -> dict[str, Any]:
    feeds = _stack(items[:batch], engine)
    if not _is_gpu(engine):
        for _ in range(3):
            engine.infer(feeds)
        lat, end = [], time.perf_counter() + cfg.duration_s
        start = time.perf_counter()
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            engine.infer(feeds)
            lat.append(time.perf_counter() - t0)
        window = time.perf_counter() - start
        return {"infer": _summary(lat, len(lat) * batch, window)}

    from engines import cuda
    from engines.cuda.runner import StreamRunner, enqueue_batch

    assert isinstance(engine, StreamEngine)
    out: dict[str, Any] = {}
    with StreamRunner(engine, max_batch=batch) as runner:
        assert runner.host_io and runner.device_io and runner.context
        for _ in range(5):  # warm-up: graph capture, cuDNN autotuning
            runner.run(feeds)
        stream, ctx = runner.stream, runner.context
        # raw_io: H2D + compute + D2H from pinned memory, waiting for each batch.
        lat = []
        start = time.perf_counter()
        end = start + cfg.duration_s / 2
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            enqueue_batch(engine, ctx, stream, runner.host_io, runner.device_io, batch)
            stream.synchronize()
            lat.append(time.perf_counter() - t0)
        out["io"] = _summary(lat, len(lat) * batch, time.perf_counter() - start)
        # raw_device: compute only, input resident on the GPU, two batches queued.
        with cuda.Event() as ev_a, cuda.Event() as ev_b:
            events = (ev_a, ev_b)
            warm_end = time.perf_counter() + cfg.warmup_s
            iters, marks = 0, []
            start = time.perf_counter()
            end = warm_end + cfg.duration_s
            measured_from = None
            counted = 0
            while True:
                ctx.enqueue(batch)
                events[iters % 2].record(stream)
                if iters >= 1:
                    events[(iters - 1) % 2].synchronize()
                    t = time.perf_counter()
                    if t >= warm_end:
                        if measured_from is None:
                            measured_from = t
                        else:
                            counted += 1
                            marks.append(t)
                    if t >= end:
                        break
                iters += 1
            stream.synchronize()
        per_batch = np.diff(marks) if len(marks) > 1 else np.asarray([])
        window = (marks[-1] - measured_from) if marks and measured_from else 0.0
        out["device"] = _summary(per_batch.tolist(), counted * batch, window)
    return out


async def _executor_mode(
    engine: Engine, items: list[dict[str, np.ndarray]], batch: int, cfg: BenchConfig
) -> dict[str, Any]:
    ex = _make_executor(engine, streams=cfg.streams, depth=cfg.depth, max_batch=batch)
    try:
        batches = [items[i : i + batch] for i in range(0, len(items) - batch + 1, batch)] or [
            items[:batch]
        ]
        cursor = itertools.cycle(range(len(batches)))
        await asyncio.gather(*(ex.run(batches[next(cursor)]) for _ in range(2 * ex.max_inflight)))

        async def request(_: int) -> int:
            await ex.run(batches[next(cursor)])
            return batch

        return await _closed_loop(ex.max_inflight, request, cfg.warmup_s, cfg.duration_s)
    finally:
        await ex.close()


async def _single_mode(
    engine: Engine,
    items: list[dict[str, np.ndarray]],
    *,
    streams: int,
    depth: int,
    cfg: BenchConfig,
) -> dict[str, Any]:
    ex = _make_executor(engine, streams=streams, depth=depth, max_batch=1)
    try:
        cursor = itertools.cycle(items)
        await asyncio.gather(*(ex.run([next(cursor)]) for _ in range(2 * ex.max_inflight)))

        async def request(_: int) -> int:
            await ex.run([next(cursor)])
            return 1

        return await _closed_loop(ex.max_inflight, request, cfg.warmup_s, cfg.duration_s)
    finally:
        await ex.close()


async def _batched_mode(
    engine: Engine, items: list[dict[str, np.ndarray]], max_batch: int, cfg: BenchConfig
) -> dict[str, Any]:
    ex = _make_executor(engine, streams=cfg.streams, depth=cfg.depth, max_batch=max_batch)
    loop = asyncio.get_running_loop()
    requests: asyncio.Queue[tuple[Item, asyncio.Future[None]]] = asyncio.Queue()
    sizes: list[int] = []
    delay = cfg.max_delay_ms / 1000.0

    async def start(batch: list[Item]) -> asyncio.Future[dict[str, np.ndarray]]:
        submit = getattr(ex, "submit", None)
        if submit is not None:
            return await submit(batch)  # type: ignore[no-any-return]
        return asyncio.ensure_future(ex.run(batch))

    async def batcher() -> None:
        while True:
            first = await requests.get()
            batch = [first]
            deadline = loop.time() + delay
            while len(batch) < max_batch:
                try:
                    batch.append(requests.get_nowait())
                    continue
                except asyncio.QueueEmpty:
                    pass
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    async with asyncio.timeout(remaining):  # not wait_for (CPython gh-86296)
                        batch.append(await requests.get())
                except TimeoutError:
                    break
            sizes.append(len(batch))
            fut = await start([item for item, _ in batch])
            waiters = [w for _, w in batch]

            def deliver(
                f: asyncio.Future[Any], waiters: list[asyncio.Future[None]] = waiters
            ) -> None:
                for w in waiters:
                    if w.done():
                        continue
                    if f.exception() is not None:
                        w.set_exception(f.exception())  # type: ignore[arg-type]
                    else:
                        w.set_result(None)

            fut.add_done_callback(deliver)

    task = asyncio.create_task(batcher())
    try:
        cursor = itertools.cycle(items)

        async def request(_: int) -> int:
            waiter: asyncio.Future[None] = loop.create_future()
            requests.put_nowait((next(cursor), waiter))
            await waiter
            return 1

        # Warm-up: full batches on every stream (CUDA-graph capture per lane).
        clients = max_batch * (ex.max_inflight + 1)
        await asyncio.gather(*(request(i) for i in range(clients)))
        sizes.clear()
        result = await _closed_loop(clients, request, cfg.warmup_s, cfg.duration_s)
        result["mean_batch"] = float(np.mean(sizes)) if sizes else None
        result["clients"] = clients
        return result
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await ex.close()


async def _timeline(
    engine: Engine, items: list[dict[str, np.ndarray]], batch: int, cfg: BenchConfig
) -> dict[str, Any] | None:
    if not _is_gpu(engine) or cfg.timeline_batches <= 0:
        return None
    from engines.executor.cuda import CudaExecutor, overlap_report

    ex = _make_executor(
        engine, streams=cfg.streams, depth=cfg.depth, max_batch=batch, timeline=True
    )
    assert isinstance(ex, CudaExecutor)
    try:
        batches = [items[:batch]] * cfg.timeline_batches
        async for _ in ex.map(batches):  # warm-up: capture graphs on every lane
            pass
        ex.timeline.clear()
        async for _ in ex.map(batches):
            pass
        entries = sorted(ex.timeline, key=lambda e: e.batch)
        t0 = min(e.h2d[0] for e in entries)
        rebased = [
            {
                "batch": e.batch - entries[0].batch,
                "stream": e.stream,
                "size": e.size,
                "h2d_ms": [round(v - t0, 4) for v in e.h2d],
                "compute_ms": [round(v - t0, 4) for v in e.compute],
                "d2h_ms": [round(v - t0, 4) for v in e.d2h],
            }
            for e in entries
        ]
        report = overlap_report(rebased)
        report["entries"] = rebased
        report["batch_size"] = batch
        return report
    finally:
        await ex.close()


# ----------------------------------------------------------------------------------------------


def _environment(engine: Engine) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "engine": {k: v for k, v in asdict(engine.info).items() if k != "extra"}
        | {"extra": {k: str(v) for k, v in engine.info.extra.items()}},
    }
    if _is_gpu(engine):
        from engines import cuda

        info = cuda.device_info()
        env["gpu"] = {
            "name": info.name,
            "compute_capability": info.sm,
            "memory_gib": round(info.total_memory_bytes / 2**30, 1),
        }
        env["cuda"] = cuda.versions()
    if "torch" in sys.modules:
        env["torch"] = str(sys.modules["torch"].__version__)
    return env


async def _run_async(cfg: BenchConfig, engine: Engine, log: Log) -> dict[str, Any]:
    sizes = sorted(set(cfg.batch_sizes))
    items = _make_items(engine, max(2 * max(sizes), 64), cfg.seed)
    results: dict[str, Any] = {"raw": {}, "executor": {}, "batched": {}}
    for b in sizes:
        if "raw" in cfg.modes:
            log(f"raw loop, batch {b} ...")
            results["raw"][str(b)] = _raw(engine, items, b, cfg)
        if "executor" in cfg.modes:
            log(f"executor, batch {b}, {cfg.streams} streams ...")
            results["executor"][str(b)] = await _executor_mode(engine, items, b, cfg)
        if "batched" in cfg.modes:
            log(f"batched (dynamic, max {b}), {cfg.streams} streams ...")
            results["batched"][str(b)] = await _batched_mode(engine, items, b, cfg)
    if "sync" in cfg.modes:
        log("sync (batch 1, one stream, one at a time) ...")
        results["sync"] = await _single_mode(engine, items, streams=1, depth=1, cfg=cfg)
    if "async" in cfg.modes:
        log(f"async (batch 1, {cfg.streams} streams) ...")
        results["async"] = await _single_mode(
            engine, items, streams=cfg.streams, depth=cfg.depth, cfg=cfg
        )
    timeline = await _timeline(engine, items, max(sizes), cfg)
    if timeline is not None:
        log("timeline recorded")
        results["timeline"] = timeline
    results["checks"] = _checks(results, max(sizes), timeline)
    return results


def _raw_ceiling(raw: Mapping[str, Any]) -> float | None:
    for key in ("device", "infer"):
        if key in raw:
            return float(raw[key]["items_per_s"])
    return None


def _checks(
    results: Mapping[str, Any], top: int, timeline: Mapping[str, Any] | None
) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    raw = results["raw"].get(str(top))
    executor = results["executor"].get(str(top))
    if raw and executor:
        ceiling = _raw_ceiling(raw)
        if ceiling:
            checks["executor_over_raw"] = executor["items_per_s"] / ceiling
        if "io" in raw and raw["io"]["items_per_s"]:
            checks["executor_over_raw_io"] = executor["items_per_s"] / raw["io"]["items_per_s"]
    batched = results["batched"].get(str(top))
    if batched and results.get("sync"):
        checks["batched_over_sync"] = batched["items_per_s"] / results["sync"]["items_per_s"]
    if timeline is not None:
        checks["h2d_overlaps_compute"] = timeline["h2d_overlaps_compute"]
        checks["overlapping_pairs"] = f"{timeline['overlapping_pairs']}/{timeline['total_pairs']}"
    checks["batch_size"] = top
    return checks


def run_bench(cfg: BenchConfig, *, log: Log = print) -> dict[str, Any]:
    """Load the model, run every mode, return everything (see the module docstring).

    Raises:
        EngineError: Loading or running failed.
    """
    options = dict(cfg.options)
    options.setdefault("max_batch_size", max(cfg.batch_sizes))
    engine = load_engine(cfg.backend, cfg.model, **options)
    try:
        results = asyncio.run(_run_async(cfg, engine, log))
        results["env"] = _environment(engine)
        results["config"] = {
            k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()
        }
        results["config"]["options"] = dict(cfg.options)
        return results
    finally:
        engine.close()


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_results(results: Mapping[str, Any]) -> str:
    """The table ``engines bench`` prints."""
    env = results.get("env", {})
    eng = env.get("engine", {})
    lines = [
        f"model {eng.get('model_path')}  backend {eng.get('backend')} {eng.get('version')}  "
        f"precision {eng.get('precision')}  device {eng.get('device')}",
        f"{'mode':<22}{'batch':>6}{'items/s':>12}{'p50 ms':>10}{'p99 ms':>10}",
    ]

    def row(name: str, batch: Any, s: Mapping[str, Any]) -> None:
        lines.append(
            f"{name:<22}{batch!s:>6}{_fmt(s['items_per_s'], ',.0f'):>12}"
            f"{_fmt(s['p50_ms'], '.3f'):>10}{_fmt(s['p99_ms'], '.3f'):>10}"
        )

    for b, raw in results.get("raw", {}).items():
        for key, s in raw.items():
            row(f"raw_{key}", b, s)
    for b, s in results.get("executor", {}).items():
        row("executor", b, s)
    for b, s in results.get("batched", {}).items():
        row(f"batched (mean {_fmt(s.get('mean_batch'), '.1f')})", b, s)
    if "sync" in results:
        row("sync", 1, results["sync"])
    if "async" in results:
        row("async", 1, results["async"])
    checks = results.get("checks", {})
    if checks:
        lines.append(
            "checks: "
            + ", ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in checks.items()
            )
        )
    return "\n".join(lines)


def write_plots(results: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """``bench.png`` (throughput by mode and batch) and ``timeline.png``; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, series in (
        ("raw (ceiling)", {b: _raw_ceiling(r) for b, r in results.get("raw", {}).items()}),
        ("executor", {b: s["items_per_s"] for b, s in results.get("executor", {}).items()}),
        ("batched", {b: s["items_per_s"] for b, s in results.get("batched", {}).items()}),
    ):
        if series:
            xs = sorted(series, key=int)
            ys = [float(series[x] or 0.0) for x in xs]
            ax.plot([int(x) for x in xs], ys, marker="o", label=label)
    for label in ("sync", "async"):
        if label in results:
            ax.axhline(
                results[label]["items_per_s"],
                linestyle="--",
                label=f"{label} (batch 1)",
                color="grey" if label == "sync" else "black",
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("items/s")
    eng = results.get("env", {}).get("engine", {})
    gpu = results.get("env", {}).get("gpu", {}).get("name", "")
    ax.set_title(
        f"{Path(str(eng.get('model_path', ''))).name} {eng.get('backend')} "
        f"{eng.get('precision')} {gpu}"
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / "bench.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    timeline = results.get("timeline")
    if timeline and timeline.get("entries"):
        fig, ax = plt.subplots(figsize=(10, 3))
        colors = {"h2d_ms": "tab:blue", "compute_ms": "tab:orange", "d2h_ms": "tab:green"}
        for e in timeline["entries"]:
            for key, color in colors.items():
                a, b = e[key]
                ax.broken_barh([(a, max(b - a, 1e-3))], (e["stream"] - 0.4, 0.8), color=color)
            ax.text(e["compute_ms"][0], e["stream"], str(e["batch"]), va="center", fontsize=7)
        ax.set_yticks(sorted({e["stream"] for e in timeline["entries"]}))
        ax.set_ylabel("stream")
        ax.set_xlabel("ms (CUDA events)")
        ax.set_title(
            f"batch {timeline['batch_size']}: H2D (blue), compute (orange), D2H (green)"
            f"; H2D of k+1 overlaps compute of k (GPU order) in "
            f"{timeline['overlapping_pairs']}/{timeline['total_pairs']} pairs"
        )
        fig.tight_layout()
        path = out_dir / "timeline.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def save(results: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Write ``bench.json`` and the plots into ``out_dir``; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return [path, *write_plots(results, out_dir)]
