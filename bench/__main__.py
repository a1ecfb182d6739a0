"""``python -m bench run --profile cpu|smoke|gpu [--out DIR]`` and ``python -m bench backlog``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.report import format_report, write_plots
from bench.run import PROFILES, run_profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="ceilings, product, seeds' comparison, ratios")
    run.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    run.add_argument("--out", type=Path, default=Path("bench-results"))
    run.add_argument("--only", default="", help="comma-separated workloads to run")
    run.add_argument("--no-backlog", action="store_true", help="skip the backlog measurement")
    run.add_argument("--logs", type=Path, default=None,
                     help="worker/broker logs and raw profiles (default OUT/logs)")
    run.add_argument("--budget-s", type=float, default=None,
                     help="skip what no longer fits in this many seconds (hard time limits)")
    backlog = sub.add_parser("backlog", help="worker RSS with a backlog waiting in the topic")
    backlog.add_argument("--requests", type=int, default=1_000_000)
    backlog.add_argument("--seconds", type=float, default=45.0)
    backlog.add_argument("--out", type=Path, default=Path("bench-results/backlog"))
    report = sub.add_parser("report", help="print the report of a bench.json again")
    report.add_argument("json", type=Path)
    report.add_argument("--plots", type=Path, default=None, help="also redraw the PNGs here")
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(message, flush=True)

    if args.command == "report":
        results = json.loads(args.json.read_text())
        print(format_report(results))
        if args.plots is not None:
            args.plots.mkdir(parents=True, exist_ok=True)
            print("wrote", ", ".join(str(p) for p in write_plots(results, args.plots)))
        return 0
    if args.command == "run":
        profile = PROFILES[args.profile]
        only = tuple(w for w in args.only.split(",") if w)
        out = args.out
        backlog_flag = False if args.no_backlog else None
    else:
        profile = replace(PROFILES["cpu"], name="backlog", plans=(), backlog_n=args.requests,
                          backlog_s=args.seconds)
        only, out, backlog_flag = (), args.out, True
        args.logs = args.budget_s = None
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = run_profile(profile, out, only=only, backlog=backlog_flag, log=log,
                          logs=args.logs, budget_s=args.budget_s,
                          start_s=12.0 if profile.name == "gpu" else 7.0)
    report = format_report(results)
    (out / "report.txt").write_text(report + "\n")
    plots = write_plots(results, out)
    print(report)
    print(f"\nwrote {out / 'bench.json'}, {out / 'report.txt'}"
          + "".join(f", {p}" for p in plots)
          + f" in {time.monotonic() - started:.0f} s")
    failed = [n for n, w in results.get("workloads", {}).items() if "error" in w]
    if "error" in results.get("backlog", {}):
        failed.append("backlog")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
