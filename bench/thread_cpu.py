"""``python -m bench.thread_cpu PATTERN``: CPU of every thread of the processes whose command
line contains PATTERN, per interval, from ``/proc/PID/task/TID/stat`` (Linux).

py-spy sees only Python frames; a thread that burns CPU in native code without Python on its
stack (OpenMP or BLAS workers spinning, a CUDA driver thread, RocksDB's background threads)
shows up here, by the name the thread gave itself. Prints one line per interval with the
threads above ``--min-pct`` % of one core, busiest first, until ``--seconds`` have passed.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

__all__ = ["sample", "thread_times"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_times(pid: int) -> dict[str, float]:
    """``{"name/tid": cpu seconds}`` of each thread of ``pid`` (empty if it is gone)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{name}/{task.name}"] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def _pids(pattern: str) -> list[int]:
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pattern in cmd and int(proc.name) != os.getpid():
            pids.append(int(proc.name))
    return pids


def sample(pattern: str, seconds: float, interval: float, min_pct: float) -> None:
    """Print the busy threads of the matching processes every ``interval`` s."""
    before: dict[int, dict[str, float]] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = {pid: thread_times(pid) for pid in _pids(pattern)}
        for pid, threads in now.items():
            old = before.get(pid)
            if old is None:
                continue
            busy = sorted(((100 * (t - old.get(k, t)) / interval, k)
                           for k, t in threads.items()), reverse=True)
            total = sum(p for p, _ in busy)
            shown = ", ".join(f"{k} {p:.0f}" for p, k in busy if p >= min_pct)
            print(f"{time.strftime('%H:%M:%S')} pid {pid}: {total:.0f} % in all; {shown}",
                  flush=True)
        before = now
        time.sleep(interval)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pattern")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--interval", type=float, default=4.0)
    parser.add_argument("--min-pct", type=float, default=3.0)
    args = parser.parse_args()
    sample(args.pattern, args.seconds, args.interval, args.min_pct)


if __name__ == "__main__":
    main()
