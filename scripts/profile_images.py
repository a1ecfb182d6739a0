"""Where the worker's event loop spends its time on image requests (py-spy), on this machine.

Starts a fresh embedded broker and one ``streamapp worker`` (ONNX Runtime on the CPU), keeps a
closed loop of image requests outstanding (``bench.workloads``: ``digits-image``, 256×256 grey
PNGs, by default; ``resnet50-image`` is engine-bound on a small CPU machine), records the worker
with ``py-spy --threads`` for ``--seconds``, and prints one JSON object: results/s, the
event-loop thread's busy share, the share of its samples inside image decoding (Pillow,
``ImageConfig.to_array``), and the busy shares of the other threads (``image-decode_*`` is the
decode pool).

Run it on two trees to compare (``PYTHONPATH=<other tree> python scripts/profile_images.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def decode_share(raw: Path, ticks: int) -> dict[str, float]:
    """% of ticks the event-loop thread spent with Pillow or ``to_array`` on its stack."""
    main = decode = 0
    for line in raw.read_text(errors="replace").splitlines():
        m = re.match(r"^(?P<stack>.*) (?P<count>\d+)$", line.strip())
        if not m or not m["stack"].startswith("thread") or "MainThread" not in \
                m["stack"].split(";", 1)[0]:
            continue
        count = int(m["count"])
        main += count
        if "/PIL/" in m["stack"] or "to_array (" in m["stack"]:
            decode += count
    return {"main_busy_pct": round(100 * main / ticks, 1),
            "main_decoding_pct": round(100 * decode / ticks, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="digits-image")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup-s", type=float, default=8.0)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path(".out/profile"))
    args = parser.parse_args()

    import streamapp
    from bench import load
    from bench.models import ensure_resnet50
    from bench.procs import fresh_broker, profile_pid, start_worker
    from bench.profile import summarize
    from bench.workloads import result_parse, workload

    args.out.mkdir(parents=True, exist_ok=True)
    models_dir = ensure_resnet50().parent if args.workload.startswith("resnet50") else None
    wl = workload(args.workload, run="profile", models_dir=models_dir)
    small = wl.model == "digits"
    settings = {"backend": "onnxruntime", "models": wl.model,
                "max_batch_size": 32 if small else 4, "max_batch_delay_ms": 5.0 if small else 20.0,
                "max_inflight_batches": 2 if small else 1, "log_level": "warning"}
    if wl.models_dir is not None:
        settings["models_dir"] = wl.models_dir
    name = f"images-{Path(streamapp.__file__).parents[1].name}"
    with fresh_broker(args.out, name) as broker, \
            start_worker(broker, settings, args.out, name, partitions=4) as (proc, topics, _):
        assert proc.process is not None
        outcome_topics = [topics["result"], topics["dlq"]]
        asyncio.run(load.closed_loop(broker.bootstrap_servers, topics["request"],
                                     outcome_topics, wl.payload, result_parse,
                                     window=args.window, warmup_s=args.warmup_s, duration_s=1.0))
        raw = args.out / f"profile-{name}.txt"
        spy = profile_pid(proc.process.pid, args.seconds + 1, raw)
        res = asyncio.run(load.closed_loop(
            broker.bootstrap_servers, topics["request"], outcome_topics, wl.payload,
            result_parse, window=args.window, warmup_s=0.5, duration_s=args.seconds))
        spy.communicate(timeout=120)
    summary = summarize(raw, duration_s=args.seconds + 1)
    threads = Counter(summary["threads"])
    print(json.dumps({
        "tree": str(Path(streamapp.__file__).parents[1]),
        "workload": wl.name, "results_per_s": round(res["results_per_s"], 1),
        **decode_share(raw, summary["ticks"]),
        "main_by_group": summary["main_by_group"],
        "threads_busy_pct": dict(threads.most_common(8)),
        "main_top_self": dict(list(summary["main_top_self"].items())[:8]),
    }, indent=1))


if __name__ == "__main__":
    main()
