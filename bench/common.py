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

__all__ = ["engine_ceiling", "produce_backlog", "results_count"]


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
                   log: Callable[[str], None]) -> dict[str, Any]:
    """The backend alone at ``batch`` for ``seconds`` (``engines bench``'s raw mode).

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
    return out


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
