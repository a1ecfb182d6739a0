"""Memory of the device tables' RocksDB stores under steady writes: ``python -m
bench.table_memory``.

Drives the worker's real device tables (:func:`streamapp.tables.faust_tables.define_tables`:
``device_stats`` and ``device_windows``, RocksDB through rocksdict, one database per table and
partition) with the worker's own writer
(:class:`~streamapp.tables.device_state.DeviceStateObserver`): ``--rate`` results a second from
``--devices`` devices, flushed every ``state_flush_interval_ms`` as the pipeline does. Time is
simulated (a fake clock steps by the flush interval), so ``--seconds`` of traffic take as long as
the writes cost on this machine, not ``--seconds``. The changelog records Faust builds for each
write are dropped from the producer's buffer (no broker). Then the process idles for ``--idle-s``
real seconds, to show whether memory keeps growing without writes.

Each configuration runs in a fresh process on a fresh data dir, one after the other:

* ``faust``: Faust 0.15.3's RocksDB defaults (``RocksDBOptions()``: 64 MiB write buffer,
  3 memtables, a 2 GiB block cache per database), what the tables had before they passed
  bounds;
* ``streamapp``: the options ``define_tables`` passes now (``STREAMAPP_TABLE_*`` settings).

Prints, per sample: simulated seconds, the process's RSS, RocksDB's own count of memtable bytes
(``rocksdb.cur-size-all-mem-tables``) and block-cache bytes (``rocksdb.block-cache-usage``)
summed over every open database, the table bytes written so far (keys + values) and the number
of databases; then each configuration's RSS growth and the ratio between them. ``--json FILE``
writes the samples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

CONFIGS = ("faust", "streamapp")
MIB = 1024 * 1024


class _Event:
    """The request record's event, as Faust hands it to the pipeline (weak-referenceable)."""

    class _Message:
        def __init__(self, topic: str, partition: int, key: bytes) -> None:
            self.topic, self.partition, self.key = topic, partition, key

    def __init__(self, topic: str, partition: int, key: bytes) -> None:
        self.message = self._Message(topic, partition, key)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def _rocksdb_mib(tables: Any, prop: str) -> float:
    total = 0
    for table in (tables.stats, tables.windows):
        for db in list(table.data._dbs.values()):
            total += db.property_int_value(prop) or 0
    return total / MIB


async def _child(config: str, args: argparse.Namespace) -> None:
    import faust
    from faust.stores.rocksdb import RocksDBOptions

    from streamapp.agents.observer import Outcome
    from streamapp.settings import Settings
    from streamapp.tables.device_state import DeviceStateObserver
    from streamapp.tables.faust_tables import define_tables
    from streamapp.tables.windows import WindowPlan

    rng = random.Random(1)
    with tempfile.TemporaryDirectory(prefix="table-memory-") as tmp:
        settings = Settings(app_id="table-memory", topic_partitions=args.partitions,
                            data_dir=Path(tmp), broker_kind="kafka")
        app = faust.App(settings.app_id, broker="kafka://127.0.0.1:1", datadir=tmp,
                        topic_partitions=args.partitions)
        tables = define_tables(app, settings)
        for table in (tables.stats, tables.windows):
            if config == "faust":
                table.data.rocksdb_options = RocksDBOptions(use_rocksdict=True)
            # every partition's database open, as on a worker that owns all of them
            for partition in range(args.partitions):
                table.data._db_for_partition(partition)
        opts = tables.stats.data.rocksdb_options
        print(json.dumps({"config": config, "options": {
            "write_buffer_mib": opts.write_buffer_size / MIB,
            "max_write_buffer_number": opts.max_write_buffer_number,
            "block_cache_mib": opts.block_cache_size / MIB,
            "databases": 2 * args.partitions}}), flush=True)

        clock = [1.7e9]
        observer = DeviceStateObserver(
            tables, WindowPlan.from_settings(settings), request_topic=settings.request_topic,
            ewma_alpha=settings.latency_ewma_alpha, clock=lambda: clock[0],
        )
        devices = [f"device-{i:05d}".encode() for i in range(args.devices)]
        events = [_Event(settings.request_topic, tables.partition_of(k), k) for k in devices]
        step_s = settings.state_flush_interval_ms / 1000.0
        per_step = args.rate * step_s
        written = 0.0
        buffer = app.producer.buffer.pending
        seq = [0] * args.devices

        def sample(t_s: float, phase: str) -> None:
            print(json.dumps({
                "config": config, "phase": phase, "t_s": round(t_s, 1),
                "wall_s": round(time.monotonic() - start, 1), "rss_mib": round(_rss_mib(), 1),
                "memtables_mib": round(_rocksdb_mib(tables, "rocksdb.cur-size-all-mem-tables"), 1),
                "block_cache_mib": round(_rocksdb_mib(tables, "rocksdb.block-cache-usage"), 1),
                "written_mib": round(written / MIB, 1),
            }), flush=True)

        start = time.monotonic()
        sample(0.0, "load")
        t, carry, next_sample = 0.0, 0.0, args.sample_s
        while t < args.seconds:
            carry += per_step
            n, carry = int(carry), carry - int(carry)
            for _ in range(n):
                i = rng.randrange(args.devices)
                seq[i] += 1
                e2e = rng.uniform(5.0, 40.0)
                observer.on_outcome(Outcome(
                    kind="result", device_id=devices[i].decode(), request_id=f"r{i}-{seq[i]}",
                    seq=seq[i], model="digits", reason=None, label=str(rng.randrange(10)),
                    score=rng.random(), e2e_ms=e2e, queue_ms=e2e / 2, infer_ms=2.0, attempt=0,
                    ts=clock[0], partition=events[i].message.partition, event=events[i],
                    batch_size=32,
                ))
            await observer.flush()
            while not buffer.empty():  # the changelog records a producer would send
                fut = buffer.get_nowait()
                msg = fut.message
                written += len(msg.key or b"") + len(msg.value or b"")
            t += step_s
            clock[0] += step_s
            if t >= next_sample:
                sample(t, "load")
                next_sample += args.sample_s
        idle_end = time.monotonic() + args.idle_s
        while time.monotonic() < idle_end:
            await asyncio.sleep(min(args.idle_s / 3, idle_end - time.monotonic()))
            sample(t, "idle")


def _summary(samples: list[dict[str, Any]], heads: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'config':10} {'phase':5} {'sim s':>6} {'wall s':>6} {'RSS MiB':>8} "
             f"{'memtables':>9} {'blk cache':>9} {'written':>8}"]
    for s in samples:
        lines.append(f"{s['config']:10} {s['phase']:5} {s['t_s']:6.0f} {s['wall_s']:6.1f} "
                     f"{s['rss_mib']:8.1f} {s['memtables_mib']:9.1f} "
                     f"{s['block_cache_mib']:9.1f} {s['written_mib']:8.1f}")
    growth: dict[str, float] = {}
    for config, head in heads.items():
        mine = [s for s in samples if s["config"] == config]
        load = [s for s in mine if s["phase"] == "load"]
        growth[config] = load[-1]["rss_mib"] - load[0]["rss_mib"]
        o = head["options"]
        lines.append(
            f"{config}: {o['databases']} databases, write buffer {o['write_buffer_mib']:g} MiB "
            f"x {o['max_write_buffer_number']}, block cache {o['block_cache_mib']:g} MiB each; "
            f"RSS {load[0]['rss_mib']:.1f} -> {load[-1]['rss_mib']:.1f} MiB under load "
            f"(+{growth[config]:.1f}), {mine[-1]['rss_mib']:.1f} MiB after idling; memtables "
            f"{load[-1]['memtables_mib']:.1f} MiB at the end of the load")
    if len(growth) == 2 and growth.get("streamapp"):
        lines.append(f"RSS growth faust / streamapp: {growth['faust'] / growth['streamapp']:.1f}x")
    return "\n".join(lines)


def _environment(config: str) -> dict[str, str]:
    """The environment of ``config``'s run: Faust's defaults take no STREAMAPP_TABLE_*
    setting, so one it does not use cannot fail that run (every other setting is checked)."""
    from streamapp.settings import ENV_PREFIX

    return {k: v for k, v in os.environ.items()
            if config == "streamapp" or not k.upper().startswith(f"{ENV_PREFIX}TABLE_")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.table_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=300)
    parser.add_argument("--rate", type=float, default=400.0, help="results per simulated second")
    parser.add_argument("--seconds", type=float, default=270.0, help="simulated seconds of load")
    parser.add_argument("--partitions", type=int, default=16,
                        help="partitions of the tables, all owned by this process")
    parser.add_argument("--sample-s", type=float, default=30.0, help="simulated s between samples")
    parser.add_argument("--idle-s", type=float, default=6.0, help="real seconds idle afterwards")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, of: {', '.join(CONFIGS)}")
    parser.add_argument("--json", type=Path, help="write the samples here")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        asyncio.run(_child(args.child, args))
        return 0
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or not configs:
        parser.error(f"unknown config(s) {', '.join(unknown) or repr(args.configs)}; use "
                     f"{', '.join(CONFIGS)}")
    # upper bounds: what one run of this tool can do in reasonable time and memory
    for name, most in (("devices", 1_000_000), ("rate", 1e7), ("seconds", 1e7),
                       ("partitions", 1024), ("sample_s", 1e7), ("idle_s", 86_400)):
        value = getattr(args, name)
        if not (0 <= value if name == "idle_s" else 0 < value) or not value <= most:
            parser.error(f"--{name.replace('_', '-')} must be "
                         f"{'at least' if name == 'idle_s' else 'above'} 0 and at most "
                         f"{most:,g}, not {value}")
    if args.json is not None:
        try:  # written at the end: a path that cannot be is refused before the run
            if not str(args.json).strip() or args.json.is_dir():
                raise IsADirectoryError("a directory")
            with args.json.open("a"):
                pass
        except OSError as exc:
            parser.error(f"--json: cannot write a file at {str(args.json)!r} "
                         f"({exc.strerror or exc})")
    from streamapp.exceptions import ConfigError
    from streamapp.settings import load_settings

    for config in configs:  # the settings each run takes, checked before any run
        try:
            with mock.patch.dict(os.environ, _environment(config), clear=True):
                settings = load_settings(app_id="table-memory",
                                         topic_partitions=args.partitions)
        except ConfigError as exc:
            parser.error(f"{exc} (the {config} run)")
        if settings.state_flush_interval_ms <= 0:
            parser.error("state_flush_interval_ms must be above 0 here: the simulated clock "
                         "steps by the flush interval")
        steps = args.seconds / (settings.state_flush_interval_ms / 1e3)
        if steps > 1_000_000:
            parser.error(f"--seconds {args.seconds:g} at a state_flush_interval_ms of "
                         f"{settings.state_flush_interval_ms:g} is {steps:g} flushes: the "
                         "simulated clock steps by the flush interval, so it must be above 0 "
                         "and the run at most 1,000,000 flushes")
        if settings.processing_guarantee == "exactly_once":
            parser.error("processing_guarantee=exactly_once keeps device tables in memory, "
                         "not in RocksDB: this measures RocksDB stores (unset "
                         "STREAMAPP_PROCESSING_GUARANTEE)")
    child_args = [a for a in (argv if argv is not None else sys.argv[1:])]
    samples: list[dict[str, Any]] = []
    heads: dict[str, dict[str, Any]] = {}
    for config in configs:
        run = subprocess.run(
            [sys.executable, "-m", "bench.table_memory", *child_args, "--child", config],
            stdout=subprocess.PIPE, text=True, env=_environment(config),
        )
        if run.returncode != 0:
            print(f"python -m bench.table_memory: the {config} run failed (exit "
                  f"{run.returncode}); its error is above", file=sys.stderr)
            return 1
        out = run.stdout
        for line in out.splitlines():
            row = json.loads(line)
            if "options" in row:
                heads[config] = row
            else:
                samples.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(_summary(samples, heads))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                  if k not in ("json", "child")},
                                         "heads": heads, "samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
