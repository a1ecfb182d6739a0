"""``python -m bench run --profile cpu|smoke|gpu [--out DIR]``, ``python -m bench scaleout``,
``python -m bench backlog``, ``python -m bench hotpath`` and ``python -m bench security``."""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.hotpath import RUNGS, HotpathConfig, format_hotpath, run_hotpath
from bench.isolation import SCENARIOS, format_isolation, run_isolation
from bench.procs import BrokerKind
from bench.report import format_report, write_plots
from bench.run import PROFILES, environment, run_profile
from bench.scaleout import LAUNCHERS, SCALE_PROFILES, run_scaleout


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
    run.add_argument("--no-scaleout", action="store_true", help="skip the scale-out section")
    run.add_argument("--profile-open-loop", action="store_true",
                     help="py-spy on the worker during the open loop at the p99 level (70 %%)")
    run.add_argument("--broker", choices=("embedded", "kafka", "both"), default=None,
                     help="measure on the embedded broker, on Apache Kafka (its section only: "
                     "ceilings, perf-tool anchor, product) or both (the default; the Kafka "
                     "section is skipped with one line where there is no Java)")
    run.add_argument("--launcher", choices=LAUNCHERS, default="own",
                     help="how the scale-out starts N workers: N processes started here "
                     "(own) or one 'streamapp worker --processes N' (processes)")
    scale = sub.add_parser("scaleout", help="only the scale-out section: N workers, ceilings")
    scale.add_argument("--profile", choices=sorted(SCALE_PROFILES), default="cpu")
    scale.add_argument("--out", type=Path, default=None,
                       help="default bench-results/scaleout-PROFILE")
    scale.add_argument("--logs", type=Path, default=None, help="default OUT/logs")
    scale.add_argument("--launcher", choices=LAUNCHERS, default="own")
    scale.add_argument("--ns", default="", help="comma-separated worker counts (override)")
    scale.add_argument("--only", default="", help="comma-separated workloads to run")
    scale.add_argument("--backend", default=None,
                       help="override the workers' backend (e.g. onnxruntime: the GPU "
                       "profile's logic on CPU)")
    scale.add_argument("--budget-s", type=float, default=None,
                       help="skip steps that no longer fit in this many seconds")
    scale.add_argument("--broker", choices=("embedded", "kafka"), default="embedded",
                       help="a fresh embedded broker or a fresh Apache Kafka per measurement")
    scale.add_argument("--gpu-executor", choices=("inprocess", "shared"), default="inprocess",
                       help="shared: one executor server per GPU merges the workers' batches "
                       "(implies --launcher processes; docs/scaleout.md)")
    scale.add_argument("--profile-procs", default="",
                       help="comma-separated processes to py-spy under closed-loop load after "
                       "each drain: w0, w1, ..., gpu-server0 (issue 17)")
    scale.add_argument("--profile-s", type=float, default=8.0, help="seconds of that profile")
    scale.add_argument("--no-mps", action="store_true", help="leave out the CUDA MPS steps")
    scale.add_argument("--ceilings", default=None,
                       help="comma-separated ceilings to measure (aiokafka, faust; empty: "
                       "none; default: each workload's own)")
    scale.add_argument("--dry-run", action="store_true",
                       help="print the steps, their estimates and what the budget skips")
    backlog = sub.add_parser("backlog", help="worker RSS with a backlog waiting in the topic")
    backlog.add_argument("--requests", type=int, default=1_000_000)
    backlog.add_argument("--seconds", type=float, default=45.0)
    backlog.add_argument("--out", type=Path, default=Path("bench-results/backlog"))
    hot = sub.add_parser("hotpath", help="the worker against the best Faust agent, CPU per "
                         "record draining one backlog (issue 17)")
    hot.add_argument("--requests", type=int, default=30_000, help="backlog K per rung")
    hot.add_argument("--broker", choices=("kafka", "embedded"), default="kafka")
    hot.add_argument("--rungs", default=",".join(RUNGS),
                     help=f"comma-separated, of {', '.join(RUNGS)}")
    hot.add_argument("--uvloop", action="store_true", help="the yardstick on uvloop")
    hot.add_argument("--yardstick-batch", type=int, default=None, metavar="N",
                     help="the yardstick's take_events bound (default: the worker's "
                     "max_batch_size)")
    hot.add_argument("--out", type=Path, default=Path("bench-results/hotpath"))
    hot.add_argument("--logs", type=Path, default=None, help="default OUT/logs")
    hot.add_argument("--worker-env", action="append", default=[], metavar="KEY=VAL",
                     help="environment of the worker (repeatable), e.g. "
                     "STREAMAPP_MAX_BATCH_SIZE=128")
    hot.add_argument("--profile-s", type=float, default=0.0, metavar="S",
                     help="py-spy on each rung for S seconds of its drain (needs py-spy)")
    hot.add_argument("--profile-after-s", type=float, default=8.0, metavar="S",
                     help="start that profile S seconds after the rung's launch")
    hot.add_argument("--rate", type=float, default=None, metavar="R",
                     help="instead of a backlog: send the requests at R/s while each rung "
                     "runs (after a warm-up), the CPU per record below saturation")
    hot.add_argument("--warmup", type=int, default=2_000, metavar="N",
                     help="with --rate: requests drained before the paced ones")
    hot.add_argument("--partitions", type=int, default=32, metavar="P",
                     help="partitions of every topic (the GPU p99 step: 8)")
    hot.add_argument("--devices", type=int, default=256, metavar="D",
                     help="distinct device keys of the requests (the GPU p99 step: 16)")
    iso = sub.add_parser("isolation", help="inference latency with and without a web flood "
                         "or a failing stream, side by side in one run (issue 19)")
    iso.add_argument("--scenarios", default=",".join(SCENARIOS),
                     help=f"comma-separated, of {', '.join(SCENARIOS)}")
    iso.add_argument("--seconds", type=float, default=20.0, help="measured seconds per phase")
    iso.add_argument("--out", type=Path, default=Path("bench-results/isolation"))
    iso.add_argument("--logs", type=Path, default=None, help="default OUT/logs")
    secured = sub.add_parser("security", help="SASL_SSL against PLAINTEXT on Apache Kafka, "
                             "side by side (transport and one worker)")
    secured.add_argument("--out", type=Path, default=Path("bench-results/security.json"))
    secured.add_argument("--requests", type=int, default=3000)
    secured.add_argument("--records", type=int, default=50_000)
    secured.add_argument("--rounds", type=int, default=2)
    report = sub.add_parser("report", help="print the report of a bench.json again")
    report.add_argument("json", type=Path)
    report.add_argument("--plots", type=Path, default=None, help="also redraw the PNGs here")
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(message, flush=True)

    if args.command == "security":
        from bench.security import SecurityConfig
        from bench.security import main as security_main

        return security_main(args.out, SecurityConfig(
            requests=args.requests, records=args.records, rounds=args.rounds))
    if args.command == "report":
        results = json.loads(args.json.read_text())
        print(format_report(results))
        if args.plots is not None:
            args.plots.mkdir(parents=True, exist_ok=True)
            print("wrote", ", ".join(str(p) for p in write_plots(results, args.plots)))
        return 0
    if args.command == "scaleout":
        return _scaleout(args, log)
    if args.command == "hotpath":
        return _hotpath(args, parser, log)
    if args.command == "isolation":
        scenarios = tuple(s for s in args.scenarios.split(",") if s)
        if not scenarios or any(s not in SCENARIOS for s in scenarios):
            parser.error(f"--scenarios: use {', '.join(SCENARIOS)}")
        results = run_isolation(args.out, scenarios=scenarios, seconds=args.seconds, log=log,
                                logs=args.logs)
        print(format_isolation(results))
        return 1 if any("error" in r for r in results["scenarios"].values()) else 0
    if args.command == "run":
        profile = PROFILES[args.profile]
        only = tuple(w for w in args.only.split(",") if w)
        out = args.out
        backlog_flag = False if args.no_backlog else None
    else:
        profile = replace(PROFILES["cpu"], name="backlog", plans=(), backlog_n=args.requests,
                          backlog_s=args.seconds, brokers=("embedded",))
        only, out, backlog_flag = (), args.out, True
        args.logs = args.budget_s = args.broker = None
        args.no_scaleout, args.launcher = True, "own"
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = run_profile(profile, out, only=only, backlog=backlog_flag, log=log,
                          logs=args.logs, budget_s=args.budget_s,
                          start_s=12.0 if profile.name == "gpu" else 7.0,
                          scaleout=not args.no_scaleout, launcher=args.launcher,
                          brokers=_brokers(args.broker),
                          profile_open_loop=getattr(args, "profile_open_loop", False))
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
    failed += results.get("scaleout", {}).get("failed", [])
    failed += [f"{n} on Apache Kafka" for n, w in
               results.get("apache_kafka", {}).get("workloads", {}).items() if "error" in w]
    return 1 if failed else 0


#: Longest paced window ``bench hotpath --rate`` accepts (s): --requests / --rate.
_MAX_PACED_S = 3_600


def _hotpath(args: argparse.Namespace, parser: argparse.ArgumentParser,
             log: Callable[[str], None]) -> int:
    """``python -m bench hotpath``: 1 when a rung failed or did not drain its backlog."""
    rungs = tuple(r for r in args.rungs.split(",") if r)
    unknown = [r for r in rungs if r not in RUNGS]
    if unknown or not rungs:
        parser.error(f"--rungs: unknown {', '.join(unknown) or '(none given)'}; "
                     f"use {', '.join(RUNGS)}")
    if args.requests < 1:
        parser.error(f"--requests {args.requests}: must be at least 1")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: must be at least 0")
    if args.rate is not None and not 0 < args.rate < math.inf:  # nan fails this too
        parser.error(f"--rate {args.rate:g}: must be a finite number above 0 records/s")
    if args.rate is not None and args.requests / args.rate > _MAX_PACED_S:
        parser.error(f"--rate {args.rate:g}: {args.requests:,} requests would take "
                     f"{args.requests / args.rate:,.0f} s; at most {_MAX_PACED_S:,} s "
                     f"(raise the rate or lower --requests)")
    if not 1 <= args.partitions <= 1024:
        parser.error(f"--partitions {args.partitions}: must be 1-1024")
    if not 1 <= args.devices <= 1_000_000:
        parser.error(f"--devices {args.devices}: must be 1-1,000,000")
    if args.uvloop:
        try:
            import uvloop  # noqa: F401
        except ImportError:
            parser.error("--uvloop: uvloop is not installed (pip install -e '.[bench]')")
    env = {}
    for item in args.worker_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--worker-env {item!r}: expected KEY=VAL")
        env[key] = value
    config = HotpathConfig(requests=args.requests, broker=args.broker, rungs=rungs,
                           uvloop=args.uvloop, worker_env=env,
                           yardstick_batch=args.yardstick_batch, profile_s=args.profile_s,
                           profile_after_s=args.profile_after_s, rate=args.rate,
                           warmup=args.warmup, partitions=args.partitions,
                           devices=args.devices)
    # SIGTERM (an outer `timeout`) unwinds like Ctrl-C: the broker and the child are stopped
    # and what was measured is already written.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(128 + signal.SIGTERM))
    started = time.monotonic()
    results = run_hotpath(config, args.out, log=log, logs=args.logs)
    print()
    print(format_hotpath(results))
    print(f"\nwrote {args.out / 'bench.json'}, {args.out / 'report.txt'} in "
          f"{time.monotonic() - started:.0f} s")
    return 0 if all(r.get("complete") for r in results["rungs"].values()) else 1


def _brokers(choice: str | None) -> tuple[BrokerKind, ...] | None:
    if choice is None:
        return None
    return ("embedded", "kafka") if choice == "both" else (choice,)  # type: ignore[return-value]


def _ceilings(args: argparse.Namespace) -> tuple[str, ...] | None:
    """``--ceilings``: None (each plan's own), else the named ones (empty: none)."""
    if args.ceilings is None:
        return None
    return tuple(c for c in args.ceilings.split(",") if c)


def _scaleout(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    """``python -m bench scaleout``: the scale-out section alone (or its plan, ``--dry-run``)."""
    out = args.out or Path(f"bench-results/scaleout-{args.profile}")
    results: dict[str, Any] = {"profile": f"{args.profile} (scale-out only)", "workloads": {}}
    ns = tuple(int(x) for x in args.ns.split(",") if x) or None
    only = tuple(w for w in args.only.split(",") if w)
    if args.dry_run:
        run_scaleout(SCALE_PROFILES[args.profile], results, Path("."), log=log,
                     launcher=args.launcher, budget_s=args.budget_s, ns=ns, only=only,
                     dry_run=True, backend=args.backend, gpu_executor=args.gpu_executor,
                     no_mps=args.no_mps, ceilings=_ceilings(args))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    results["env"] = environment()
    path = out / "bench.json"

    def save() -> None:
        path.write_text(json.dumps(results, indent=1, default=str))

    started = time.monotonic()
    run_scaleout(SCALE_PROFILES[args.profile], results, args.logs or out / "logs", log=log,
                 launcher=args.launcher, budget_s=args.budget_s, ns=ns, only=only, save=save,
                 backend=args.backend, broker=args.broker, gpu_executor=args.gpu_executor,
                 profile_procs=tuple(p for p in args.profile_procs.split(",") if p),
                 profile_s=args.profile_s, no_mps=args.no_mps, ceilings=_ceilings(args))
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    save()
    report = format_report(results)
    (out / "report.txt").write_text(report + "\n")
    plots = write_plots(results, out)
    print(report)
    print(f"\nwrote {path}, {out / 'report.txt'}" + "".join(f", {p}" for p in plots))
    return 1 if results.get("scaleout", {}).get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
