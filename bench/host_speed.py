"""How fast this host runs Python on one core right now, and how much CPU it is losing.

The same GPU host kind gave a plain aiokafka relay 31,000 msg/s on one day and 100,000 on
another (issue 17, thirteenth and fourteenth sessions, NVIDIA H100 hosts alike in GPU, driver
and core count), and every CPU-bound figure moved with it. Benchmarks on such hosts are
compared only within one call; this line, written into ``env.txt`` first, says which kind of
host a call got.

Usage::

    python -m bench.host_speed [--seconds S]

Prints one line: the CPU model, the current clock of CPU 0 (MHz, from /proc/cpuinfo), a
single-core score (millions of pure-Python loop iterations per second, the median of five
timed runs), and the share of all cores that was busy, and stolen by the hypervisor
(``steal``, from ``psutil.cpu_times``), over ``S`` seconds (default 1).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import psutil

__all__ = ["cpu_model", "cpu_shares", "python_score"]

_LOOPS = 2_000_000


def python_score(runs: int = 5, loops: int = _LOOPS) -> float:
    """Millions of iterations a second of a plain ``for`` loop with an add, the median of
    ``runs`` timed runs of ``loops`` each (one core; the GIL holds it to one)."""
    rates = []
    for _ in range(runs):
        start = time.perf_counter()
        total = 0
        for i in range(loops):
            total += i
        rates.append(loops / (time.perf_counter() - start) / 1e6)
    return statistics.median(rates)


def cpu_shares(before: Any, after: Any) -> tuple[float, float]:
    """(busy %, steal %) of all cores between two ``psutil.cpu_times()`` readings; busy is
    what is neither idle nor iowait nor steal (``bench.hotpath``'s machine busy time counts
    steal as busy; here it is reported apart)."""
    def get(t: Any, name: str) -> float:
        return float(getattr(t, name, 0.0))  # iowait and steal exist on Linux only

    total = sum(after) - sum(before)
    if total <= 0:
        return 0.0, 0.0
    idle, iowait, steal = (get(after, n) - get(before, n) for n in ("idle", "iowait", "steal"))
    return (100.0 * (total - idle - iowait - steal) / total, 100.0 * steal / total)


def _model_and_mhz(cpuinfo: str) -> tuple[str, str]:
    model = mhz = "?"
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "?":
            model = value.strip()
        elif key.strip() == "cpu MHz" and mhz == "?":
            mhz = f"{float(value):.0f}"
    return model, mhz


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else ``platform.processor()`` (the one
    place the benchmark reads it: ``bench.run`` records it in every ``bench.json``)."""
    try:
        model = _model_and_mhz(Path("/proc/cpuinfo").read_text())[0]
    except OSError:
        model = "?"
    return model if model != "?" else platform.processor()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host_speed", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="how long to read the cores' busy and steal shares (0.1-60)")
    args = parser.parse_args(argv)
    if not 0.1 <= args.seconds <= 60:
        parser.error("--seconds must be between 0.1 and 60")
    try:
        model, mhz = _model_and_mhz(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux
        model, mhz = cpu_model() or "?", "?"
    before = psutil.cpu_times()
    time.sleep(args.seconds)
    busy, steal = cpu_shares(before, psutil.cpu_times())
    shares = f"cores busy {busy:.0f} %, steal {steal:.1f} % over {args.seconds:g} s"
    print(f"host speed: {model}, CPU 0 at {mhz} MHz; python {python_score():.1f} M loops/s "
          f"on one core; {shares}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
