"""Where the worker's time goes: a summary of ``py-spy record --format raw --threads`` output.

py-spy samples every thread ``rate`` times a second and, without ``--idle``, keeps only the
samples in which a thread was running, so a thread's busy share is its samples over the ticks.
Each sample of the event-loop thread (``MainThread``) is attributed to the *innermost* frame
that belongs to a known package: a ``json.dumps`` called from ``streamapp`` counts as
``streamapp``, an ``asyncio`` callback that runs Faust code as ``faust``, and what remains in
``asyncio`` itself is the event loop's own overhead.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["GROUPS", "describe", "summarize"]

#: (group, path fragment), first match wins per frame.
GROUPS: tuple[tuple[str, str], ...] = (
    ("streamapp", "/streamapp/"),
    ("engines", "/engines/"),
    ("bench", "/bench/"),
    ("faust", "/faust/"),
    ("mode", "/mode/"),
    ("aiokafka", "/aiokafka/"),
    ("onnxruntime", "/onnxruntime/"),
    ("torch", "/torch/"),
    ("prometheus", "/prometheus_client/"),
    ("aiohttp", "/aiohttp/"),
    ("asyncio", "/asyncio/"),
)

_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _group(path: str) -> str | None:
    for name, fragment in GROUPS:
        if fragment in path:
            return name
    return None


def summarize(path: Path, rate: int = 100, duration_s: float | None = None) -> dict[str, Any]:
    """Summarize a raw py-spy file.

    Returns:
        ``threads``: samples per thread name; ``main_busy_pct``: the event-loop thread's busy
        share of the ticks; ``main_by_group``: % of ticks per innermost package;
        ``main_top_self``: the 15 leaf functions with most samples (% of ticks);
        ``ours_pct``: streamapp + engines share of the ticks.
    """
    threads: Counter[str] = Counter()
    by_group: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    by_ours_func: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        count = int(m["count"])
        frames = m["stack"].split(";")
        thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread") else "?"
        thread = re.sub(r"\s*\(.*$", "", thread) if thread.startswith("Thread-") else thread
        threads[thread] += count
        if thread != "MainThread":
            continue
        parsed = [_FRAME.match(f) for f in frames[1:]]
        group = "other"
        ours = None
        for fm in reversed(parsed):
            if fm is None:
                continue
            g = _group(fm["file"])
            if g is not None:
                group = g
                if g in ("streamapp", "engines"):
                    ours = f"{fm['func']} ({fm['file'].split(g + '/', 1)[-1]})"
                break
        by_group[group] += count
        if ours:
            by_ours_func[ours] += count
        leaf = parsed[-1] if parsed and parsed[-1] is not None else None
        if leaf is not None:
            short = "/".join(leaf["file"].split("/")[-2:])
            leaves[f"{leaf['func']} ({short})"] += count
    main = threads.get("MainThread", 0)
    # Ticks: the busiest thread cannot exceed one sample per tick; py-spy's own duration is the
    # better denominator when known.
    ticks = int(rate * duration_s) if duration_s else max(threads.values(), default=1)
    ticks = max(ticks, main, 1)

    def pct(c: int) -> float:
        return round(100.0 * c / ticks, 1)

    return {
        "ticks": ticks,
        "threads": {t: pct(c) for t, c in threads.most_common()},
        "main_busy_pct": pct(main),
        "main_by_group": {g: pct(c) for g, c in by_group.most_common()},
        "ours_pct": pct(by_group["streamapp"] + by_group["engines"]),
        "ours_top": {f: pct(c) for f, c in by_ours_func.most_common(12)},
        "main_top_self": {f: pct(c) for f, c in leaves.most_common(15)},
    }


def describe(summary: dict[str, Any], groups: int = 6, funcs: int = 4) -> str:
    """One log line of a :func:`summarize` result (or of its ``skipped``/``error``)."""
    if "main_busy_pct" not in summary:
        return summary.get("skipped") or f"py-spy failed: {summary.get('error', '?')}"
    line = (f"event-loop thread busy {summary['main_busy_pct']:.0f} %; "
            + ", ".join(f"{k} {v:.0f} %"
                        for k, v in list(summary["main_by_group"].items())[:groups]))
    top = list(summary.get("ours_top", {}).items())[:funcs]
    others = [f"{t} {v:.0f} %" for t, v in summary["threads"].items() if t != "MainThread"][:3]
    return (line + ("; ours: " + ", ".join(f"{f} {v:.1f} %" for f, v in top) if top else "")
            + ("; other threads: " + ", ".join(others) if others else ""))
