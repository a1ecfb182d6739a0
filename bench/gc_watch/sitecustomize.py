"""Garbage collector pauses of every Python process started with this folder on PYTHONPATH
and ``BENCH_GC_WATCH`` set to a path prefix (issue 17: do collections pause the worker or the
benchmark at the p99 level?). Each process appends one JSON line every 5 s to
``PREFIX.<pid>.jsonl``: its argv, and per generation the collections, their wall time (total,
max; ms), the thread CPU time they took (ms), the objects they freed and the generation's
size when written. A measuring aid for the GPU host's benchmark
calls (bench/h200_direct.sh), not part of the product."""

import os

if os.environ.get("BENCH_GC_WATCH"):
    import gc
    import json
    import sys
    import threading
    import time

    _path = f"{os.environ['BENCH_GC_WATCH']}.{os.getpid()}.jsonl"
    _start: list[float] = [0.0, 0.0]
    _log: list[tuple[int, float, float, int]] = []

    def _timer(phase: str, info: dict) -> None:
        if phase == "start":
            _start[:] = [time.perf_counter(), time.thread_time()]
        else:
            _log.append((info["generation"], time.perf_counter() - _start[0],
                         time.thread_time() - _start[1], info["collected"]))

    def _dump() -> None:
        while True:
            time.sleep(5)
            items = list(_log)
            del _log[:len(items)]
            gens = {}
            for gen in (0, 1, 2):
                mine = [(w, c, k) for g, w, c, k in items if g == gen]
                if mine:
                    gens[gen] = {"n": len(mine), "wall_ms": round(1e3 * sum(m[0] for m in mine), 1),
                                 "max_ms": round(1e3 * max(m[0] for m in mine), 1),
                                 "cpu_ms": round(1e3 * sum(m[1] for m in mine), 1),
                                 "collected": sum(m[2] for m in mine),
                                 "size": len(gc.get_objects(gen))}
            with open(_path, "a") as f:
                f.write(json.dumps({"t": round(time.time(), 1), "argv": sys.argv[:3],
                                    "gc": gens, "frozen": gc.get_freeze_count()}) + "\n")

    gc.callbacks.append(_timer)
    threading.Thread(target=_dump, name="gc-watch", daemon=True).start()
