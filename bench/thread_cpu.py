"""``python -m bench.thread_cpu PATTERN``: CPU of every thread of the processes whose command
line contains PATTERN, per interval, from ``/proc/PID/task/TID/stat`` (Linux).

py-spy sees only Python frames; a thread that burns CPU in native code without Python on its
stack (OpenMP or BLAS workers spinning, a CUDA driver thread, RocksDB's background threads)
shows up here, by the name the thread gave itself and its native id (the id py-spy prints), and
so does time in the kernel (system CPU: sockets, futexes). Prints one line per process and
interval: its user and system CPU, then the threads above ``--min-pct`` % of one core,
busiest first, until ``--seconds`` have passed.

Linux names most of a Python process's threads after the executable (``python``), so where
py-spy is installed each process's threads are also matched to their Python names with
``py-spy dump --nonblocking`` (its ``Thread TID (state): "name"`` lines): a thread shows as
``python/TID[Thread-2]``, and one that py-spy does not list, which runs no Python, as
``python/TID[native]``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.procs import py_spy

__all__ = ["python_thread_names", "sample", "thread_times"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_times(pid: int) -> dict[str, tuple[float, float]]:
    """``{"name/tid": (user s, system s)}`` of each thread of ``pid`` (empty if it is gone)."""
    out: dict[str, tuple[float, float]] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # fields[11], [12]: utime, stime
        out[f"{name}/{task.name}"] = (int(fields[11]) / _TICK, int(fields[12]) / _TICK)
    return out


_DUMP_THREAD = re.compile(r'^Thread (\d+) \([^)]*\): "(.*)"', re.M)


def python_thread_names(pid: int, exe: str | None = None) -> dict[int, str] | None:
    """``{native tid: Python thread name}`` of ``pid`` from ``py-spy dump`` (``exe``, default:
    the one :func:`bench.procs.py_spy` finds), or None when py-spy is missing or failed (no
    permission, not a Python process, gone)."""
    exe = exe or py_spy()
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "dump", "--nonblocking", "--pid", str(pid)],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {int(tid): name for tid, name in _DUMP_THREAD.findall(out.stdout)}


def _label(key: str, names: dict[int, str] | None) -> str:
    """``name/tid`` with its Python name (``[native]`` when py-spy does not list it)."""
    if names is None:
        return key
    tid = int(key.rsplit("/", 1)[1])
    return f"{key}[{names.get(tid, 'native')}]"


#: Launchers whose command line holds the pattern of the process they start.
_WRAPPERS = {"timeout", "env", "bash", "sh", "nohup", "sudo", "time", "flock", "nice", "setsid"}


def _pids(pattern: str) -> list[int]:
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        cmd = b" ".join(argv).decode(errors="replace")
        if pattern in cmd and int(proc.name) != os.getpid() \
                and os.path.basename(argv[0].decode(errors="replace")) not in _WRAPPERS:
            pids.append(int(proc.name))
    return pids


def sample(pattern: str, seconds: float, interval: float, min_pct: float) -> bool:
    """Print the busy threads of the matching processes every ``interval`` s (> 0) for
    ``seconds`` (at least one interval): the process's user and system CPU (% of one core),
    then each thread's user + system. Returns whether any process matched."""
    before: dict[int, dict[str, tuple[float, float]]] = {}
    names: dict[int, dict[int, str] | None] = {}  # pid -> py-spy's names (None: none)
    asked: dict[int, set[int]] = {}  # pid -> the threads it had at py-spy's last dump
    seen = False
    deadline = time.monotonic() + max(seconds, interval)
    while True:
        now = {pid: thread_times(pid) for pid in _pids(pattern)}
        seen = seen or bool(now)
        for pid, threads in now.items():
            tids = {int(k.rsplit("/", 1)[1]) for k in threads}
            known = names.get(pid)
            # Ask py-spy again when a thread appeared that was not there at its last dump
            # (threads it did not list then run no Python: they stay native).
            if pid not in names or (known is not None and not tids <= asked[pid]):
                names[pid], asked[pid] = python_thread_names(pid), tids
            old = before.get(pid)
            if old is None:
                continue
            user = sys_ = 0.0
            busy = []
            for k, (u, s) in threads.items():
                u0, s0 = old.get(k, (u, s))
                user, sys_ = user + u - u0, sys_ + s - s0
                busy.append((100 * (u - u0 + s - s0) / interval, _label(k, names[pid])))
            busy.sort(reverse=True)
            shown = ", ".join(f"{k} {p:.0f}" for p, k in busy if p >= min_pct)
            print(f"{time.strftime('%H:%M:%S')} pid {pid}: user {100 * user / interval:.0f} "
                  f"% + system {100 * sys_ / interval:.0f} %; {shown}", flush=True)
        before = now
        if time.monotonic() >= deadline:
            return seen
        time.sleep(interval)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.thread_cpu",
        description="CPU of every thread of the processes whose command line holds PATTERN, "
        "user and system, per interval (from /proc; Linux).")
    parser.add_argument("pattern", help="a substring of the command line, e.g. "
                        "'streamapp worker'")
    parser.add_argument("--seconds", type=float, default=120.0,
                        help="how long to sample (s, default 120)")
    parser.add_argument("--interval", type=float, default=4.0,
                        help="seconds between samples (default 4)")
    parser.add_argument("--min-pct", type=float, default=3.0,
                        help="show threads at or above this %% of one core (default 3)")
    args = parser.parse_args()
    if not args.interval > 0:
        parser.error(f"--interval must be above 0 s, not {args.interval:g}")
    if not sample(args.pattern, args.seconds, args.interval, args.min_pct):
        print(f"no process's command line holds {args.pattern!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
