"""``python -m bench.thread_cpu PATTERN``: CPU of every thread of the processes whose command
line contains PATTERN, per interval, from ``/proc/PID/task/TID/stat`` (Linux).

py-spy sees only Python frames; a thread that burns CPU in native code without Python on its
stack (OpenMP or BLAS workers spinning, a CUDA driver thread, RocksDB's background threads)
shows up here, by the name the thread gave itself and its native id (the id py-spy prints), and
so does time in the kernel (system CPU: sockets, futexes). Prints one line per process and
interval: its user and system CPU (``/proc/PID/stat``: threads that ended during the interval
included), then the threads above ``--min-pct`` % of one core, busiest first, until
``--seconds`` have passed; percentages are over the time that passed between two samples.

Linux names most of a Python process's threads after the executable (``python``), so where
py-spy is installed each process's threads are also matched to their Python names with
``py-spy dump --nonblocking`` (its ``Thread TID (state): "name"`` lines): a thread shows as
``python/TID[Thread-2]``; ``[python]`` is a Python thread without a name; ``[native]`` one
that py-spy did not list in a dump taken at least one interval after the thread appeared (it
runs no Python); ``[?]`` one not known yet. ``--no-names`` leaves py-spy out.
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

__all__ = ["process_times", "python_thread_names", "sample", "thread_times"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(path: Path) -> tuple[str, float, float] | None:
    """``(name, user s, system s)`` from a ``/proc`` ``stat`` file (None if it is gone)."""
    try:
        stat = path.read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # fields[11], [12]: utime, stime
    return (stat[stat.index("(") + 1: stat.rindex(")")], int(fields[11]) / _TICK,
            int(fields[12]) / _TICK)


def process_times(pid: int) -> tuple[float, float] | None:
    """``(user s, system s)`` of ``pid`` from ``/proc/PID/stat``: every thread's, including
    threads that have ended (None if the process is gone)."""
    got = _stat(Path(f"/proc/{pid}/stat"))
    return None if got is None else (got[1], got[2])


def thread_times(pid: int) -> dict[str, tuple[float, float]]:
    """``{"name/tid": (user s, system s)}`` of each thread of ``pid`` (empty if it is gone)."""
    out: dict[str, tuple[float, float]] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        got = _stat(task / "stat")
        if got is not None:
            out[f"{got[0]}/{task.name}"] = got[1], got[2]
    return out


#: ``Thread TID (state): "name"``; a thread of a process that never imported ``threading``
#: (its main thread, usually) has no name.
_DUMP_THREAD = re.compile(r'^Thread (\d+) \([^)]*\)(?:: "(.*)")?\s*$', re.M)


def python_thread_names(pid: int, exe: str | None = None) -> dict[int, str] | None:
    """``{native tid: Python thread name}`` of ``pid`` from ``py-spy dump`` (``exe``, default:
    the one :func:`bench.procs.py_spy` finds; ``python`` for a thread without a name), or None
    when py-spy is missing or failed (no permission, not a Python process, gone, or its
    ``Failed to get stack traces`` on a busy process, about 1 dump in 40)."""
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
    return {int(tid): name or "python" for tid, name in _DUMP_THREAD.findall(out.stdout)}


class _Names:
    """One process's thread names from py-spy, asked again while a thread has none.

    A thread py-spy did not list is *native* (it runs no Python) only once a dump taken at
    least ``settle_s`` after the thread was first seen did not list it: a new thread is in
    ``/proc`` before Python registers it. A failed dump is tried again at the next sample,
    and after ``tries`` failures in a row the process is left unnamed (``note`` says so).
    """

    def __init__(self, pid: int, settle_s: float, tries: int = 3) -> None:
        self.pid, self.settle_s, self.tries = pid, settle_s, tries
        self.names: dict[int, str] = {}
        self.native: set[int] = set()
        self.first_seen: dict[int, float] = {}
        self.failures = 0
        self.given_up = False
        self.note = ""

    def update(self, tids: set[int], now: float) -> None:
        for tid in tids:
            self.first_seen.setdefault(tid, now)
        unknown = tids - self.names.keys() - self.native
        if self.given_up or not unknown:
            return
        dump = python_thread_names(self.pid)
        if dump is None:
            self.failures += 1
            if self.failures >= self.tries:
                self.given_up = True
                self.note = (f"py-spy could not read pid {self.pid}'s threads "
                             f"({self.failures} tries): its threads have no Python names")
            return
        self.failures = 0
        self.names.update(dump)
        self.native |= {tid for tid in unknown - dump.keys()
                        if now - self.first_seen[tid] >= self.settle_s}

    def label(self, key: str) -> str:
        """``name/tid[Python name]``, ``[native]``, or ``[?]`` while not known yet."""
        if self.given_up and not self.names:
            return key
        tid = int(key.rsplit("/", 1)[1])
        name = self.names.get(tid) or ("native" if tid in self.native else "?")
        return f"{key}[{name}]"


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
                and "bench.thread_cpu" not in cmd \
                and os.path.basename(argv[0].decode(errors="replace")) not in _WRAPPERS:
            pids.append(int(proc.name))
    return pids


def sample(pattern: str, seconds: float, interval: float, min_pct: float,
           names: bool = True) -> bool:
    """Print the busy threads of the matching processes every ``interval`` s (> 0) for
    ``seconds`` (at least one interval): the process's user and system CPU (% of one core),
    then each thread's user + system, named by py-spy where ``names`` and py-spy is found.
    Says when a process appears, ends, or ended before its first interval. Returns whether
    any process matched."""
    exe = py_spy() if names else None
    print(f"# processes whose command line holds {pattern!r}, every {interval:g} s for "
          f"{max(seconds, interval):g} s: user and system CPU from /proc in % of one core, "
          f"threads at or above {min_pct:g} %; "
          + (f"Python thread names from {exe} dump ([native]: runs no Python, [?]: not known "
             "yet)" if exe else "no py-spy: Linux thread names only"), flush=True)
    before: dict[int, dict[str, tuple[float, float]]] = {}
    totals: dict[int, tuple[float, float] | None] = {}
    naming: dict[int, _Names] = {}
    printed: set[int] = set()
    seen = False
    deadline = time.monotonic() + max(seconds, interval)
    taken = time.monotonic()
    while True:
        previous, taken = taken, time.monotonic()
        elapsed = max(taken - previous, 1e-9) if before else interval
        now = {pid: thread_times(pid) for pid in _pids(pattern)}
        now = {pid: threads for pid, threads in now.items() if threads}
        now_totals = {pid: process_times(pid) for pid in now}
        seen = seen or bool(now)
        for pid in before.keys() - now.keys():
            print(f"# pid {pid} ended" if pid in printed else
                  f"# pid {pid} matched but ended before its first {interval:g} s interval",
                  flush=True)
        for pid, threads in now.items():
            if exe is not None:
                name = naming.setdefault(pid, _Names(pid, settle_s=interval))
                had_note = bool(name.note)
                name.update({int(k.rsplit("/", 1)[1]) for k in threads}, time.monotonic())
                if name.note and not had_note:
                    print(f"# {name.note}", flush=True)
            old = before.get(pid)
            if old is None:
                continue
            user = sys_ = 0.0
            busy = []
            # by thread id: a thread that renamed itself (prctl) keeps its baseline
            old_by_tid = {k.rsplit("/", 1)[1]: v for k, v in old.items()}
            for k, (u, s) in threads.items():
                # a thread new in this interval: all of its time is in it
                u0, s0 = old_by_tid.get(k.rsplit("/", 1)[1], (0.0, 0.0))
                user, sys_ = user + u - u0, sys_ + s - s0
                busy.append((100 * (u - u0 + s - s0) / elapsed,
                             naming[pid].label(k) if exe is not None else k))
            t0, t1 = totals.get(pid), now_totals.get(pid)
            if t0 is not None and t1 is not None:  # with threads that ended meanwhile
                user, sys_ = t1[0] - t0[0], t1[1] - t0[1]
            busy.sort(reverse=True)
            shown = ", ".join(f"{k} {p:.0f}" for p, k in busy if p >= min_pct)
            print(f"{time.strftime('%H:%M:%S')} pid {pid}: user {100 * user / elapsed:.0f} "
                  f"% + system {100 * sys_ / elapsed:.0f} %" + (f"; {shown}" if shown else ""),
                  flush=True)
            printed.add(pid)
        before, totals = now, now_totals
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
    parser.add_argument("--no-names", action="store_true",
                        help="do not ask py-spy for the threads' Python names")
    args = parser.parse_args()
    if not 0.1 <= args.interval <= 3600:  # /proc counts 10 ms ticks; time.sleep's bound
        parser.error(f"--interval must be 0.1-3600 s, not {args.interval:g}")
    if not 0 <= args.min_pct < float("inf"):
        parser.error(f"--min-pct must be at least 0 and finite, not {args.min_pct:g}")
    if not 0 <= args.seconds < float("inf"):
        parser.error(f"--seconds must be at least 0 and finite, not {args.seconds:g}")
    if not args.pattern.strip():
        parser.error("PATTERN must not be empty (it would match every process)")
    if not sample(args.pattern, args.seconds, args.interval, args.min_pct,
                  names=not args.no_names):
        print(f"no process's command line holds {args.pattern!r} (launchers are left out: "
              f"{', '.join(sorted(_WRAPPERS))})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
